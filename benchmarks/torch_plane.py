"""hora.torch on the torch data plane: tensors handed over as they are vs staged as host arrays.

    python benchmarks/torch_plane.py                 # 2 ranks, CPU tensors (gloo)
    python benchmarks/torch_plane.py --device cuda   # CUDA tensors: NCCL vs staged (needs GPUs)
    python benchmarks/torch_plane.py --rounds 7 --iters 30

On the torch plane hora.torch hands the core its tensors themselves (device buffers,
docs/data-planes.md#the-torch-plane); before, it handed host arrays (a view of a CPU tensor, a
copy of a CUDA one), and a CUDA tensor is still staged that way on the builtin plane. Both forms
run in one job, interleaved per round (the order alternates), switched on every rank at the same
point with ``hora.core.op.device.configure``: only ratios from one job mean anything on a shared
machine. Reported per case: median time per op (``hvd.allreduce`` through the whole engine), and
device/host. On the CPU the two forms move the same bytes through gloo, so the ratio shows what
the device path's bookkeeping costs or saves; on a GPU the host form adds the two copies.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CASES = [("4 KiB", 1 << 10, 1), ("256 KiB", 1 << 16, 1), ("4 MiB", 1 << 20, 1),
         ("16 MiB", 1 << 22, 1), ("20 x 16 KiB grouped", 1 << 12, 20)]
"""(label, float32 elements per tensor, tensors per call: >1 is one grouped_allreduce)."""


def worker(args: argparse.Namespace) -> None:
    import torch

    import hora.torch as hvd
    from hora.core.op import device

    torch.set_num_threads(1)
    hvd.init()
    if args.device == "cuda":
        torch.cuda.set_device(hvd.local_rank())
    tensors = {label: [torch.ones(n, device=args.device) for _ in range(k)]
               for label, n, k in CASES}
    times: dict[tuple[str, str], list[float]] = {}

    def run(label: str) -> None:
        ts = tensors[label]
        if len(ts) == 1:
            hvd.allreduce(ts[0], name=label)
        else:
            hvd.grouped_allreduce(ts, name=label)

    for rnd in range(args.rounds):
        forms = ["device", "host"] if rnd % 2 == 0 else ["host", "device"]
        for form in forms:
            device.configure(("torch",) if form == "device" else ())
            for label, _, _ in CASES:
                for _ in range(2):
                    run(label)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                hvd.barrier()
                start = time.perf_counter()
                for _ in range(args.iters):
                    run(label)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                times.setdefault((label, form), []).append(
                    (time.perf_counter() - start) / args.iters)
    device.configure(("torch",))
    if hvd.rank() == 0:
        print(f"hora.torch on the torch data plane, {hvd.size()} ranks, {args.device} tensors, "
              f"{args.rounds} rounds x {args.iters} ops, load {os.getloadavg()[0]:.1f}")
        print(f"{'case':<22}{'device (ms)':>13}{'host (ms)':>12}{'device/host':>13}")
        for label, _, _ in CASES:
            dev = statistics.median(times[(label, "device")]) * 1e3
            host = statistics.median(times[(label, "host")]) * 1e3
            print(f"{label:<22}{dev:>13.3f}{host:>12.3f}{dev / host:>13.2f}")
    hvd.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(args.np), "--data-plane",
           "torch", sys.executable, __file__, "--worker", "--rounds", str(args.rounds),
           "--iters", str(args.iters), "--device", args.device]
    env: dict[str, Any] = {**os.environ, "OMP_NUM_THREADS": "1"}
    sys.exit(subprocess.call(cmd, cwd=ROOT, env=env))


if __name__ == "__main__":
    main()
