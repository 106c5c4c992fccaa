"""Horovod's TensorFlow 2 synthetic benchmark on hora: img/sec of data-parallel training steps.

A port of Horovod's ``examples/tensorflow2/tensorflow2_synthetic_benchmark.py`` with the same
flags and output; only the import differs (``import hora.tensorflow as hvd``). Every step runs a
``tf.keras.applications`` model (``weights=None``) forward and backward on one fixed random
batch, averages the gradients across ranks with ``hvd.DistributedGradientTape`` and applies
them (inside ``tf.function`` unless ``--eager``)::

    hora run -np 2 python examples/tensorflow_synthetic_benchmark.py
    hora run -np 2 python examples/tensorflow_synthetic_benchmark.py --model ResNet50 \\
        --image-size 224                                    # Horovod's defaults (slow on CPU)
    python examples/tensorflow_synthetic_benchmark.py       # 1 process

Output (rank 0), Horovod's format::

    Model: MobileNetV2
    Batch size: 32
    Number of CPUs: 2
    Running warmup...
    Running benchmark...
    Iter #0: 95.1 img/sec per CPU
    ...
    Img/sec per CPU: 94.2 +-3.1
    Total img/sec on 2 CPU(s): 188.4 +-6.2

hora additions: ``--image-size`` (default 64) and the default model ``MobileNetV2`` (Horovod:
ResNet50 at 224 pixels, minutes per run on two CPU cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402 - after the environment above
import tensorflow as tf  # noqa: E402

import hora.tensorflow as hvd  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="TensorFlow Synthetic Benchmark",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                        help="use fp16 compression during allreduce")
    parser.add_argument("--model", type=str, default="MobileNetV2",
                        help="model to benchmark (a tf.keras.applications name)")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
    parser.add_argument("--image-size", type=int, default=64,
                        help="input height and width (hora addition; Horovod: 224)")
    parser.add_argument("--num-warmup-batches", type=int, default=10,
                        help="number of warm-up batches that don't count towards benchmark")
    parser.add_argument("--num-batches-per-iter", type=int, default=10,
                        help="number of batches per benchmark iteration")
    parser.add_argument("--num-iters", type=int, default=10,
                        help="number of benchmark iterations")
    parser.add_argument("--eager", action="store_true", default=False,
                        help="enables eager execution")
    parser.add_argument("--no-cuda", action="store_true", default=False,
                        help="disables CUDA training (hora trains on the CPU either way)")
    args = parser.parse_args(argv)

    hvd.init()
    model = getattr(tf.keras.applications, args.model)(
        weights=None, input_shape=(args.image_size, args.image_size, 3))
    opt = tf.optimizers.SGD(0.01)
    data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
    target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=999, dtype=tf.int64)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    loss_fn = tf.losses.SparseCategoricalCrossentropy()

    def benchmark_step(first_batch: bool) -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        gradients = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(gradients, model.trainable_variables))
        # Broadcast initial variables after the first step, when the optimizer's slots exist.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)

    step = benchmark_step if args.eager else tf.function(benchmark_step)

    def log(s: str) -> None:
        if hvd.rank() == 0:
            print(s, flush=True)

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    device = "CPU"
    log(f"Number of {device}s: {hvd.size()}")

    log("Running warmup...")
    step(first_batch=True)
    timeit.timeit(lambda: step(first_batch=False), number=args.num_warmup_batches)

    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        time = timeit.timeit(lambda: step(first_batch=False), number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / time
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)

    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} "
        f"+-{hvd.size() * img_sec_conf:.1f}")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
