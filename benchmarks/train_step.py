"""Training step: hora's DistributedOptimizer vs torch DDP (gloo) vs no gradient sync, one job.

    python benchmarks/train_step.py                        # 2 ranks, MLP 784-2048-2048-10
    python benchmarks/train_step.py --rounds 15 --steps 10
    python benchmarks/train_step.py --steps 2 --rounds 1 --warmup 1 --hidden 256   # smoke test
    hora run -np 2 python benchmarks/train_step.py --worker   # what the first line launches

The same 2 processes (started by ``hora run -np 2``, one torch thread each) train three copies of
one MLP (784-2048-2048-10, 5.8 M parameters, 23 MB of float32 gradients) on a fixed synthetic
batch of 64 samples per rank, plain SGD. Each step is ``zero_grad()``, forward, cross entropy,
``backward()``, ``step()``:

* ``hora``: ``hora.torch.DistributedOptimizer`` (allreduces start from gradient hooks during
  backward; ``step()`` waits for them);
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over a gloo process group (initialized
  on 127.0.0.1 with a free port that rank 0 shares through ``hvd.broadcast_object``), default
  bucketing (25 MB buckets);
* ``nosync``: the same steps without any gradient exchange (the compute-only floor).

This machine's speed swings 2-6x within minutes, so variants are interleaved in rounds (each
round runs every variant for ``--steps`` steps, the order rotated per round: A B C, B C A,
C A B, ...) and medians over rounds are reported. Samples/s counts both ranks:
``size * batch * steps / time`` of the slower rank. ``overhead`` is the extra time per step over
``nosync`` (``t_variant / t_nosync - 1``); ``hora/ddp`` is the ratio of samples/s (median over
rounds of the per-round ratio, and ratio of the medians). Peak RSS is each rank's
``ru_maxrss``; it covers all three models in the process, so the table also shows how much it
grew while each variant was first set up and run.
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

VARIANTS = ("hora", "ddp", "nosync")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _mlp(hidden: int, depth: int) -> Any:
    from torch import nn

    layers: list[nn.Module] = []
    width = 784
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hora.torch as hvd
    from hora.core.engine import context

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    port = hvd.broadcast_object(_free_port() if rank == 0 else None, root_rank=0, name="port")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)

    torch.manual_seed(0)  # the same initial weights everywhere; hora/DDP also broadcast them
    base = _mlp(args.hidden, args.depth)
    n_params = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own synthetic batch
    x = torch.randn(args.batch_size, 784, generator=gen)
    y = torch.randint(0, 10, (args.batch_size,), generator=gen)

    def make_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return step

    def copy_of_base() -> torch.nn.Module:
        model = _mlp(args.hidden, args.depth)
        model.load_state_dict(base.state_dict())
        return model

    # torch's one-time costs (autograd engine, first use of its kernels: ~70 MiB of RSS) are
    # paid on a small model before anything is measured
    small = _mlp(64, args.depth)
    small_opt = torch.optim.SGD(small.parameters(), lr=args.lr)
    for _ in range(2):
        small_opt.zero_grad()
        F.cross_entropy(small(x), y).backward()
        small_opt.step()
    del small, small_opt
    rss: dict[str, float] = {"setup": _peak_rss_mib()}
    steps: dict[str, Callable[[], None]] = {}
    models: dict[str, torch.nn.Module] = {}

    def build(variant: str) -> None:
        model = copy_of_base()
        if variant == "hora":
            opt = torch.optim.SGD(model.parameters(), lr=args.lr)
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        elif variant == "ddp":
            model = DDP(model)
            opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        models[variant], steps[variant] = model, make_step(model, opt)
        for _ in range(args.warmup):
            steps[variant]()
        dist.barrier()

    # Set up and warm up one at a time, to see each one's memory; nosync first, so that
    # whatever a plain training step costs once is not charged to hora or DDP.
    for variant in ("nosync", "hora", "ddp"):
        before = _peak_rss_mib()
        build(variant)
        rss[variant] = _peak_rss_mib() - before

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        for variant in order:
            dist.barrier()
            step = steps[variant]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[variant].append(time.perf_counter() - t0)
    dist.barrier()

    # Sanity: the synchronized replicas must be identical on every rank.
    with torch.no_grad():
        sums = {v: float(sum(p.double().sum() for p in models[v].parameters()))
                for v in VARIANTS}
    all_sums = hvd.allgather_object(sums, name="checksums")
    all_times = hvd.allgather_object(times, name="times")
    all_rss = hvd.allgather_object({**rss, "peak": _peak_rss_mib()}, name="rss")
    if rank == 0:
        cfg = context.get().config
        _report(args, size, n_params, all_times, all_rss, all_sums, cfg)
    dist.destroy_process_group()
    hvd.shutdown()


def _report(args: argparse.Namespace, size: int, n_params: int,
            all_times: list[dict[str, list[float]]], all_rss: list[dict[str, float]],
            all_sums: list[dict[str, float]], cfg: Any) -> None:
    import torch

    samples = size * args.batch_size * args.steps
    # per round: the slower rank's time
    slowest = {v: [max(t[v][r] for t in all_times) for r in range(args.rounds)]
               for v in VARIANTS}
    rate = {v: [samples / t for t in slowest[v]] for v in VARIANTS}
    med = {v: statistics.median(rate[v]) for v in VARIANTS}
    med_t = {v: statistics.median(slowest[v]) / args.steps for v in VARIANTS}
    per_round_ratio = statistics.median(a / b for a, b in zip(rate["hora"], rate["ddp"]))
    overhead = {v: med_t[v] / med_t["nosync"] - 1 for v in VARIANTS}
    round_over = {v: statistics.median(t / n - 1 for t, n in zip(slowest[v], slowest["nosync"]))
                  for v in VARIANTS}

    dims = "-".join(["784", *[str(args.hidden)] * args.depth, "10"])
    print(f"\ntrain step, {size} ranks x 1 thread, MLP {dims} ({n_params / 1e6:.2f} M params, "
          f"{n_params * 4 / 2**20:.1f} MiB of float32 gradients), batch {args.batch_size} per "
          f"rank, SGD; {args.rounds} rounds x {args.steps} steps per variant (rotated order), "
          f"{args.warmup} warm-up steps")
    print(f"torch {torch.__version__}; hora fusion threshold {cfg.fusion_threshold >> 20} MiB, "
          f"cycle time {cfg.cycle_time} ms")
    print(f"command: {_command(args)}")
    print(f"\n{'variant':>7} | {'samples/s':>10} {'min':>8} {'max':>8} | {'ms/step':>8} | "
          f"{'overhead':>8} {'(per round)':>11} | {'RSS growth MiB (rank 0, 1..)':>28}")
    for v in VARIANTS:
        growth = " ".join(f"{r[v]:.0f}" for r in all_rss)
        print(f"{v:>7} | {med[v]:10.1f} {min(rate[v]):8.1f} {max(rate[v]):8.1f} | "
              f"{med_t[v] * 1e3:8.1f} | {100 * overhead[v]:7.1f}% {100 * round_over[v]:10.1f}% | "
              f"{growth:>28}")
    print(f"\nhora/ddp samples/s: {med['hora'] / med['ddp']:.2f}x (ratio of medians), "
          f"{per_round_ratio:.2f}x (median of per-round ratios)")
    print(f"hora overhead vs nosync: {100 * overhead['hora']:.1f}%; "
          f"ddp overhead vs nosync: {100 * overhead['ddp']:.1f}%")
    print("peak RSS per rank (MiB, all three variants in one process): "
          + ", ".join(f"rank {i} {r['peak']:.0f} (setup {r['setup']:.0f})"
                      for i, r in enumerate(all_rss)))
    for v in ("hora", "ddp"):
        values = {s[v] for s in all_sums}
        if len(values) != 1:
            print(f"WARNING: {v} replicas differ across ranks: {sorted(values)}")
    print("replicas identical across ranks: "
          + ("yes" if all(len({s[v] for s in all_sums}) == 1 for v in ("hora", "ddp"))
             else "NO"))


def _command(args: argparse.Namespace) -> str:
    """The command that reproduces this run (the launcher form)."""
    return shlex.join(["python", "benchmarks/train_step.py", *_worker_args(args)[1:]])


def _worker_args(args: argparse.Namespace) -> list[str]:
    return ["--worker", "--steps", str(args.steps), "--rounds", str(args.rounds),
            "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
            "--hidden", str(args.hidden), "--depth", str(args.depth), "--lr", str(args.lr),
            "--np", str(args.np)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--np", type=int, default=2, help="ranks")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step, per rank")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden layer width")
    parser.add_argument("--depth", type=int, default=2, help="hidden layers")
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    parser.add_argument("--worker", action="store_true",
                        help="run as one rank (under hora run) instead of launching")
    args = parser.parse_args(argv)
    for name in ("np", "steps", "rounds", "batch_size", "hidden"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.worker:
        worker(args)
        return
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(args.np), sys.executable,
           os.path.abspath(__file__), *_worker_args(args)]
    print("launching: " + shlex.join(["hora", "run", "-np", str(args.np), "python",
                                      "benchmarks/train_step.py", *_worker_args(args)]),
          flush=True)
    sys.exit(subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}))


if __name__ == "__main__":
    main()
