"""Worker scenarios run by tests/integration through real `hora run` jobs.

Usage: python worker.py SCENARIO. Each scenario asserts on its own rank and prints one line
starting with "OK" (or the error text the test asserts on).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import hora


def api() -> None:
    hora.init()
    r, n = hora.rank(), hora.size()
    # allreduce: every op over several dtypes
    for dtype in ("int32", "int64", "float16", "float32", "float64", "bfloat16", "uint8"):
        x = (np.arange(5) % 3 + r + 1).astype(dtype)
        ref = [(np.arange(5) % 3 + q + 1).astype(np.float64) for q in range(n)]
        got = hora.allreduce(x, op=hora.Sum, name=f"sum.{dtype}")
        assert got.dtype == x.dtype and np.allclose(got.astype(np.float64), sum(ref)), dtype
        assert np.allclose(hora.allreduce(x, op=hora.Max, name=f"max.{dtype}").astype(float),
                           np.max(ref, 0))
        assert np.allclose(hora.allreduce(x, op=hora.Min, name=f"min.{dtype}").astype(float),
                           np.min(ref, 0))
        assert np.allclose(hora.allreduce(x, op=hora.Product, name=f"prod.{dtype}")
                           .astype(float), np.prod(ref, 0))
    avg = hora.allreduce(np.full(4, float(r)), name="avg")
    assert np.allclose(avg, (n - 1) / 2), avg
    flags = hora.allreduce(np.array([r == 0, True]), op=hora.Max, name="bool")
    assert flags.tolist() == [True, True]
    # in place, non-contiguous, prescale/postscale
    y = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    hora.allreduce_(y, op=hora.Sum, prescale_factor=2.0, postscale_factor=0.5, name="nc")
    assert np.allclose(y, n * np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2])
    # allgather with differing first dims, broadcast from every root
    g = hora.allgather(np.full((r + 1, 2), r, np.int16), name="ag")
    assert g.shape == (n * (n + 1) // 2, 2) and g[-1, 0] == n - 1
    for root in range(n):
        b = hora.broadcast(np.full(3, r, np.float64), root, name=f"bc{root}")
        assert (b == root).all()
    # alltoall with splits, reducescatter
    splits = [(r + j) % 2 + 1 for j in range(n)]
    out, recv = hora.alltoall(np.full(sum(splits), r, np.int32), splits, name="a2a")
    assert list(recv) == [(j + r) % 2 + 1 for j in range(n)]
    assert out.tolist() == sum(([j] * int(c) for j, c in enumerate(recv)), [])
    rs = hora.reducescatter(np.ones((2 * n + 1, 3), np.float32), op=hora.Sum, name="rs")
    assert rs.shape == (3 if r == 0 else 2, 3) and (rs == n).all()
    # async + poll + synchronize, grouped
    h = hora.allreduce_async(np.full(2, 1.0), op=hora.Sum, name="async")
    while not hora.poll(h):
        time.sleep(0.001)
    assert (hora.synchronize(h) == n).all()
    outs = hora.grouped_allreduce([np.ones(3), np.ones((2, 2))], op=hora.Sum, name="grp")
    assert [o.sum() for o in outs] == [3 * n, 4 * n]
    # objects
    assert hora.broadcast_object({"from": r}, 1 % n) == {"from": 1 % n}
    assert hora.allgather_object(("r", r)) == [("r", q) for q in range(n)]
    # topology
    assert hora.local_rank() == r and hora.local_size() == n and hora.cross_size() == 1
    assert hora.is_homogeneous()
    hora.barrier()
    print(f"OK api rank {r}")


def mismatch() -> None:
    hora.init()
    r = hora.rank()
    try:
        hora.allreduce(np.zeros(3 if r != 1 else 4, np.float32), name="bad")
    except hora.HorovodInternalError as exc:
        print(f"ERR {exc}")
    # the job goes on after a mismatch
    assert hora.allreduce(np.ones(1), op=hora.Sum, name="after")[0] == hora.size()
    print("OK mismatch")


def dead_rank() -> None:
    hora.init()
    r = hora.rank()
    hora.allreduce(np.ones(1), name="warm")
    if r == hora.size() - 1:
        os._exit(0)  # vanish without shutdown, like a crash that leaves no error
    t0 = time.monotonic()
    try:
        hora.allreduce(np.ones(1 << 16), name="never")
    except hora.HorovodInternalError as exc:
        print(f"ERR after {time.monotonic() - t0:.1f}s: {exc}")
    try:
        hora.allreduce(np.ones(1), name="next")
    except hora.HorovodInternalError as exc:
        print(f"NEXT {type(exc).__name__}")


def stopped_rank() -> None:
    """The last rank stops (SIGSTOP): alive but silent. The others must notice by heartbeat."""
    import signal

    hora.init()
    r, n = hora.rank(), hora.size()
    pids = hora.allgather_object(os.getpid())
    if r == n - 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(0)  # resumed by rank 0 after the test saw the error
    t0 = time.monotonic()
    try:
        hora.allreduce(np.ones(4), name="never")
    except hora.HorovodInternalError as exc:
        print(f"ERR after {time.monotonic() - t0:.1f}s: {exc}", flush=True)
    if r == 0:
        os.kill(pids[-1], signal.SIGCONT)


def stall() -> None:
    """Rank 2 never submits 'forgotten': a warning names it, then the op fails everywhere."""
    hora.init()
    r = hora.rank()
    t0 = time.monotonic()
    if r != 2:
        try:
            hora.allreduce(np.ones(2), name="forgotten")
        except hora.HorovodInternalError as exc:
            print(f"ERR after {time.monotonic() - t0:.1f}s: {exc}", flush=True)
    else:
        time.sleep(4)  # busy elsewhere; joins the others at the barrier after their op failed
    hora.barrier()
    print(f"OK stall rank {r}")


def reinit() -> None:
    for _ in range(3):
        hora.init()
        assert hora.is_initialized()
        assert hora.allreduce(np.ones(2), op=hora.Sum, name="x")[0] == hora.size()
        hora.shutdown()
        assert not hora.is_initialized()
    print("OK reinit")


def bad_input() -> None:
    try:
        hora.rank()
    except ValueError as exc:
        print(f"NOTINIT {exc}")
    hora.init()
    try:
        hora.allreduce(np.zeros(2, np.complex64))
    except TypeError as exc:
        print(f"DTYPE {exc}")
    h = hora.allreduce_async(np.ones(1), name="dup")
    try:
        hora.allreduce_async(np.ones(1), name="dup")
    except ValueError as exc:
        print(f"DUP {exc}")
    hora.synchronize(h)
    print("OK bad_input")


def process_sets() -> None:
    even = hora.ProcessSet([0, 2])
    hora.init(process_sets=[even])
    r = hora.rank()
    if r in (0, 2):
        got = hora.allreduce(np.array([r]), op=hora.Sum, name="even", process_set=even)
        assert got[0] == 2 and even.rank() == r // 2
        hora.allreduce(np.array([r]), process_set=even)  # unnamed, only on the subset
        hora.barrier(process_set=even)
    else:
        try:
            hora.allreduce(np.array([r]), process_set=even)
        except ValueError as exc:
            print(f"NOTMEMBER {exc}")
    assert hora.allreduce(np.array([1]), op=hora.Sum, name="all")[0] == 3
    hora.barrier()  # unnamed ops on a subset must not shift the global set's automatic names
    assert hora.allreduce(np.array([1]), op=hora.Sum)[0] == 3
    print(f"OK process_sets rank {r}")


def dynamic_sets() -> None:
    hora.init(process_sets="dynamic")
    ps = hora.add_process_set([1, 2])
    if hora.rank() in (1, 2):
        assert hora.allreduce(np.ones(1), op=hora.Sum, process_set=ps, name="d")[0] == 2
    assert hora.remove_process_set(ps)
    print("OK dynamic")


def mismatched_sets() -> None:
    ranks = [0, 1] if hora_rank_from_env() == 0 else [0, 2]
    try:
        hora.init(process_sets=[hora.ProcessSet(ranks)])
    except ValueError as exc:
        print(f"SETS {exc}")


def sets_beyond_the_job() -> None:
    try:
        hora.init(process_sets=[hora.ProcessSet([0, 1]), hora.ProcessSet([0, 2])])
    except ValueError as exc:
        print(f"SETS {exc}")


def hora_rank_from_env() -> int:
    return int(os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "0")))


def join() -> None:
    hora.init()
    r = hora.rank()
    steps = 2 + r  # ranks run out of data at different times
    for i in range(steps):
        hora.allreduce(np.ones(2), op=hora.Sum, name=f"step{i}")
    last = hora.join()
    print(f"OK join rank {r} last {last}")


def timeline() -> None:
    hora.init()
    r = hora.rank()
    for _ in range(5):
        if r == 1:
            time.sleep(0.01)  # rank 1 is the straggler
        hs = [hora.allreduce_async(np.ones(100 + i), name=f"grad{i}") for i in range(3)]
        for h in hs:
            hora.synchronize(h)
        hora.broadcast(np.ones(4), 0, name="bcast")
    print(f"OK timeline rank {r}")


def simple() -> None:
    hora.init()
    got = hora.allreduce(np.full(3, hora.rank(), np.float32), op=hora.Sum)
    print(f"OK simple rank {hora.rank()} size {hora.size()} local {hora.local_rank()} "
          f"sum {got.tolist()}")


def adasum() -> None:
    """op=Adasum through the numpy API: the pairwise formula on every rank (rank r's vector is
    e_r + 1: a known answer), ints refused, a 3-rank process set refused."""
    three = hora.ProcessSet([0, 1, 2])  # a set of 3 ranks (only where the job has them)
    hora.init(process_sets=[three] if int(os.environ["HOROVOD_SIZE"]) >= 3 else [])
    r, n = hora.rank(), hora.size()
    x = np.ones(n, np.float64)
    x[r] += 1.0
    got = hora.allreduce(x, op=hora.Adasum, name="ada")
    level = [np.ones(n) + np.eye(n)[q] for q in range(n)]
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[0::2], level[1::2]):
            d = a @ b
            nxt.append((1 - d / (2 * (a @ a))) * a + (1 - d / (2 * (b @ b))) * b)
        level = nxt
    assert np.allclose(got, level[0]), (got, level[0])
    refused = [(np.ones(2, np.int32), hora.global_process_set, "floating-point", ValueError)]
    if r in (0, 1, 2) and n >= 3:
        refused.append((np.ones(2), three, "non-power of 2 ranks is not supported yet: this "
                        "process set has 3 ranks", NotImplementedError))
    for bad, ps, match, error in refused:
        try:
            hora.allreduce(bad, op=hora.Adasum, process_set=ps)
        except error as exc:
            assert match in str(exc), exc
        else:
            raise AssertionError(f"Adasum accepted {bad.dtype} on {ps}")
    print(f"OK adasum rank {r} {got.tolist()}", flush=True)


if __name__ == "__main__":
    globals()[sys.argv[1]]()
