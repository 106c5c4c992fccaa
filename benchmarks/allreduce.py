"""Allreduce: hora vs torch.distributed (gloo), side by side in one job; and star vs ring.

    python benchmarks/allreduce.py                      # 2 ranks, 4 KiB .. 256 MiB, hora vs gloo
    python benchmarks/allreduce.py --max-mib 64 --np 2
    python benchmarks/allreduce.py --algorithms         # star vs ring at 2, 3, 4 ranks
    python benchmarks/allreduce.py --mpi                # also Open MPI (mpirun + mpi4py)
    python benchmarks/allreduce.py --sizes-kib 4 4 4    # small-message latency, repeated
    python benchmarks/allreduce.py --data-plane builtin,torch,mpi   # hora over each data plane

Both libraries run in the same processes, interleaved per size (A B A B ...), because this
machine's speed swings 2-6x within minutes: only ratios from one job mean anything. Reported:
median time per allreduce, and bus bandwidth = 2 (n-1)/n * bytes / time (the NCCL-tests
convention; the bytes each rank must move for a bandwidth-optimal allreduce).
hora is measured through its full engine (``hora.allreduce``: negotiation, queueing, completion).

``--data-plane`` compares hora's data planes (docs/data-planes.md) in one job started by
``hora run --data-plane mpi`` (mpirun; without mpi in the list, plain ``hora run``): each round
runs hora once per plane (``hora.init()`` with ``HORA_DATA_PLANE`` set, every size, then
``hora.shutdown()``), the planes' order rotated per round, so that the planes interleave
(A B C, B C A, ...). The same processes also time the engines bare, outside hora: gloo's
``all_reduce`` on a ``torch.distributed`` group and ``MPI_Allreduce`` through mpi4py, so the
table shows what the planes cost and what hora's control plane adds on top of them.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _launch(np_: int, args: list[str], env: dict[str, str] | None = None,
            mpi: bool = False) -> int:
    launcher = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(np_)]
    extra = dict(env or {})
    if mpi:  # Open MPI's mpirun starts the ranks; hora reads its environment (no hora run)
        launcher = ["mpirun", "--oversubscribe", "-np", str(np_)]
        extra.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    return subprocess.call([*launcher, sys.executable, __file__, *args],
                           env={**os.environ, **extra})


def _sizes(max_mib: int) -> list[int]:
    sizes, n = [], 4096
    while n <= max_mib * 1024 * 1024:
        sizes.append(n)
        n *= 4
    return sizes


WARMUP = 3
"""Untimed ops of each size before the timed ones, for every library, with the timed op's own
name: hora's first op of a name is negotiated (the fast lane takes it from the second on) and
the first ones of a size grow and fault in the shared-memory segments, as MPI's and gloo's first
ones map theirs; the table is about the steady state of a training loop."""


def _reps(nbytes: int) -> int:
    return max(3, min(200, int(64 * 1024 * 1024 / max(nbytes, 1))))


def _busbw(nbytes: int, n: int, seconds: float) -> float:
    return 2 * (n - 1) / n * nbytes / seconds / 1e9


def _fmt_size(nbytes: int) -> str:
    return f"{nbytes // 1024} KiB" if nbytes < 1024 * 1024 else f"{nbytes // (1024 * 1024)} MiB"


def worker_vs_gloo(max_mib: int, rounds: int, sizes_kib: list[int] | None = None) -> None:
    import torch
    import torch.distributed as dist

    import hora
    from hora.collectives.select import select_allreduce
    from hora.core.engine import context

    torch.set_num_threads(1)
    hora.init()
    rank, n = hora.rank(), hora.size()
    port = hora.broadcast_object(_free_port() if rank == 0 else None, 0, name="port")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)
    cfg = context.get().config
    comm_mpi = None
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:
        from mpi4py import MPI  # launched by mpirun: measure Open MPI too

        comm_mpi = MPI.COMM_WORLD
    libs = ("hora", "gloo", "mpi") if comm_mpi is not None else ("hora", "gloo")
    rows = []
    for nbytes in ([k * 1024 for k in sizes_kib] if sizes_kib else _sizes(max_mib)):
        count = nbytes // 4
        x_np = np.zeros(count, np.float32)  # zeros: repeated in-place sums never overflow
        x_t = torch.zeros(count, dtype=torch.float32)
        reps = _reps(nbytes)
        times: dict[str, list[float]] = {lib: [] for lib in libs}
        x_mpi = np.zeros(count, np.float32)
        for _ in range(WARMUP):  # untimed: see WARMUP
            hora.allreduce_(x_np, op=hora.Sum, name="bench")
            dist.all_reduce(x_t)
            if comm_mpi is not None:
                comm_mpi.Allreduce(MPI.IN_PLACE, x_mpi)
        for _ in range(rounds):
            for lib in libs:
                dist.barrier()
                for _ in range(max(2, reps // rounds)):
                    t0 = time.perf_counter()
                    if lib == "hora":
                        hora.allreduce_(x_np, op=hora.Sum, name="bench")
                    elif lib == "gloo":
                        dist.all_reduce(x_t)
                    else:
                        comm_mpi.Allreduce(MPI.IN_PLACE, x_mpi)  # type: ignore[union-attr]
                    times[lib].append(time.perf_counter() - t0)
        # every rank's median; report the slowest rank (the op is done when the last rank is)
        med = {lib: max(hora.allgather_object(statistics.median(t), name=f"m{lib}{nbytes}"))
               for lib, t in times.items()}
        algo = context.get().engine.data_path(0) or "?"
        if algo == "ring":
            algo = select_allreduce(nbytes, n, cfg.allreduce_algorithm, cfg.small_allreduce_bytes)
        rows.append((nbytes, algo, med["hora"], med["gloo"], med.get("mpi")))
    if rank == 0:
        print(f"\nallreduce float32, {n} ranks, 1 thread each; median per op; "
              "busbw = 2(n-1)/n * bytes / time")
        mpi_head = f" | {'mpi us':>10} {'mpi GB/s':>9} | {'hora/mpi bw':>11}" if comm_mpi else ""
        print(f"{'size':>9} | {'hora algo':>9} {'hora us':>10} {'hora GB/s':>9} | "
              f"{'gloo us':>10} {'gloo GB/s':>9} | {'hora/gloo bw':>12}{mpi_head}")
        for nbytes, algo, th, tg, tm in rows:
            mpi_cols = (f" | {tm * 1e6:10.1f} {_busbw(nbytes, n, tm):9.3f} | {tm / th:10.2f}x"
                        if tm is not None else "")
            print(f"{_fmt_size(nbytes):>9} | {algo:>9} {th * 1e6:10.1f} "
                  f"{_busbw(nbytes, n, th):9.3f} | {tg * 1e6:10.1f} {_busbw(nbytes, n, tg):9.3f}"
                  f" | {tg / th:11.2f}x{mpi_cols}")
    # buffers are reused across ops: peak RSS stays near start-up + the largest size's buffers
    peak = hora.allgather_object(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                                 name="peak_rss")
    if rank == 0:
        print(f"peak RSS per rank (MiB): {' '.join(str(p) for p in peak)}")
    dist.destroy_process_group()
    hora.shutdown()


def worker_planes(planes: list[str], max_mib: int, rounds: int,
                  sizes_kib: list[int] | None) -> None:
    """One rank of the ``--data-plane`` comparison (see the module docstring)."""
    import torch
    import torch.distributed as dist

    import hora

    torch.set_num_threads(1)
    sizes = list(dict.fromkeys(k * 1024 for k in sizes_kib)) if sizes_kib else _sizes(max_mib)
    bufs = {n: np.zeros(n // 4, np.float32) for n in sizes}  # zeros: sums never overflow
    mpi_comm = None
    if "mpi" in planes:
        from mpi4py import MPI  # the ranks run under mpirun: MPI's world is hora's

        mpi_comm = MPI.COMM_WORLD
    times: dict[tuple[str, int], list[float]] = {}
    ready = False
    for r in range(rounds):
        for plane in planes[r % len(planes):] + planes[:r % len(planes)]:
            os.environ["HORA_DATA_PLANE"] = plane
            hora.init()
            if not ready:  # the bare engines: a gloo group, and MPI's world
                port = hora.broadcast_object(_free_port() if hora.rank() == 0 else None, 0,
                                             name="port")
                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                        rank=hora.rank(), world_size=hora.size())
                ready = True
            for nbytes in sizes:
                x = bufs[nbytes]
                for _ in range(WARM_OPS):  # the op itself, so the timed ones find it warm
                    hora.allreduce_(x, op=hora.Sum, name="bench")
                reps = max(3, _reps(nbytes) // rounds)
                hora.barrier()
                for _ in range(reps):
                    t0 = time.perf_counter()
                    hora.allreduce_(x, op=hora.Sum, name="bench")
                    times.setdefault((plane, nbytes), []).append(time.perf_counter() - t0)
            if plane == "builtin" or (plane == "mpi" and "builtin" not in planes):
                _bare_engines(sizes, bufs, rounds, times, mpi_comm)
            hora.shutdown()
    os.environ["HORA_DATA_PLANE"] = planes[0]
    hora.init()
    med = {key: max(hora.allgather_object(statistics.median(t), name=f"m{key[0]}{key[1]}"))
           for key, t in sorted(times.items())}
    if hora.rank() == 0:
        _plane_table(planes, sizes, med, hora.size(), mpi_comm is not None)
    dist.destroy_process_group()
    hora.shutdown()


WARM_OPS = 4
"""Untimed allreduces of each size after each ``hora.init()`` in ``--data-plane``. A fresh
``init`` maps fresh shared memory: on the builtin plane the first op of a size grows both
segments (the ops alternate between two) and faults them in, and the op after it opens the fast
lane's pair (<= 4 MiB): measured 2026-11-25, the first three 4 MiB ops took 3.9-4.9 ms and the
next ones 0.8-1.8 ms. MPI's memory stays mapped from ``MPI_Init`` on, so timing those first ops
compared a cold builtin plane with a warm engine."""


def _bare_engines(sizes: list[int], bufs: dict[int, np.ndarray], rounds: int,
                  times: dict[tuple[str, int], list[float]], mpi_comm: object) -> None:
    """gloo's and MPI's own allreduce of the same buffers (no hora in between)."""
    import torch
    import torch.distributed as dist

    for nbytes in sizes:
        t = torch.from_numpy(bufs[nbytes])
        dist.all_reduce(t)
        reps = max(3, _reps(nbytes) // rounds)
        dist.barrier()
        for _ in range(reps):
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.setdefault(("gloo", nbytes), []).append(time.perf_counter() - t0)
        if mpi_comm is not None:
            from mpi4py import MPI

            comm: Any = mpi_comm
            comm.Allreduce(MPI.IN_PLACE, bufs[nbytes])
            comm.Barrier()
            for _ in range(reps):
                t0 = time.perf_counter()
                comm.Allreduce(MPI.IN_PLACE, bufs[nbytes])
                times.setdefault(("MPI", nbytes), []).append(time.perf_counter() - t0)


def _plane_table(planes: list[str], sizes: list[int], med: dict[tuple[str, int], float],
                 n: int, with_mpi: bool) -> None:
    bare = ["gloo"] + (["MPI"] if with_mpi else [])
    print(f"\nallreduce float32, {n} ranks, 1 thread each; median per op (slowest rank); hora "
          f"through each data plane, then the bare engines (no hora); ratios: time / builtin's")
    head = " | ".join(f"{'hora ' + p:>13} {'GB/s':>6}" for p in planes)
    ratios = " ".join(f"{p + '/b':>8}" for p in planes if p != "builtin")
    print(f"{'size':>9} | {head} | {ratios} | " + " | ".join(f"{b + ' us':>10}" for b in bare))
    for nbytes in sizes:
        cols = " | ".join(f"{med[(p, nbytes)] * 1e6:10.1f} us "
                          f"{_busbw(nbytes, n, med[(p, nbytes)]):6.3f}" for p in planes)
        base = med.get(("builtin", nbytes))
        rat = " ".join(f"{med[(p, nbytes)] / base:7.2f}x" for p in planes
                       if p != "builtin" and base)
        raw = " | ".join(f"{med[(b, nbytes)] * 1e6:10.1f}" for b in bare if (b, nbytes) in med)
        print(f"{_fmt_size(nbytes):>9} | {cols} | {rat} | {raw}")


def worker_algorithms(mib: list[int], reps: int) -> None:
    import hora
    from hora.collectives.allreduce import ring_allreduce, star_allreduce
    from hora.core.engine import context

    hora.init()
    comm = context.get().engine.transport.comm()
    rank, n = hora.rank(), hora.size()
    out = []
    for size in mib:
        buf = np.ones(size * 1024 * 1024 // 4, np.float32)
        scratch = np.empty(buf.nbytes, np.uint8)
        times: dict[str, list[float]] = {"star": [], "ring": []}
        for _ in range(reps):
            for name, fn in (("star", star_allreduce), ("ring", ring_allreduce)):
                hora.barrier()
                t0 = time.perf_counter()
                fn(comm, buf, hora.Sum, scratch)
                times[name].append(time.perf_counter() - t0)
        med = {k: max(hora.allgather_object(statistics.median(v), name=f"a{k}{size}"))
               for k, v in times.items()}
        out.append((size, med["star"], med["ring"]))
    if rank == 0:
        for size, ts, tr in out:
            print(f"ALGO {n} ranks {size:4d} MiB | star {ts * 1e3:8.1f} ms "
                  f"{_busbw(size << 20, n, ts):6.3f} GB/s | ring {tr * 1e3:8.1f} ms "
                  f"{_busbw(size << 20, n, tr):6.3f} GB/s | star/ring time {ts / tr:5.2f}x")
    hora.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4, help="ABAB rounds per size")
    parser.add_argument("--algorithms", action="store_true", help="star vs ring at 2, 3, 4 ranks")
    parser.add_argument("--algo-mib", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--mpi", action="store_true",
                        help="launch with Open MPI's mpirun and also measure MPI_Allreduce "
                             "(needs mpirun and mpi4py)")
    parser.add_argument("--tcp", action="store_true",
                        help="measure hora's TCP ring (HORA_SHM=0) instead of shared memory")
    parser.add_argument("--sizes-kib", type=int, nargs="+",
                        help="measure exactly these sizes (KiB) instead of 4 KiB .. --max-mib")
    parser.add_argument("--data-plane", metavar="PLANES",
                        help="compare hora's data planes, e.g. builtin,torch,mpi (mpi: the "
                             "job starts under mpirun, which needs Open MPI and mpi4py)")
    parser.add_argument("--worker", choices=["gloo", "algos", "planes"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    planes = [p.strip() for p in (args.data_plane or "").split(",") if p.strip()]
    unknown = [p for p in planes if p not in ("builtin", "torch", "mpi")]
    if unknown:
        parser.error(f"--data-plane: unknown plane(s) {', '.join(unknown)}; choose from "
                     "builtin, torch, mpi")
    if args.worker == "planes":
        worker_planes(planes, args.max_mib, args.rounds, args.sizes_kib)
    elif args.worker == "gloo":
        worker_vs_gloo(args.max_mib, args.rounds, args.sizes_kib)
    elif args.worker == "algos":
        worker_algorithms(args.algo_mib, args.rounds)
    elif args.algorithms:
        for n in (2, 3, 4):
            rc = _launch(n, ["--worker", "algos", "--rounds", str(args.rounds), "--algo-mib",
                             *map(str, args.algo_mib)])
            if rc:
                sys.exit(rc)
    elif planes:
        sizes = ["--sizes-kib", *map(str, args.sizes_kib)] if args.sizes_kib else []
        extra = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                 "OMP_NUM_THREADS": "1"}
        launcher = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(args.np)]
        if "mpi" in planes:
            launcher += ["--data-plane", "mpi"]
        sys.exit(subprocess.call([*launcher, sys.executable, __file__, "--worker", "planes",
                                  "--data-plane", ",".join(planes), "--max-mib",
                                  str(args.max_mib), "--rounds", str(args.rounds), *sizes],
                                 env={**os.environ, **extra}))
    else:
        sizes = ["--sizes-kib", *map(str, args.sizes_kib)] if args.sizes_kib else []
        sys.exit(_launch(args.np, ["--worker", "gloo", "--max-mib", str(args.max_mib),
                                   "--rounds", str(args.rounds), *sizes],
                         env={"HORA_SHM": "0"} if args.tcp else None, mpi=args.mpi))


if __name__ == "__main__":
    main()
