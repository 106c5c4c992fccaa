"""Data-parallel Keras 3 training with ``hora.keras`` (Horovod's Keras API): the digits demo.

Two ranks train one small MLP on scikit-learn's handwritten digits (1797 8x8 images, shipped
inside the package: no download) with ``model.fit``. Each rank trains on its own half of the
training set; ``hvd.DistributedOptimizer`` averages the gradients of every step, so both ranks
hold identical weights. Horovod's Keras recipe, unchanged except for the import:

* ``BroadcastGlobalVariablesCallback(0)``: rank 0's initial weights (and optimizer slots) go to
  every rank after the first batch;
* the learning rate is scaled by ``hvd.size()`` and reached by ``LearningRateWarmupCallback``
  over the first epoch, then decayed by ``LearningRateScheduleCallback``;
* ``MetricAverageCallback``: the epoch's metrics (each rank scores its own shard of the
  validation set) are averaged across ranks;
* only rank 0 prints progress and writes the checkpoint.

Run it::

    hora run -np 2 python examples/keras_digits.py
    hora run -np 2 python examples/keras_digits.py --epochs 8 --checkpoint /tmp/digits.keras
    python examples/keras_digits.py          # one process, no launcher (size 1)

It ends with a line like ``final validation accuracy 97.5% (2 ranks)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402 - after the environment above
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hora.keras as hvd  # noqa: E402

DEFAULT_CHECKPOINT = Path(tempfile.gettempdir()) / "hora_examples" / "keras_digits.keras"


def load_digits_split(seed: int, val_fraction: float
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Standardized train / validation arrays, identical on every rank (fixed ``seed``)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = data.data.astype("float32")
    y = data.target.astype("int64")
    order = np.random.RandomState(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_val = int(len(x) * val_fraction)
    mean, std = x[n_val:].mean(0), x[n_val:].std(0) + 1e-6
    x = (x - mean) / std
    return x[n_val:], y[n_val:], x[:n_val], y[:n_val]


def build_model(features: int, classes: int) -> keras.Model:
    return keras.Sequential([keras.Input((features,)),
                             keras.layers.Dense(128, activation="relu"),
                             keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(classes)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by size")
    parser.add_argument("--warmup-epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    args = parser.parse_args(argv)

    hvd.init()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rank, size = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(args.seed + rank)  # ranks start apart; the broadcast fixes it

    x_train, y_train, x_val, y_val = load_digits_split(args.seed, val_fraction=0.2)
    x_train, y_train = x_train[rank::size], y_train[rank::size]  # this rank's shard
    x_val, y_val = x_val[rank::size], y_val[rank::size]

    model = build_model(x_train.shape[1], 10)
    scaled_lr = args.lr * size
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(scaled_lr, momentum=0.9))
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks: list[keras.callbacks.Callback] = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(scaled_lr, warmup_epochs=args.warmup_epochs,
                                                 verbose=1),
        hvd.callbacks.LearningRateScheduleCallback(scaled_lr, 0.7,
                                                   start_epoch=args.warmup_epochs),
    ]
    if rank == 0:
        args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(str(args.checkpoint)))
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
              validation_data=(x_val, y_val), callbacks=callbacks,
              verbose=2 if rank == 0 else 0)

    # distributed evaluation: every rank scores its shard, the counts are summed
    predicted = np.argmax(model.predict(x_val, verbose=0), axis=1)
    correct, total = hvd.allreduce(np.array([float((predicted == y_val).sum()), len(y_val)]),
                                   op=hvd.Sum, name="final_accuracy")
    if rank == 0:
        print(f"final validation accuracy {100 * correct / total:.1f}% ({size} ranks)",
              flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
