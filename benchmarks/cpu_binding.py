"""CPU binding: the same 2-rank torch training job with ``--cpu-binding auto`` (each rank on its
own share of the cores, hora's default) and ``none`` (every rank on every core, as horovodrun),
frameworks left at their default thread counts.

    python benchmarks/cpu_binding.py                     # 2 ranks, 3 jobs per setting
    python benchmarks/cpu_binding.py --jobs 1 --steps 3 --hidden 64   # smoke test
    hora run -np 2 --cpu-binding none python benchmarks/cpu_binding.py --worker   # one job

Each job trains an MLP 784-H-H-10 (H 2048) with ``hora.torch.DistributedOptimizer`` on a fixed
batch per rank and prints rank 0's median step time and its torch thread count (torch sizes its
pool to the cores the process may use). Jobs of the two settings alternate; the script prints
each setting's median over its jobs and their ratio.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

_LINE = re.compile(r"STEP threads=(\d+) ms=([0-9.]+)")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    gen = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(args.batch, 784, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    if hvd.rank() == 0:
        print(f"STEP threads={torch.get_num_threads()} "
              f"ms={1e3 * statistics.median(times):.2f}", flush=True)
    hvd.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=256, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=3, help="jobs per setting")
    parser.add_argument("--worker", action="store_true", help="run as one rank")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    own = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--worker"]
    results: dict[str, list[tuple[int, float]]] = {"auto": [], "none": []}
    print(f"{args.np} ranks on {len(os.sched_getaffinity(0))} cores, MLP 784-{args.hidden}-"
          f"{args.hidden}-10, batch {args.batch}/rank, default torch threads; load "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    for job in range(args.jobs):
        for setting in ("auto", "none") if job % 2 == 0 else ("none", "auto"):
            cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(args.np),
                   "--cpu-binding", setting, sys.executable, os.path.abspath(__file__),
                   "--worker", *own]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
            found = _LINE.search(out.stdout)
            if out.returncode != 0 or found is None:
                sys.exit(f"the {setting} job failed ({out.returncode}):\n{out.stderr[-2000:]}")
            results[setting].append((int(found.group(1)), float(found.group(2))))
            print(f"  job {job + 1}, --cpu-binding {setting}: {found.group(2)} ms/step "
                  f"({found.group(1)} torch threads per rank)", flush=True)
    med = {s: statistics.median(ms for _, ms in r) for s, r in results.items()}
    for s in ("auto", "none"):
        print(f"  {s:>4}: median {med[s]:8.2f} ms/step over {args.jobs} jobs "
              f"({results[s][0][0]} torch threads per rank)")
    print(f"  none / auto time: {med['none'] / med['auto']:.2f}x")


if __name__ == "__main__":
    main()
