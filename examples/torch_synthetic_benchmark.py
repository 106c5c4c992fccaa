"""Horovod's PyTorch synthetic benchmark on hora: img/sec of data-parallel training steps.

A port of Horovod's ``examples/pytorch/pytorch_synthetic_benchmark.py`` with the same flags and
the same output; only the import differs (``import hora.torch as hvd``). Every step is
``zero_grad()``, forward, cross entropy, ``backward()`` (gradients are averaged across ranks
while it runs) and ``step()``, on one fixed random batch (no data loading)::

    hora run -np 2 python examples/torch_synthetic_benchmark.py
    hora run -np 2 python examples/torch_synthetic_benchmark.py --fp16-allreduce
    hora run -np 2 python examples/torch_synthetic_benchmark.py --model resnet50   # torchvision
    python examples/torch_synthetic_benchmark.py                                    # 1 process

Output (rank 0), exactly Horovod's format::

    Model: tiny_resnet
    Batch size: 32
    Number of CPUs: 2
    Running warmup...
    Running benchmark...
    Iter #0: 479.3 img/sec per CPU
    ...
    Img/sec per CPU: 484.7 +-26.4
    Total img/sec on 2 CPU(s): 969.5 +-52.9

As in Horovod, img/sec is measured on rank 0 and "Total" is ``size x`` that (± 1.96 standard
deviations over the iterations). ``--model`` takes any ``torchvision.models`` constructor name
when torchvision is installed; the default, ``tiny_resnet``, is built in (a ResNet-10-style
network, 0.44 M parameters, 1000 classes) so the benchmark runs without torchvision, at
80x80 pixels so that the default run takes ~10-30 s on two CPU cores (``--image-size``:
a hora addition; torchvision models default to Horovod's 224).
"""

from __future__ import annotations

import argparse
import sys
import timeit

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import hora.torch as hvd

BUILTIN_MODELS = ("tiny_resnet",)


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with batch norm and a shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class TinyResNet(nn.Module):
    """A ResNet-10-style network: ResNet's stem, one basic block per stage, 1000 classes."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64, 128),
                 num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 7, 2, 3, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, c_in = [], widths[0]
        for i, width in enumerate(widths):
            blocks.append(BasicBlock(c_in, width, 1 if i == 0 else 2))
            c_in = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_model(name: str) -> nn.Module:
    """The built-in ``tiny_resnet``, or ``torchvision.models.<name>()`` (untrained)."""
    if name == "tiny_resnet":
        return TinyResNet()
    try:
        from torchvision import models
    except ImportError:
        sys.exit(f"--model {name} needs torchvision (pip install torchvision); without it, "
                 f"the built-in models are: {', '.join(BUILTIN_MODELS)}")
    if not callable(getattr(models, name, None)):
        sys.exit(f"--model {name}: torchvision.models has no such model")
    return getattr(models, name)()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                        help="use fp16 compression during allreduce")
    parser.add_argument("--model", type=str, default="tiny_resnet",
                        help="model to benchmark: tiny_resnet (built in) or any "
                             "torchvision.models name")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
    parser.add_argument("--num-warmup-batches", type=int, default=10,
                        help="number of warm-up batches that don't count towards benchmark")
    parser.add_argument("--num-batches-per-iter", type=int, default=10,
                        help="number of batches per benchmark iteration")
    parser.add_argument("--num-iters", type=int, default=10,
                        help="number of benchmark iterations")
    parser.add_argument("--no-cuda", action="store_true", default=False,
                        help="disables CUDA training")
    parser.add_argument("--use-adasum", action="store_true", default=False,
                        help="use adasum algorithm to do reduction")
    parser.add_argument("--image-size", type=int, default=None,
                        help="height and width of the synthetic images (hora addition); "
                             "default 80 for tiny_resnet, 224 for torchvision models")
    parser.add_argument("--num-threads", type=int, default=1,
                        help="torch threads per rank (hora addition). 1 because the ranks of a "
                             "job share the host's cores, and more threads than free cores make "
                             "torch's CPU kernels 10x slower; raise it when cores >= ranks x "
                             "threads")
    args = parser.parse_args(argv)
    for flag in ("batch_size", "num_batches_per_iter", "num_iters", "num_threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.num_warmup_batches < 0:
        parser.error("--num-warmup-batches must be >= 0")
    return args


def main(argv: list[str] | None = None) -> list[float]:
    """Run the benchmark; return rank 0's img/sec per iteration (every rank measures its own)."""
    args = parse_args(argv)
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())  # Horovod: pin GPU to local rank
        torch.backends.cudnn.benchmark = True
    torch.set_num_threads(args.num_threads)

    model = build_model(args.model)
    image_size = args.image_size or (80 if args.model in BUILTIN_MODELS else 224)
    if args.cuda:
        model.cuda()
    lr_scaler = hvd.size() if not args.use_adasum else 1  # Adasum needs no larger lr
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Fixed fake data, created once and reused.
    data = torch.randn(args.batch_size, 3, image_size, image_size)
    target = torch.LongTensor(args.batch_size).random_() % 1000
    if args.cuda:
        data, target = data.cuda(), target.cuda()

    def benchmark_step() -> None:
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()

    def log(s: str) -> None:
        if hvd.rank() == 0:
            print(s, flush=True)

    device = "GPU" if args.cuda else "CPU"
    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {device}s: {hvd.size()}")

    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)

    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        elapsed = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / elapsed
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)

    img_sec_mean = float(np.mean(img_secs))
    img_sec_conf = float(1.96 * np.std(img_secs))
    log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} "
        f"+-{hvd.size() * img_sec_conf:.1f}")
    hvd.shutdown()
    return img_secs


if __name__ == "__main__":
    main()
