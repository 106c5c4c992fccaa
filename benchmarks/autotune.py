"""Autotune against hand-picked settings, on benchmarks/train_step.py's training step, one job.

    python benchmarks/autotune.py                      # 2 ranks, Horovod's autotune defaults
    python benchmarks/autotune.py --rounds 9 --steps 10
    python benchmarks/autotune.py --hidden 256 --warmup-samples 1 --steps-per-sample 2 \\
        --max-samples 6 --rounds 2 --steps 3            # smoke test

The same 2 processes (``hora run -np 2 --autotune``, one torch thread each) train
train_step.py's MLP (784-2048-2048-10 by default) with ``hora.torch.DistributedOptimizer`` on a
fixed synthetic batch:

1. **tuning**: steps run until rank 0's autotuner has settled (the ranks check every 10 steps
   whether any still tunes); the steps and the time this took are reported, with the log file;
2. **comparison**: the tuned setting and a few hand-picked (fusion threshold, cycle time)
   settings are measured in rounds; in each round every hand-picked setting runs ``--steps``
   steps with a block of the tuned setting before and after it (T A T B T C ..., the order of
   the hand-picked ones rotated per round). A setting is imposed on every rank between blocks
   through the path autotune itself uses (``Tuning.request`` on rank 0, which sends it to the
   others; then a barrier), so only the tunables differ between settings.

Samples/s count both ranks (``size * batch * steps`` over the slower rank's time); medians over
blocks, with the min and max. ``tuned/it`` is a hand-picked block's time over the mean of the
two tuned blocks beside it (a few seconds apart, so a machine whose speed drifts moves both),
median over rounds: above 1, the tuned setting is faster. When the tuned setting is one of the
hand-picked ones, their ratio shows the run's noise between identical settings.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_step  # noqa: E402  (the workload: its MLP)

MiB = 1024 * 1024
HAND_PICKED: tuple[tuple[float, float], ...] = (
    (128.0, 0.0),  # hora's defaults
    (64.0, 0.0),  # the same as 128 MB for this model (22 MiB of gradients): shows the noise
    (32.0, 1.0),  # Horovod-like: 32 MB buffers, a 1 ms cycle
    (4.0, 0.0),
    (0.0, 0.0),  # no fusion
    (16.0, 5.0),
)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    import hora.torch as hvd
    from hora.core.autotune.autotune_search import Params
    from hora.core.engine import context

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    tuning = context.get().engine.tuning
    torch.manual_seed(0)
    model = train_step._mlp(args.hidden, args.depth)
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.batch_size, 784, generator=gen)
    y = torch.randint(0, 10, (args.batch_size,), generator=gen)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    # 1. tuning
    t0, steps = time.perf_counter(), 0
    while True:
        for _ in range(10):
            step()
        steps += 10
        still = hvd.allreduce(torch.tensor([float(tuning.active)]), name="still_tuning",
                              op=hvd.Max)
        if still.item() == 0 or steps >= args.max_tuning_steps:
            break
    tuning_s = time.perf_counter() - t0
    tuned = tuning.current
    settings: dict[str, Any] = {"tuned": tuned}
    for mb, ms in HAND_PICKED:
        settings[f"{mb:g} MB, {ms:g} ms"] = Params(int(mb * MiB), ms, tuned.hierarchical_allreduce,
                                                   tuned.hierarchical_allgather, active=False)

    # 2. comparison, interleaved: the tuned setting between every two hand-picked ones
    hand = [n for n in settings if n != "tuned"]
    blocks: list[list[tuple[str, float]]] = []  # per round: (setting, seconds) in run order
    for r in range(args.rounds):
        order = hand[r % len(hand):] + hand[:r % len(hand)]
        sequence = ["tuned"] + [x for n in order for x in (n, "tuned")]
        run: list[tuple[str, float]] = []
        for name in sequence:
            if rank == 0 and not tuning.active:
                tuning.request(settings[name])
            hvd.barrier()  # every rank runs with it (the request was sent before the barrier)
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            run.append((name, time.perf_counter() - start))
        blocks.append(run)
    all_blocks = hvd.allgather_object(blocks, name="blocks")
    applied = hvd.allgather_object([p.to_wire() for p in tuning.applied], name="applied")
    with torch.no_grad():
        digest = float(sum(p.double().sum() for p in model.parameters()))
    sums = hvd.allgather_object(digest, name="digest")
    if rank == 0:
        _report(args, size, n_params, steps, tuning_s, tuned, all_blocks, applied, sums,
                still_tuning=tuning.active)
    hvd.shutdown()


def _report(args: argparse.Namespace, size: int, n_params: int, steps: int, tuning_s: float,
            tuned: Any, all_blocks: list[list[list[tuple[str, float]]]], applied: list[Any],
            sums: list[float], *, still_tuning: bool) -> None:
    samples = size * args.batch_size * args.steps
    # each block's time: the slower rank's
    rounds = [[(name, max(rank_blocks[r][b][1] for rank_blocks in all_blocks))
               for b, (name, _) in enumerate(all_blocks[0][r])] for r in range(args.rounds)]
    rate: dict[str, list[float]] = {}
    paired: dict[str, list[float]] = {}  # tuned/h: h's time over the tuned blocks beside it
    for run in rounds:
        for b, (name, seconds) in enumerate(run):
            rate.setdefault(name, []).append(samples / seconds)
            if name != "tuned":
                beside = (run[b - 1][1] + run[b + 1][1]) / 2
                paired.setdefault(name, []).append(seconds / beside)
    med = {n: statistics.median(v) for n, v in rate.items()}
    hand = [n for n in rate if n != "tuned"]
    best = max(hand, key=lambda n: med[n])
    ratio = {n: statistics.median(paired[n]) for n in hand}
    strongest = min(hand, key=lambda n: ratio[n])
    twin = [n for n in hand if settings_equal(n, tuned)]
    dims = "-".join(["784", *[str(args.hidden)] * args.depth, "10"])
    print(f"\nautotune vs hand-picked settings, {size} ranks x 1 thread, MLP {dims} "
          f"({n_params / 1e6:.2f} M params, {n_params * 4 / MiB:.1f} MiB of float32 gradients), "
          f"batch {args.batch_size} per rank, SGD")
    print(f"command: {_command(args)}")
    print(f"load average before the report: {os.getloadavg()[0]:.2f}")
    rate_tuning = size * args.batch_size * steps / tuning_s
    print(f"\ntuning: {steps} steps in {tuning_s:.1f} s ({rate_tuning:.0f} samples/s while "
          f"tuning){'; STILL TUNING at the step limit' if still_tuning else ''}")
    print(f"tuned setting: {tuned.describe()}; log file: {args.log_file}")
    print(f"\ncomparison: {args.rounds} rounds; in each, {args.steps} steps of the tuned setting "
          f"before and after each hand-picked one (rotated order)")
    print(f"{'setting':>24} | {'samples/s':>9} {'min':>7} {'max':>7} | {'ms/step':>7} | "
          f"{'tuned/it, adjacent blocks: median [min, max]':>44}")
    for n in ["tuned", *hand]:
        label = f"tuned ({tuned.fusion_threshold / MiB:.1f} MB, {tuned.cycle_time:.2f} ms)" \
            if n == "tuned" else n
        pair = "" if n == "tuned" else (f"{ratio[n]:.3f} [{min(paired[n]):.3f}, "
                                         f"{max(paired[n]):.3f}]")
        print(f"{label:>24} | {med[n]:9.1f} {min(rate[n]):7.1f} {max(rate[n]):7.1f} | "
              f"{samples / med[n] / args.steps * 1e3:7.1f} | "
              f"{pair:>44}")
    print(f"\ntuned against the strongest hand-picked setting ({strongest}), adjacent blocks: "
          f"{ratio[strongest]:.3f}; against the best median ({best}): {ratio[best]:.3f} "
          f"(ratio of medians {med['tuned'] / med[best]:.3f})")
    if twin:
        print(f"the tuned setting is the hand-picked '{twin[0]}': tuned/it = {ratio[twin[0]]:.3f} "
              "is this run's noise between identical settings")
    print("every rank applied the same settings: "
          + ("yes" if all(a == applied[0] for a in applied) else "NO"))
    print("replicas identical across ranks: " + ("yes" if len(set(sums)) == 1 else "NO"))


def settings_equal(name: str, tuned: Any) -> bool:
    """Whether hand-picked setting ``name`` ("16 MB, 5 ms") is the tuned one."""
    mb, ms = (float(part.split()[0]) for part in name.split(","))
    return (round(mb * MiB), ms) == (tuned.fusion_threshold, tuned.cycle_time)


def _command(args: argparse.Namespace) -> str:
    return shlex.join(["python", "benchmarks/autotune.py", *_worker_args(args)[1:]])


def _autotune_flags(args: argparse.Namespace) -> list[str]:
    return ["--autotune", "--autotune-log-file", args.log_file,
            "--autotune-warmup-samples", str(args.warmup_samples),
            "--autotune-steps-per-sample", str(args.steps_per_sample),
            "--autotune-bayes-opt-max-samples", str(args.max_samples)]


def _worker_args(args: argparse.Namespace) -> list[str]:
    return ["--worker", "--steps", str(args.steps), "--rounds", str(args.rounds),
            "--batch-size", str(args.batch_size), "--hidden", str(args.hidden),
            "--depth", str(args.depth), "--lr", str(args.lr), "--np", str(args.np),
            "--warmup-samples", str(args.warmup_samples),
            "--steps-per-sample", str(args.steps_per_sample),
            "--max-samples", str(args.max_samples), "--log-file", args.log_file,
            "--max-tuning-steps", str(args.max_tuning_steps)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--np", type=int, default=2, help="ranks")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per setting and round")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step, per rank")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden layer width")
    parser.add_argument("--depth", type=int, default=2, help="hidden layers")
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    parser.add_argument("--warmup-samples", type=int, default=3, help="autotune warm-up samples")
    parser.add_argument("--steps-per-sample", type=int, default=10, help="autotune steps/sample")
    parser.add_argument("--max-samples", type=int, default=20,
                        help="autotune Bayesian optimisation samples")
    parser.add_argument("--max-tuning-steps", type=int, default=5000,
                        help="stop tuning after this many steps")
    parser.add_argument("--log-file", default="/tmp/hora_autotune_bench.csv",
                        help="the autotune log (CSV)")
    parser.add_argument("--worker", action="store_true", help="run as one rank (under hora run)")
    args = parser.parse_args(argv)
    for name in ("np", "steps", "rounds", "batch_size", "hidden", "steps_per_sample",
                 "max_samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.worker:
        worker(args)
        return
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(args.np),
           *_autotune_flags(args), sys.executable, os.path.abspath(__file__),
           *_worker_args(args)]
    print("launching: " + shlex.join(["hora", "run", "-np", str(args.np), *_autotune_flags(args),
                                      "python", "benchmarks/autotune.py", *_worker_args(args)]),
          flush=True)
    sys.exit(subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}))


if __name__ == "__main__":
    main()
