"""Sharded optimizer state: peak memory and step time of hora.torch.ShardedOptimizer against
hora.torch.DistributedOptimizer and torch's ZeroRedundancyOptimizer (gloo, with DDP).

    python benchmarks/sharded_optimizer.py                  # 2 ranks, Adam state 1.0 GiB
    python benchmarks/sharded_optimizer.py --layers 2 --width 1024 --steps 2   # smoke test
    python benchmarks/sharded_optimizer.py --dominant --width 2048 --skip-time \
        --variants distributed,sharded,whole      # one tensor of 80 %: split or whole
    hora run -np 2 python benchmarks/sharded_optimizer.py --worker memory --variant sharded

The model is ``--layers`` Linear(width, width) layers (default 8 x 4096: 134 M float32
parameters, so Adam's two moments are 1.0 GiB), trained with Adam on a fixed batch of 8 rows
per rank (MSE), one torch thread per rank.

* **Memory**: every variant runs in a job of its own (the launcher starts them one after the
  other: three 1 GiB states in one process would not tell which variant used what). Each rank
  reports its peak RSS (``ru_maxrss``), its RSS once the model is built (before any step), and
  the bytes of its optimizer state. Variants: ``distributed`` (hora DistributedOptimizer),
  ``sharded`` (hora ShardedOptimizer), ``zero`` (torch ``DistributedDataParallel`` over a gloo
  group + ``torch.distributed.optim.ZeroRedundancyOptimizer``), ``whole`` (ShardedOptimizer
  with ``split_parameters=False``: every parameter whole on one rank). ``--dominant`` trains
  a model whose one tensor is 80 % of the parameters instead.
* **Step time**: one more job trains the three variants on a smaller model (``--time-width``,
  default 2048: 33.6 M parameters) in interleaved rounds (each round runs every variant for
  ``--steps`` steps, order rotated), so load swings hit every variant alike; medians over the
  rounds, per step, of the slower rank. ``sharded/distributed`` is the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

VARIANTS = ("distributed", "sharded", "zero", "whole")
TIMED = VARIANTS[:3]
DEFAULT_VARIANTS = "distributed,sharded,zero"


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Setup:
    """One variant's model and optimizer in this rank."""

    def __init__(self, variant: str, layers: int, width: int, hvd: Any,
                 dominant: bool = False) -> None:
        import torch
        from torch import nn

        torch.manual_seed(0)
        if dominant:
            self.model = _dominant(width)
        else:
            self.model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        self.net: Any = self.model
        adam = torch.optim.Adam
        named = self.model.named_parameters()
        if variant == "distributed":
            self.opt = hvd.DistributedOptimizer(adam(self.model.parameters(), lr=1e-4),
                                                named_parameters=named)
        elif variant in ("sharded", "whole"):  # whole: no parameter split across ranks
            self.opt = hvd.ShardedOptimizer(adam(self.model.parameters(), lr=1e-4),
                                            named_parameters=named,
                                            split_parameters=variant == "sharded")
        else:
            import torch.distributed as dist
            from torch.distributed.optim import ZeroRedundancyOptimizer

            if not dist.is_initialized():
                port = hvd.broadcast_object(_free_port() if hvd.rank() == 0 else None, 0)
                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                        rank=hvd.rank(), world_size=hvd.size())
            self.net = nn.parallel.DistributedDataParallel(self.model)
            self.opt = ZeroRedundancyOptimizer(self.model.parameters(), optimizer_class=adam,
                                               lr=1e-4)
        g = torch.Generator().manual_seed(1 + hvd.rank())
        self.x = torch.randn(8, width, generator=g)
        self.y = torch.randn(8, width, generator=g)

    def step(self) -> None:
        import torch

        self.opt.zero_grad()
        torch.nn.functional.mse_loss(self.net(self.x), self.y).backward()
        self.opt.step()

    def state_bytes(self) -> int:
        import torch

        opt = getattr(self.opt, "optim", self.opt)  # ZeroRedundancyOptimizer's local one
        return sum(v.numel() * v.element_size() for s in opt.state.values()
                   for v in s.values() if torch.is_tensor(v))


def _dominant(width: int) -> Any:
    """One Linear(width, 4 * width) (80 % of the parameters) and one Linear(width, width)."""
    from torch import nn

    class Dominant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.big = nn.Linear(width, 4 * width)
            self.out = nn.Linear(width, width)

        def forward(self, x: Any) -> Any:
            return self.out(self.big(x).reshape(x.shape[0], 4, width).sum(1))

    return Dominant()


def _worker_memory(args: argparse.Namespace) -> None:
    import torch

    import hora.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    setup = _Setup(args.variant, args.layers, args.width, hvd, args.dominant)
    built = _rss_mib()
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        setup.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in setup.model.parameters())
    report = {"variant": args.variant, "rank": hvd.rank(), "params": params,
              "state_mib": setup.state_bytes() / 2**20, "built_mib": built,
              "peak_mib": _peak_mib(), "step_s": statistics.median(times)}
    rows = hvd.allgather_object(report)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    hvd.shutdown()


def _worker_time(args: argparse.Namespace) -> None:
    import torch

    import hora.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    setups = {v: _Setup(v, args.layers, args.time_width, hvd) for v in TIMED}
    for s in setups.values():
        for _ in range(args.warmup):
            s.step()
    per_round: dict[str, list[float]] = {v: [] for v in TIMED}
    for r in range(args.rounds):
        order = TIMED[r % 3:] + TIMED[:r % 3]
        for v in order:
            hvd.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                setups[v].step()
            elapsed = (time.perf_counter() - start) / args.steps
            slowest = max(hvd.allgather_object(elapsed))
            per_round[v].append(slowest)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({"width": args.time_width, "layers": args.layers,
                                      "per_round": per_round}), flush=True)
    hvd.shutdown()


def _job(args: argparse.Namespace, extra: list[str]) -> Any:
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(args.np), sys.executable,
           os.path.abspath(__file__), "--layers", str(args.layers), "--width", str(args.width),
           "--time-width", str(args.time_width), "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--rounds", str(args.rounds),
           *(["--dominant"] if args.dominant else []), *extra]
    print("$ " + shlex.join(cmd[2:]), file=sys.stderr, flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"job failed ({out.returncode}):\n{out.stdout[-3000:]}\n"
                       f"{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--time-width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"of {', '.join(VARIANTS)} (whole: ShardedOptimizer with "
                        "split_parameters=False)")
    parser.add_argument("--dominant", action="store_true",
                        help="memory jobs on one Linear(width, 4 width) (80%% of the "
                        "parameters) + Linear(width, width) instead of --layers")
    parser.add_argument("--skip-time", action="store_true", help="the memory jobs only")
    parser.add_argument("--only-time", action="store_true", help="the step-time job only")
    parser.add_argument("--worker", choices=("memory", "time"))
    parser.add_argument("--variant", choices=VARIANTS)
    args = parser.parse_args()
    if args.worker == "memory":
        _worker_memory(args)
        return
    if args.worker == "time":
        _worker_time(args)
        return
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load average "
          f"{' '.join(load)}, {os.cpu_count()} cores, {args.np} ranks")
    if not args.only_time:
        _memory_table(args)
    if not args.skip_time:
        _time_table(args)


def _memory_table(args: argparse.Namespace) -> None:
    memory = {v: _job(args, ["--worker", "memory", "--variant", v])
              for v in args.variants.split(",")}
    first = next(iter(memory.values()))[0]
    model = (f"Linear({args.width}, {4 * args.width}) + Linear({args.width}, {args.width})"
             if args.dominant else f"{args.layers} x Linear({args.width}, {args.width})")
    print(f"\nMemory: {model}, "
          f"{first['params'] / 1e6:.1f} M parameters, Adam state "
          f"{2 * first['params'] * 4 / 2**30:.2f} GiB unsharded; one job per variant")
    print("| variant | state MiB per rank | RSS built MiB | peak RSS MiB | peak - built MiB "
          "| step s |")
    print("|---|---|---|---|---|---|")
    for v, rows in memory.items():
        state = "/".join(f"{r['state_mib']:.0f}" for r in rows)
        built = max(r["built_mib"] for r in rows)
        peak = max(r["peak_mib"] for r in rows)
        grow = max(r["peak_mib"] - r["built_mib"] for r in rows)
        step = max(r["step_s"] for r in rows)
        print(f"| {v} | {state} | {built:.0f} | {peak:.0f} | {grow:.0f} | {step:.2f} |")


def _time_table(args: argparse.Namespace) -> None:
    timing = _job(args, ["--worker", "time"])
    med = {v: statistics.median(t) for v, t in timing["per_round"].items()}
    params = args.layers * (args.time_width ** 2 + args.time_width)
    print(f"\nStep time: {args.layers} x Linear({args.time_width}, {args.time_width}) "
          f"({params / 1e6:.1f} M parameters), {args.rounds} interleaved rounds of "
          f"{args.steps} steps, median per step (slower rank)")
    print("| variant | median s/step | rounds |")
    print("|---|---|---|")
    for v, t in timing["per_round"].items():
        print(f"| {v} | {med[v]:.3f} | {' '.join(f'{x:.3f}' for x in t)} |")
    ratios = [s / d for s, d in zip(timing["per_round"]["sharded"],
                                    timing["per_round"]["distributed"])]
    print(f"\nsharded/distributed: {med['sharded'] / med['distributed']:.3f} (ratio of "
          f"medians), per-round median {statistics.median(ratios):.3f}; "
          f"zero/distributed: {med['zero'] / med['distributed']:.3f}")
    with open("/proc/loadavg") as f:
        print(f"load average at the end: {' '.join(f.read().split()[:3])}")


if __name__ == "__main__":
    main()
