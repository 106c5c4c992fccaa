"""Same-host allreduce: shared memory (ShmGroup) vs hora's TCP ring vs torch.distributed gloo.

    python benchmarks/shm_allreduce.py                 # 2 ranks: 4 KiB latency + 1..256 MiB
    python benchmarks/shm_allreduce.py --np 4 --sizes-mib 1 16
    hora run -np 2 python benchmarks/shm_allreduce.py --worker

All libraries run in the same processes, interleaved per size (A B C A B C ...), because this
machine's speed swings 2-6x within minutes: only ratios from one job mean anything. Reported per
size: the median time per allreduce (each rank's median, slowest rank), bus bandwidth
= 2 (n-1)/n * bytes / time, and ratios. Columns:

* ``shm``: :meth:`hora.collectives.shm.ShmGroup.allreduce` on a private numpy buffer (the
  algorithm :func:`~hora.collectives.select.select_shm_allreduce` picks);
* ``staged``: the same on the group's :meth:`~hora.collectives.shm.ShmGroup.staging` view (a
  fusion buffer packed straight into shared memory; packing is not timed, as the executor packs
  its fusion buffer either way);
* ``ring``: :func:`hora.collectives.ring.ring_allreduce` over hora's TCP transport;
* ``gloo``: ``torch.distributed.all_reduce`` with the gloo backend;
* ``memcpy``: every rank copies the buffer once (``np.copyto``), all at the same time: not an
  allreduce, the memory bandwidth the others compete for at that moment (the machine is shared;
  its "GB/s" column is bytes / time).

The collectives are called directly (no engine negotiation) so that only the data path is
compared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

LIBS = ("shm", "staged", "ring", "gloo", "memcpy")


def _busbw(nbytes: int, n: int, seconds: float) -> float:
    return 2 * (n - 1) / n * nbytes / seconds / 1e9


def _rate(lib: str, nbytes: int, n: int, seconds: float) -> float:
    """Bus bandwidth of an allreduce; plain bytes / time for the memcpy reference."""
    return nbytes / seconds / 1e9 if lib == "memcpy" else _busbw(nbytes, n, seconds)


def _fmt_size(nbytes: int) -> str:
    return f"{nbytes // 1024} KiB" if nbytes < 1024 * 1024 else f"{nbytes // (1024 * 1024)} MiB"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _operations(group: Any, comm: Any, nbytes: int, dist: Any) -> dict[str, Callable[[], None]]:
    """One allreduce of ``nbytes`` float32 per library, as no-argument callables."""
    import torch

    import hora
    from hora.collectives.ring import ring_allreduce

    x = np.zeros(nbytes // 4, np.float32)  # zeros: repeated in-place sums never overflow
    scratch = np.empty(nbytes, np.uint8)
    xt = torch.zeros(nbytes // 4, dtype=torch.float32)
    dst = np.zeros_like(x)

    def staged() -> None:
        view = group.staging(nbytes).view(np.float32)
        group.allreduce(view, hora.Sum)

    return {
        "shm": lambda: group.allreduce(x, hora.Sum),
        "staged": staged,
        "ring": lambda: ring_allreduce(comm, x, hora.Sum, scratch),
        "gloo": lambda: dist.all_reduce(xt),
        "memcpy": lambda: np.copyto(dst, x),
    }


def worker(sizes: list[int], rounds: int, libs: list[str], budget_s: float) -> None:
    import torch
    import torch.distributed as dist

    import hora
    from hora.collectives.select import select_shm_allreduce
    from hora.collectives.shm import ShmGroup
    from hora.core.engine import context
    from hora.transports.shm import job_id_from_env
    from hora.transports.shm_fabric import ShmFabric

    torch.set_num_threads(1)
    hora.init()
    rank, n = hora.rank(), hora.size()
    comm = context.get().engine.transport.comm()
    group = ShmGroup(ShmFabric.create(comm, job_id_from_env(), timeout=60.0))
    if "gloo" in libs:
        port = hora.broadcast_object(_free_port() if rank == 0 else None, 0, name="port")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n)
    rows = []
    try:
        for nbytes in sizes:
            ops = _operations(group, comm, nbytes, dist)
            # warm up (grows segments, faults pages in) and size the repetitions to the budget
            t0 = time.perf_counter()
            for lib in libs:
                group.barrier()
                ops[lib]()
            per_round = max(1e-6, time.perf_counter() - t0)
            reps = max(1, min(200, int(budget_s / rounds / per_round)))
            reps = hora.broadcast_object(reps, 0, name=f"reps{nbytes}")
            times: dict[str, list[float]] = {lib: [] for lib in libs}
            for _ in range(rounds):
                for lib in libs:
                    group.barrier()
                    for _ in range(reps):
                        t = time.perf_counter()
                        ops[lib]()
                        times[lib].append(time.perf_counter() - t)
            med = {lib: max(hora.allgather_object(statistics.median(t), name=f"m{lib}{nbytes}"))
                   for lib, t in times.items()}
            rows.append((nbytes, select_shm_allreduce(nbytes, n), med))
    finally:
        group.close()
    if rank == 0:
        print(f"\nallreduce float32 on {n} ranks of one host, 1 thread each; median per op "
              "(slowest rank); busbw = 2(n-1)/n * bytes / time")
        head = f"{'size':>8} {'shm algo':>10} |" + "".join(
            f" {lib + ' us':>10} {'GB/s':>6} |" for lib in libs)
        ratios = [lib for lib in libs if lib not in ("shm", "memcpy")]
        print(head + "".join(f" {'shm/' + r:>9}" for r in ratios))
        for nbytes, algo, med in rows:
            line = f"{_fmt_size(nbytes):>8} {algo:>10} |" + "".join(
                f" {med[lib] * 1e6:10.1f} {_rate(lib, nbytes, n, med[lib]):6.2f} |"
                for lib in libs)
            line += "".join(f" {med[r] / med['shm']:8.2f}x" for r in ratios)
            print(line, flush=True)
    if "gloo" in libs:
        dist.destroy_process_group()
    hora.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--latency-kib", type=int, nargs="*", default=[4],
                        help="small sizes (KiB) measured first")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size")
    parser.add_argument("--libs", nargs="+", default=list(LIBS), choices=LIBS)
    parser.add_argument("--budget-s", type=float, default=4.0,
                        help="approximate seconds spent per size")
    parser.add_argument("--worker", action="store_true", help="run as a rank (under hora run)")
    args = parser.parse_args()
    sizes = [k * 1024 for k in args.latency_kib] + [int(m * 1024 * 1024) for m in args.sizes_mib]
    if args.worker:
        worker(sizes, args.rounds, args.libs, args.budget_s)
        return
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(args.np), sys.executable,
           __file__, "--worker", "--rounds", str(args.rounds), "--budget-s", str(args.budget_s),
           "--libs", *args.libs, "--latency-kib", *map(str, args.latency_kib),
           "--sizes-mib", *map(str, args.sizes_mib)]
    sys.exit(subprocess.call(cmd, env=dict(os.environ)))


if __name__ == "__main__":
    main()
