"""Grouped and sparse allreduce: hora (fast lane on / off, optionally an older checkout) vs gloo.

    python benchmarks/grouped_sparse.py                    # 2 ranks, lane vs no lane, 3 jobs each
    python benchmarks/grouped_sparse.py --jobs 4 --reps 300
    python benchmarks/grouped_sparse.py --before /tmp/wt-old   # also an older checkout of hora
    hora run -np 2 python benchmarks/grouped_sparse.py --worker   # one job, what is launched

Each job (``hora run -np N``, one torch thread per rank) measures, interleaved in rounds
(A B A B ...) within the job:

* ``grouped``: ``hvd.grouped_allreduce`` of ``--tensors`` float32 tensors of ``--kib`` KiB each
  (Sum); ``neg``: the same under a new name each call, so never cached: always negotiated
  with rank 0 (the path the fast lane replaces, measured in the same job); ``async``: the
  same as ``grouped`` through ``grouped_allreduce_async`` + ``synchronize`` (how
  ``DistributedOptimizer(groups=...)`` runs them); against gloo doing the same work two ways:
  one ``all_reduce`` per tensor (``gloo x10``), and DDP's way, flatten into one buffer, one
  ``all_reduce``, unflatten (``gloo flat``);
* ``sparse``: ``hvd.sparse_allreduce_async(g, op=Sum)()`` of an embedding gradient (``--nnz``
  rows of a ``--rows`` x ``--dim`` float32 table; ``sparse neg``: a new name each call),
  against gloo's sparse ``all_reduce`` of the same COO tensor (it, too, gathers indices and
  values).

Reported per job: the median time per call (each rank's median, the slowest rank's), and for
hora how many collectives one grouped call took in the fast lane. Jobs of the variants
alternate (``lane`` = the defaults; ``nolane`` = ``HOROVOD_CACHE_CAPACITY=0``, every op
negotiated with rank 0; ``before`` = ``--before``'s checkout, on ``PYTHONPATH``), and the
summary gives each variant's median over its jobs and the ratios. This machine's speed swings
within minutes: compare ratios from one run, and re-run when the load (printed) is high.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OPS = ("grouped", "neg", "async", "gloo x10", "gloo flat", "sparse", "sparse neg", "gloo sparse")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    import hora.torch as hvd
    from hora.core.engine import context

    torch.set_num_threads(1)
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    port = hvd.broadcast_object(_free_port() if rank == 0 else None, 0, name="port")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)
    count = args.kib * 1024 // 4
    tensors = [torch.zeros(count) for _ in range(args.tensors)]  # zeros: sums never overflow
    gen = torch.Generator().manual_seed(rank)
    rows = torch.randperm(args.rows, generator=gen)[:args.nnz].sort().values
    sparse = torch.sparse_coo_tensor(rows.unsqueeze(0), torch.ones(args.nnz, args.dim),
                                     (args.rows, args.dim)).coalesce()

    def grouped() -> None:
        hvd.grouped_allreduce(tensors, name="bench.grouped", op=hvd.Sum)

    fresh = iter(range(10 ** 9))

    def grouped_negotiated() -> None:  # a new name each call: never cached, always negotiated
        hvd.grouped_allreduce(tensors, name=f"bench.neg.{next(fresh)}", op=hvd.Sum)

    def grouped_async() -> None:  # what DistributedOptimizer's groups do: start, wait later
        hvd.synchronize(hvd.grouped_allreduce_async(tensors, name="bench.async", op=hvd.Sum))

    def gloo_each() -> None:
        for t in tensors:
            dist.all_reduce(t)

    def gloo_flat() -> None:
        flat = _flatten_dense_tensors(tensors)
        dist.all_reduce(flat)
        for t, out in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            t.copy_(out)

    def hora_sparse() -> None:
        hvd.sparse_allreduce_async(sparse, name="bench.sparse", op=hvd.Sum)()

    def sparse_negotiated() -> None:
        hvd.sparse_allreduce_async(sparse, name=f"bench.neg.{next(fresh)}", op=hvd.Sum)()

    def gloo_sparse() -> None:
        dist.all_reduce(sparse.clone())

    fns = {"grouped": grouped, "neg": grouped_negotiated, "async": grouped_async,
           "gloo x10": gloo_each, "gloo flat": gloo_flat, "sparse": hora_sparse,
           "sparse neg": sparse_negotiated, "gloo sparse": gloo_sparse}
    times: dict[str, list[float]] = {op: [] for op in OPS}
    for fn in fns.values():  # warm up (the first hora call of a name is negotiated)
        for _ in range(3):
            fn()
    lane = context.get().engine.lane(0)
    path = {op: [0, 0, 0] for op in ("grouped", "async", "sparse")}  # calls, ops, collectives
    for _ in range(args.rounds):
        for op, fn in fns.items():
            dist.barrier()
            reps = max(1, args.reps // args.rounds)
            before = lane.describe() if lane is not None else None
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times[op].append(time.perf_counter() - t0)
            if op in path and lane is not None and before is not None:
                after = lane.describe()
                path[op][0] += reps
                path[op][1] += after["fast_ops"] - before["fast_ops"]
                path[op][2] += after["batches"] - before["batches"]
    med = {op: max(hvd.allgather_object(statistics.median(t), name=f"m.{op}"))
           for op, t in times.items()}
    if rank == 0:
        lanes = "; ".join(f"{op}: {c and ops / c:.1f} ops in {c and b / c:.1f} collectives "
                          "per call in the lane" for op, (c, ops, b) in path.items())
        print("RESULT " + " ".join(f"{op.replace(' ', '_')}={med[op] * 1e6:.1f}" for op in OPS)
              + f" | {lanes if lane is not None else 'no lane'}", flush=True)
    dist.destroy_process_group()
    hvd.shutdown()


def _job(args: argparse.Namespace, variant: str) -> dict[str, float]:
    env = dict(os.environ)
    if variant == "nolane":
        env["HOROVOD_CACHE_CAPACITY"] = "0"
    if variant == "before":
        env["PYTHONPATH"] = os.pathsep.join([str(args.before), env.get("PYTHONPATH", "")])
    else:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(args.np), sys.executable,
           __file__, "--worker", "--tensors", str(args.tensors), "--kib", str(args.kib),
           "--nnz", str(args.nnz), "--rows", str(args.rows), "--dim", str(args.dim),
           "--reps", str(args.reps), "--rounds", str(args.rounds)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                         cwd=str(args.before if variant == "before" else ROOT))
    line = next((ln for ln in out.stdout.splitlines() if "RESULT " in ln), None)
    if out.returncode or line is None:
        sys.exit(f"{variant} job failed ({out.returncode}):\n{out.stdout[-3000:]}\n"
                 f"{out.stderr[-3000:]}")
    payload = line.split("RESULT ", 1)[1]
    print(f"  {variant:>7}: {payload}", flush=True)
    return {k.replace("_", " "): float(v) for k, v in re.findall(r"(\S+)=([\d.]+)", payload)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=3, help="jobs per variant (alternating)")
    parser.add_argument("--tensors", type=int, default=10)
    parser.add_argument("--kib", type=int, default=1, help="KiB per grouped tensor")
    parser.add_argument("--nnz", type=int, default=32, help="sparse gradient: non-zero rows")
    parser.add_argument("--rows", type=int, default=1000, help="sparse gradient: table rows")
    parser.add_argument("--dim", type=int, default=16, help="sparse gradient: row width")
    parser.add_argument("--reps", type=int, default=400, help="calls per op per job")
    parser.add_argument("--rounds", type=int, default=8, help="ABAB rounds per job")
    parser.add_argument("--before", type=Path, help="an older checkout of hora to compare")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    variants = ["lane", "nolane"] + (["before"] if args.before else [])
    load = os.getloadavg()[0]
    print(f"{args.np} ranks; grouped: {args.tensors} x {args.kib} KiB float32 (Sum); sparse: "
          f"{args.nnz} of {args.rows} rows x {args.dim} float32; {args.reps} calls per op per "
          f"job in {args.rounds} rounds; load {load:.2f}", flush=True)
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for j in range(args.jobs):
        order = variants[j % len(variants):] + variants[:j % len(variants)]
        for variant in order:
            results[variant].append(_job(args, variant))
    summary: dict[str, dict[str, float]] = {
        v: {op: statistics.median(r[op] for r in runs) for op in OPS}
        for v, runs in results.items()}
    print(f"\nmedian over jobs, us per call (load now {os.getloadavg()[0]:.2f}):")
    print(f"{'variant':>8} | " + " | ".join(f"{op:>11}" for op in OPS))
    for v, row in summary.items():
        print(f"{v:>8} | " + " | ".join(f"{row[op]:11.1f}" for op in OPS))
    lane: Any = summary["lane"]
    print("cached vs negotiated in each job (same job, interleaved; x = times faster):")
    for v, runs in results.items():
        if v != "nolane":
            print(f"{v:>8}: grouped " + ", ".join(f"{r['neg'] / r['grouped']:.2f}x" for r in runs)
                  + "; sparse " + ", ".join(f"{r['sparse neg'] / r['sparse']:.2f}x" for r in runs)
                  + "; hora grouped vs gloo flat "
                  + ", ".join(f"{r['gloo flat'] / r['grouped']:.2f}x" for r in runs))
    for v in variants[1:]:
        print(f"lane vs {v}: grouped {summary[v]['grouped'] / lane['grouped']:.2f}x faster, "
              f"async {summary[v]['async'] / lane['async']:.2f}x, "
              f"sparse {summary[v]['sparse'] / lane['sparse']:.2f}x")
    print(f"lane vs gloo: grouped {lane['gloo x10'] / lane['grouped']:.2f}x faster than gloo x10, "
          f"{lane['gloo flat'] / lane['grouped']:.2f}x than gloo flat; sparse "
          f"{lane['gloo sparse'] / lane['sparse']:.2f}x")


if __name__ == "__main__":
    main()
