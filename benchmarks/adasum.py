"""Adasum against averaging on the digits demo: per-epoch validation loss and accuracy, one job.

    python benchmarks/adasum.py                          # 4 ranks, lr 0.02 0.08 0.32, 2 seeds
    python benchmarks/adasum.py -np 2 --lrs 0.05,0.5 --epochs 6 --seeds 1
    hora run -np 4 python benchmarks/adasum.py --worker  # what the first line launches

The ranks train the MLP of ``examples/torch_digits.py`` (scikit-learn's handwritten digits,
1437 training / 360 validation images, no download) with SGD (momentum 0.9), ``--batch`` samples
per rank per step, no warmup, once per (learning rate, op, seed), the ops interleaved:

* ``Average``: ``hvd.DistributedOptimizer(opt)``, gradients averaged, then one SGD step;
* ``Adasum``: ``hvd.DistributedOptimizer(opt, op=hvd.Adasum)``, Horovod's delta optimizer: each
  rank takes its own SGD step, the parameter deltas are combined with Adasum.

The learning rate is the one handed to SGD, the same for both ops (Horovod's recipe scales it
by the number of ranks for Average; the Adasum guide says it needs no such scaling). Every run
starts from the same weights (the seed) and sees the same batches. Rank 0 prints one line per
epoch and, at the end, Markdown tables: validation accuracy per epoch (mean over seeds) and the
final loss and accuracy of every run, with seconds per epoch.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

OPS = ("Average", "Adasum")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-np", type=int, default=4, help="ranks (a power of two for Adasum)")
    p.add_argument("--lrs", default="0.02,0.08,0.32", help="comma-separated SGD learning rates")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--seeds", default="42,43", help="comma-separated seeds (weights, shuffles)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--worker", action="store_true", help="run inside `hora run` (internal)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds for the whole job")
    return p.parse_args(argv)


def _run(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler, Subset

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from torch_digits import MLP, global_metrics, load_digits_split, metric_totals

    import hora.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    train_ds, val_ds, n_in, n_out = load_digits_split(0, 0.2)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), size)), batch_size=256)
    lrs = [float(x) for x in args.lrs.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    # results[(op, lr, seed)] = [(val_loss, val_acc, seconds), ...] per epoch
    results: dict[tuple[str, float, int], list[tuple[float, float, float]]] = {}
    if rank == 0:
        print(f"digits: {size} ranks x batch {args.batch}, SGD momentum {args.momentum}, "
              f"{args.epochs} epochs, lrs {lrs}, seeds {seeds}", flush=True)
    for lr in lrs:
        for seed in seeds:
            for op_name in OPS:
                torch.manual_seed(seed)
                model = MLP(n_in, n_out)
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)
                opt = hvd.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum),
                    named_parameters=model.named_parameters(), op=getattr(hvd, op_name))
                sampler: DistributedSampler[Any] = DistributedSampler(
                    train_ds, num_replicas=size, rank=rank, shuffle=True, seed=seed)
                loader = DataLoader(train_ds, batch_size=args.batch, sampler=sampler)
                curve = []
                for epoch in range(args.epochs):
                    sampler.set_epoch(epoch)
                    model.train()
                    started = time.perf_counter()
                    for x, y in loader:
                        opt.zero_grad()
                        F.cross_entropy(model(x), y).backward()
                        opt.step()
                    seconds = time.perf_counter() - started
                    loss, acc = global_metrics(metric_totals(model, val_loader),
                                               f"val.{op_name}.{lr}.{seed}.{epoch}")
                    curve.append((loss, acc, seconds))
                    if rank == 0:
                        print(f"{op_name:7s} lr {lr:<6g} seed {seed} epoch {epoch + 1:2d}  "
                              f"val loss {loss:8.4f}  acc {100 * acc:5.1f}%  {seconds:.2f} s",
                              flush=True)
                results[(op_name, lr, seed)] = curve
    if rank == 0:
        print(_tables(results, lrs, seeds, args.epochs), flush=True)
    hvd.shutdown()


def _fmt_loss(x: float) -> str:
    return f"{x:.3f}" if x == x and x < 1e6 else "diverged"


def _tables(results: dict[tuple[str, float, int], list[tuple[float, float, float]]],
            lrs: list[float], seeds: list[int], epochs: int) -> str:
    """Markdown: accuracy per epoch (mean over seeds), then final results per run."""
    head = "| lr | op | " + " | ".join(f"ep {e + 1}" for e in range(epochs)) + " |"
    lines = ["", "Validation accuracy (%) per epoch, mean over seeds:", "", head,
             "|" + "---|" * (epochs + 2)]
    for lr in lrs:
        for op in OPS:
            accs = [statistics.mean(results[(op, lr, s)][e][1] for s in seeds) * 100
                    for e in range(epochs)]
            lines.append(f"| {lr:g} | {op} | " + " | ".join(f"{a:.1f}" for a in accs) + " |")
    lines += ["", "Final epoch, every run:", "",
              "| lr | op | seed | val loss | val acc (%) | best acc (%) | s/epoch |",
              "|---|---|---|---|---|---|---|"]
    for lr in lrs:
        for op in OPS:
            for s in seeds:
                curve = results[(op, lr, s)]
                loss, acc, _ = curve[-1]
                best = max(c[1] for c in curve)
                per_epoch = statistics.median(c[2] for c in curve)
                lines.append(f"| {lr:g} | {op} | {s} | {_fmt_loss(loss)} | {100 * acc:.1f} | "
                             f"{100 * best:.1f} | {per_epoch:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        _run(args)
        return 0
    me = Path(__file__).resolve()
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(args.np), sys.executable,
           str(me), "--worker", "--lrs", args.lrs, "--epochs", str(args.epochs), "--batch",
           str(args.batch), "--seeds", args.seeds, "--momentum", str(args.momentum)]
    print("$ " + shlex.join(cmd), flush=True)
    try:
        return subprocess.run(cmd, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"timed out after {args.timeout} s", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
