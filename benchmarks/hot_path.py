"""How much Python one steady-state allreduce runs: hora modules and Python calls per op.

    python benchmarks/hot_path.py                 # hora.torch, 4 KiB float32, 2 ranks
    python benchmarks/hot_path.py --kib 1024 --ops 200
    python benchmarks/hot_path.py --api numpy     # hora.allreduce on numpy arrays

Started once, the script relaunches itself under ``hora run -np N``. Each rank installs a
profile function on every thread *before* ``init()`` (``threading.setprofile`` reaches the
threads the engine starts later; the main thread gets ``sys.setprofile``), warms the op up
(the name is negotiated once, then repeats on the fast lane where one exists), then counts,
over ``--ops`` named allreduces of one tensor, every Python function call on every thread of
the rank (``'call'`` events: Python frames, not C functions), and which ``hora`` modules ran.
Rank 0 prints per op: the calls in all, the calls in hora's own code, the hora modules, and the
ten hora functions called most. Counting is exact and repeatable (no clock is involved), so
unlike a timing it can be compared across runs and machines.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


class Counter:
    """A profile function that counts Python calls while ``active`` (thread-safe enough for
    counting: a lost increment under a race would show as a non-integer per-op figure)."""

    def __init__(self) -> None:
        self.active = False
        self.calls = 0
        self.hora_calls = 0
        self.functions: collections.Counter[str] = collections.Counter()
        self.modules: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.active:
            return
        module = frame.f_globals.get("__name__", "?")
        with self.lock:
            self.calls += 1
            if module == "hora" or module.startswith("hora."):
                self.hora_calls += 1
                self.modules.add(module)
            self.functions[f"{module}.{frame.f_code.co_name}"] += 1


def _rank(args: argparse.Namespace) -> None:
    import numpy as np

    counter = Counter()
    threading.setprofile(counter)
    sys.setprofile(counter)
    if args.api == "torch":
        import torch

        import hora.torch as hvd

        hvd.init()
        x = torch.ones(args.kib * 256, dtype=torch.float32)

        def op() -> None:
            hvd.allreduce(x, name="hot_path", op=hvd.Sum)
    else:
        import hora as hvd

        hvd.init()
        a = np.ones(args.kib * 256, dtype=np.float32)

        def op() -> None:
            hvd.allreduce(a, name="hot_path", op=hvd.Sum)

    for _ in range(args.warmup):
        op()
    hvd.barrier()
    counter.active = True
    for _ in range(args.ops):
        op()
    counter.active = False
    hvd.barrier()
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    if hvd.rank() == 0:
        n = args.ops
        print(f"{args.api} allreduce of {args.kib} KiB float32, {hvd.size()} ranks, rank 0, "
              f"every thread, mean of {n} ops after {args.warmup} warm-up ops:")
        print(f"  Python calls per op:        {counter.calls / n:8.1f}")
        print(f"  of them in hora's code:     {counter.hora_calls / n:8.1f}")
        print(f"  hora modules that ran:      {len(counter.modules):8d}")
        for module in sorted(counter.modules):
            print(f"    {module}")
        print("  functions called most (calls per op):")
        for name, count in counter.functions.most_common(None if args.all else 10):
            print(f"    {count / n:6.1f}  {name}")
    hvd.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--kib", type=int, default=4, help="tensor size in KiB (float32)")
    parser.add_argument("--ops", type=int, default=100, help="ops counted")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--api", choices=("torch", "numpy"), default="torch")
    parser.add_argument("--all", action="store_true", help="list every hora function called")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        _rank(args)
        return
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(args.np), sys.executable,
           __file__, "--rank", "--kib", str(args.kib), "--ops", str(args.ops), "--warmup",
           str(args.warmup), "--api", args.api] + (["--all"] if args.all else [])
    sys.exit(subprocess.call(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}))


if __name__ == "__main__":
    main()
