"""Shared-memory collectives (ShmGroup) against numpy: the conformance checks of the ring tests.

In-process worlds: ``n`` threads over the loopback transport, each rank with its own real
segments under /dev/shm (threads share them by name like processes do). Real processes: the
same checks through ``hora run`` in tests/collectives/shm_worker.py.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _case_jobs import run_group

from hora.collectives.ops import ReduceOp, scale_inplace
from hora.collectives.select import (
    SHM_CHUNK_BYTES,
    SHM_CHUNK_BYTES_OVERSUBSCRIBED,
    SHM_ONE_CHUNK_BYTES,
    SHM_SMALL_ALLREDUCE_BYTES,
    select_shm_allreduce,
)
from hora.collectives.shm import ShmGroup
from hora.errors import HoraTimeoutError, PeerLostError, TransportError
from hora.transports.loopback import run_world
from hora.transports.shm import job_segments
from hora.transports.shm_fabric import ShmFabric

from .helpers import DTYPES, FLOAT_DTYPES, OPS, make_inputs, reference, same_bytes, sizes_for

WORKER = str(Path(__file__).with_name("shm_worker.py"))
ALGOS = ["replicated", "chunked", "staged", "staged-big"]
_ids = itertools.count()


@pytest.fixture
def job_id() -> Iterator[str]:
    """A fresh job id; the test fails if any of its segments outlive it."""
    jid = f"test{os.getpid()}n{next(_ids)}"
    yield jid
    left = job_segments(jid)
    for path in left:
        os.unlink(path)
    assert not left, f"segments left behind: {left}"


def shm_world(n: int, job_id: str, fn: Callable[[ShmGroup], Any], *, timeout: float = 10.0,
              comm_timeout: float = 10.0) -> list[Any]:
    """Run ``fn(group)`` on ``n`` loopback ranks, each with a ShmGroup; closes every group."""

    def body(transport: Any) -> Any:
        group = ShmGroup(ShmFabric.create(transport.comm(), job_id, timeout=timeout))
        try:
            return fn(group)
        finally:
            group.close()

    return run_world(n, body, timeout=comm_timeout, join_timeout=60.0)


def _force(monkeypatch: Any, algo: str) -> None:
    """``staged-big``: the staged algorithm for large buffers even for small ones."""
    if algo == "staged-big":
        monkeypatch.setattr("hora.collectives.shm.shm_replicated_bytes", lambda *_: -1)


def _allreduce(group: ShmGroup, buf: np.ndarray, op: ReduceOp, algo: str) -> np.ndarray:
    if not algo.startswith("staged"):
        group.allreduce(buf, op, algorithm=algo)
        return buf
    view = group.staging(buf.nbytes).view(buf.dtype)
    view[:] = buf
    group.allreduce(view, op)
    return view.copy()


# ---- allreduce ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("algo", ALGOS)
def test_allreduce_matches_numpy_every_dtype_and_op(job_id: str, monkeypatch: Any, algo: str,
                                                    n: int) -> None:
    monkeypatch.setattr("hora.collectives.shm.SHM_CHUNK_BYTES", 64)  # many chunks, odd last one
    monkeypatch.setattr("hora.collectives.shm.SHM_CHUNK_BYTES_OVERSUBSCRIBED", 64)
    monkeypatch.setattr("hora.collectives.shm.SHM_ONE_CHUNK_BYTES", 0)
    _force(monkeypatch, algo)
    cases = [(d, op, c) for d in DTYPES for op in OPS for c in sizes_for(n)]
    inputs = {case: make_inputs(*case[:2], n, case[2], seed=i) for i, case in enumerate(cases)}

    def body(group: ShmGroup) -> dict[Any, np.ndarray]:
        return {case: _allreduce(group, inputs[case][group.rank].copy(), case[1], algo)
                for case in cases}

    results = shm_world(n, job_id, body)
    for case in cases:
        expected = reference(inputs[case], case[1])
        for rank in range(n):
            got = results[rank][case]
            assert same_bytes(got, expected), (algo, n, rank, case, got[:8], expected[:8])


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("algo", ALGOS)
def test_float_results_bitwise_identical_on_every_rank(job_id: str, monkeypatch: Any, algo: str,
                                                       n: int) -> None:
    monkeypatch.setattr("hora.collectives.shm.SHM_CHUNK_BYTES", 1000)
    monkeypatch.setattr("hora.collectives.shm.SHM_CHUNK_BYTES_OVERSUBSCRIBED", 1000)
    monkeypatch.setattr("hora.collectives.shm.SHM_ONE_CHUNK_BYTES", 0)
    _force(monkeypatch, algo)
    rng = np.random.default_rng(n)
    cases: list[tuple[ReduceOp, np.ndarray]] = []
    for dtype in FLOAT_DTYPES:
        for op in (ReduceOp.Sum, ReduceOp.Product):
            scale = 1.0 if op == ReduceOp.Product else 1000.0
            cases.append((op, (rng.normal(size=(n, 997)) * scale).astype(dtype)))
        zeros = rng.choice(np.array([0.0, -0.0]), size=(n, 101)).astype(dtype)
        cases += [(ReduceOp.Min, zeros), (ReduceOp.Max, zeros)]

    def body(group: ShmGroup) -> list[np.ndarray]:
        return [_allreduce(group, data[group.rank].copy(), op, algo) for op, data in cases]

    results = shm_world(n, job_id, body)
    for i, (op, data) in enumerate(cases):
        for rank in range(1, n):
            assert same_bytes(results[rank][i], results[0][i]), (algo, data.dtype, op, rank)
        if op == ReduceOp.Sum:
            exact = data.astype(np.float64).sum(axis=0)
            tol = {"float16": 2e-2, "bfloat16": 1e-1, "float32": 1e-4, "float64": 1e-9}[
                str(data.dtype)]
            np.testing.assert_allclose(results[0][i].astype(np.float64), exact, rtol=tol,
                                       atol=tol * 1000 * n)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("algo", ALGOS)
def test_src_and_postscale_equal_copy_reduce_then_scale(job_id: str, monkeypatch: Any,
                                                        algo: str, n: int) -> None:
    """``src=`` (input read from the caller's array, left unchanged) and ``postscale=`` (folded
    into the passes) give the bytes of copying in, reducing, then ``scale_inplace``."""
    monkeypatch.setattr("hora.collectives.shm.SHM_CHUNK_BYTES", 64)
    monkeypatch.setattr("hora.collectives.shm.SHM_CHUNK_BYTES_OVERSUBSCRIBED", 64)
    monkeypatch.setattr("hora.collectives.shm.SHM_ONE_CHUNK_BYTES", 0)
    _force(monkeypatch, algo)
    cases = [(d, op, c, f) for d in ("float32", "float16", "int32", "bool")
             for op in (ReduceOp.Sum, ReduceOp.Max) for c in (0, 1, 13, 2053)
             for f in (1.0, 1 / 3)]
    inputs = {case: make_inputs(*case[:2], n, case[2], seed=i) for i, case in enumerate(cases)}

    def body(group: ShmGroup) -> dict[Any, tuple[np.ndarray, np.ndarray]]:
        out = {}
        for case in cases:
            x = inputs[case][group.rank].copy()
            if algo.startswith("staged"):
                view = group.staging(x.nbytes).view(x.dtype)
                view[:] = x
                group.allreduce(view, case[1], postscale=case[3])
                got = view.copy()
            else:
                got = np.full_like(x, 7)
                group.allreduce(got, case[1], algorithm=algo, src=x, postscale=case[3])
                assert same_bytes(x, inputs[case][group.rank]), "src was modified"
            old = _allreduce(group, inputs[case][group.rank].copy(), case[1], algo)
            scale_inplace(old, case[3])
            out[case] = (got, old)
        return out

    for rank, results in enumerate(shm_world(n, job_id, body)):
        for case, (got, old) in results.items():
            assert same_bytes(got, old), (algo, n, rank, case, got[:8], old[:8])


def test_src_errors(job_id: str) -> None:
    def body(group: ShmGroup) -> None:
        buf = np.zeros(8, np.float32)
        with pytest.raises(TypeError, match="src has dtype float64"):
            group.allreduce(buf, ReduceOp.Sum, src=np.zeros(8))
        with pytest.raises(ValueError, match="src must have the buffer's 8 elements"):
            group.allreduce(buf, ReduceOp.Sum, src=np.zeros(7, np.float32))
        view = group.staging(buf.nbytes).view(np.float32)
        with pytest.raises(ValueError, match="needs an unstaged buffer"):
            group.allreduce(view, ReduceOp.Sum, src=buf)

    shm_world(2, job_id, body)


def test_large_allreduce_multiple_real_chunks_and_growth(job_id: str) -> None:
    """Sizes that grow the segments and span several default chunks, then shrink again."""
    sizes = [5, 70_000, 600_000, 3, 600_001]  # float32: 20 B .. 2.4 MB (3 chunks of 1 MiB)

    def body(group: ShmGroup) -> list[np.ndarray]:
        out = []
        for i, count in enumerate(sizes):
            buf = np.arange(count, dtype=np.float32) % 251 + group.rank + i
            group.allreduce(buf, ReduceOp.Sum)
            out.append(buf)
        return out

    results = shm_world(3, job_id, body)
    for i, count in enumerate(sizes):
        expected = sum(np.arange(count, dtype=np.float32) % 251 + r + i for r in range(3))
        for rank in range(3):
            assert np.array_equal(results[rank][i], expected), (count, rank)


def test_average_is_reduced_as_sum_and_adasum_is_rejected(job_id: str) -> None:
    def body(group: ShmGroup) -> np.ndarray:
        buf = np.full(5, group.rank + 1, dtype=np.float32)
        group.allreduce(buf, ReduceOp.Average)
        with pytest.raises(NotImplementedError, match="Adasum"):
            group.allreduce(buf.copy(), ReduceOp.Adasum)
        return buf

    assert all((r == 6).all() for r in shm_world(3, job_id, body))


def test_argument_errors_and_staging_misuse(job_id: str) -> None:
    def body(group: ShmGroup) -> None:
        with pytest.raises(ValueError, match="1-D"):
            group.allreduce(np.zeros((2, 3), np.float32), ReduceOp.Sum)
        with pytest.raises(ValueError, match="C-contiguous"):
            group.allreduce(np.zeros(8, np.float32)[::2], ReduceOp.Sum)
        with pytest.raises(TypeError, match="unsupported dtype complex64"):
            group.allreduce(np.zeros(4, np.complex64), ReduceOp.Sum)
        with pytest.raises(ValueError, match="unknown shm allreduce"):
            group.allreduce(np.zeros(4, np.float32), ReduceOp.Sum, algorithm="ring")
        group.staging(64)
        with pytest.raises(ValueError, match="staging"):
            group.allreduce(np.zeros(16, np.float32), ReduceOp.Sum)
        group.staging(64)
        with pytest.raises(ValueError, match="staging"):
            group.barrier()
        group.barrier()  # the group is still usable

    shm_world(2, job_id, body)


@pytest.mark.parametrize("algo", ["staged", "staged-big"])
def test_staged_prefix_and_caller_may_write_right_after(job_id: str, monkeypatch: Any,
                                                        algo: str) -> None:
    """A prefix of the staging view works; writing the view right after return is safe."""
    _force(monkeypatch, algo)

    def body(group: ShmGroup) -> list[float]:
        sums = []
        for step in range(20):
            view = group.staging(4096 * 4).view(np.float32)[:1000 + step]
            view[:] = group.rank + step
            group.allreduce(view, ReduceOp.Sum)
            sums.append(float(view[-1]))
            view *= 0.5  # the executor's postscale writes the result in place
        return sums

    for sums in shm_world(3, job_id, body):
        assert sums == [3.0 + 3 * s for s in range(20)]


@pytest.mark.parametrize("cores", [2, 1])
def test_chunks_by_size_and_by_cores(job_id: str, monkeypatch: pytest.MonkeyPatch,
                                     cores: int) -> None:
    """Up to SHM_ONE_CHUNK_BYTES the chunked allreduce runs as one chunk (two signals per
    rank); one element more and it pipelines chunks, two signals each: SHM_CHUNK_BYTES when
    every rank has a core, SHM_CHUNK_BYTES_OVERSUBSCRIBED when the 2 ranks share 1 (the cores
    of the group: the union of its ranks' affinity masks, ShmFabric.cores)."""
    monkeypatch.setattr("hora.transports.shm_fabric.union_cores", lambda masks: cores)
    limit = SHM_ONE_CHUNK_BYTES // 4

    def body(group: ShmGroup) -> list[int]:
        posted = []
        for count in (limit, limit + 1):
            buf = np.full(count, group.rank + 1, np.float32)
            before = group.fabric.posted
            group.allreduce(buf, ReduceOp.Sum)
            posted.append((group.fabric.posted - before) & 0xFFFFFFFF)
            assert buf[0] == buf[-1] == 3.0
        return posted

    chunk = SHM_CHUNK_BYTES if cores >= 2 else SHM_CHUNK_BYTES_OVERSUBSCRIBED
    assert SHM_CHUNK_BYTES != SHM_CHUNK_BYTES_OVERSUBSCRIBED
    assert shm_world(2, job_id, body) == [[2, 2 * -(-(limit + 1) * 4 // chunk)]] * 2


def test_group_cores_is_the_union_of_the_ranks_masks() -> None:
    """mpirun binds each rank to one core: each process sees 1 core, the group has 2 (not
    oversubscribed); two ranks bound to the same core share 1."""
    from hora._util.cpus import AFFINITY_BYTES, affinity_record, union_cores

    def mask(*cpus: int) -> bytes:
        return sum(1 << c for c in cpus).to_bytes(AFFINITY_BYTES, "little")

    assert union_cores([mask(0), mask(1)]) == 2
    assert union_cores([mask(0), mask(0)]) == 1
    assert union_cores([mask(0, 1), mask(0, 1), mask(2)]) == 3
    assert union_cores([bytes(AFFINITY_BYTES)]) == 1
    assert len(affinity_record()) == AFFINITY_BYTES
    assert union_cores([affinity_record()]) == len(os.sched_getaffinity(0))


def test_steady_state_allocates_nothing_large(job_id: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SHM_CHUNK_BYTES", "SHM_CHUNK_BYTES_OVERSUBSCRIBED"):
        monkeypatch.setattr(f"hora.collectives.shm.{name}", 1 << 20)
    count = 1 << 22  # 16 MiB of float32: sixteen 1 MiB chunks

    def body(group: ShmGroup) -> tuple[int, int]:
        buf, small = np.ones(count, np.float32), np.ones(1000, np.float32)
        for _ in range(2):  # warm up: grows both segments
            group.allreduce(buf, ReduceOp.Max)
            group.allreduce(small, ReduceOp.Max)
        capacity = max(group.fabric.own(0).nbytes, group.fabric.own(1).nbytes)
        group.barrier()
        if group.rank == 0:
            tracemalloc.start()
        group.barrier()
        for _ in range(3):
            group.allreduce(buf, ReduceOp.Max)
            group.allreduce(small, ReduceOp.Max)
        group.barrier()
        peak = 0
        if group.rank == 0:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        return peak, capacity

    peak, capacity = shm_world(2, job_id, body)[0]
    assert peak < 64 * 1024, peak
    assert capacity == 8 << 20  # five 1 MiB chunk slots (rounded up), not the whole buffer


def test_select_shm_allreduce_thresholds() -> None:
    assert select_shm_allreduce(4096, 2) == "replicated"
    assert select_shm_allreduce(SHM_SMALL_ALLREDUCE_BYTES, 4) == "replicated"
    assert select_shm_allreduce(SHM_SMALL_ALLREDUCE_BYTES + 1, 4) == "chunked"
    assert select_shm_allreduce(1 << 30, 1) == "replicated"


# ---- the other collectives ---------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_allgather_broadcast_reducescatter_alltoall(job_id: str, n: int) -> None:
    rng = np.random.default_rng(n)
    dtypes = ["float32", "int64", "bfloat16", "bool", "uint8"]
    count_sets = [[0] * n, [1] * n, list(rng.integers(0, 9, n)), [i * 37 % 11 for i in range(n)]]
    data = {d: make_inputs(d, ReduceOp.Sum, n, 64, seed=3) for d in dtypes}
    matrix = rng.integers(0, 5, (n, n))

    def body(group: ShmGroup) -> dict[str, Any]:
        r, out = group.rank, {}
        for d, counts in itertools.product(dtypes, count_sets):
            gathered = np.empty(sum(counts), data[d][0].dtype)
            group.allgather(data[d][r][:counts[r]], counts, gathered)
            out[f"ag {d} {counts}"] = gathered
            total = sum(counts)
            scattered = np.empty(counts[r], data[d][0].dtype)
            group.reducescatter(data[d][r][:total].copy(), counts, ReduceOp.Sum, scattered)
            out[f"rs {d} {counts}"] = scattered
        for root in range(n):
            buf = data["float32"][r][:13 + root].copy()
            group.broadcast(buf, root)
            out[f"bc {root}"] = buf
        send = np.concatenate([np.full(matrix[r][j], 100 * r + j, np.int32) for j in range(n)])
        recv = np.empty(int(matrix[:, r].sum()), np.int32)
        group.alltoall(send, matrix[r].tolist(), recv, matrix[:, r].tolist())
        out["a2a"] = recv
        group.barrier()
        return out

    results = shm_world(n, job_id, body)
    for r in range(n):
        res = results[r]
        for d, counts in itertools.product(dtypes, count_sets):
            expected = np.concatenate([data[d][j][:counts[j]] for j in range(n)])
            assert same_bytes(res[f"ag {d} {counts}"], expected), (r, d, counts)
            lo, hi = sum(counts[:r]), sum(counts[:r + 1])
            red = reference([data[d][j][:sum(counts)] for j in range(n)], ReduceOp.Sum)
            assert same_bytes(res[f"rs {d} {counts}"], red[lo:hi]), (r, d, counts)
        for root in range(n):
            assert same_bytes(res[f"bc {root}"], data["float32"][root][:13 + root])
        expected_a2a = np.concatenate([np.full(matrix[j][r], 100 * j + r, np.int32)
                                       for j in range(n)])
        assert same_bytes(res["a2a"], expected_a2a)


def test_in_place_forms_used_by_hierarchical(job_id: str) -> None:
    """reducescatter into its own segment of buf; allgather whose sendbuf is its slot of out."""

    def body(group: ShmGroup) -> np.ndarray:
        buf = np.arange(10, dtype=np.float64) + group.rank
        counts = [4, 3, 3]
        lo, hi = sum(counts[:group.rank]), sum(counts[:group.rank + 1])
        group.reducescatter(buf, counts, ReduceOp.Sum, buf[lo:hi])
        group.allgather(buf[lo:hi], counts, buf)
        return buf

    for buf in shm_world(3, job_id, body):
        assert np.array_equal(buf, 3 * np.arange(10) + 3)


def test_random_sequence_of_collectives_keeps_segments_consistent(job_id: str,
                                                                  monkeypatch: Any) -> None:
    """Alternating kinds and sizes (and empty collectives, which must not flip the parity)
    exercise the two-segment protocol."""
    monkeypatch.setattr("hora.collectives.shm.SHM_CHUNK_BYTES", 4096)
    monkeypatch.setattr("hora.collectives.shm.SHM_CHUNK_BYTES_OVERSUBSCRIBED", 4096)
    monkeypatch.setattr("hora.collectives.shm.SHM_ONE_CHUNK_BYTES", 0)
    n, steps = 3, 120
    rng = np.random.default_rng(7)
    plan = [(rng.choice(["ar", "ag", "bc", "rs", "bar"]),
             int(rng.integers(0, 5000)) if rng.random() < 0.8 else 0)  # empty: no signals
            for _ in range(steps)]

    def body(group: ShmGroup) -> list[float]:
        r, out = group.rank, []
        for i, (kind, count) in enumerate(plan):
            if kind == "ar":
                buf = np.full(count, r + i, np.float64)
                group.allreduce(buf, ReduceOp.Sum)
                out.append(float(buf.sum()))
            elif kind == "ag":
                got = np.empty(3 * count, np.float64)
                group.allgather(np.full(count, r + i, np.float64), [count] * 3, got)
                out.append(float(got.sum()))
            elif kind == "bc":
                buf = np.full(count, r + i, np.float64)
                group.broadcast(buf, i % 3)
                out.append(float(buf.sum()))
            elif kind == "rs":
                res = np.empty(count, np.float64)
                group.reducescatter(np.full(3 * count, r + i, np.float64), [count] * 3,
                                    ReduceOp.Sum, res)
                out.append(float(res.sum()))
            else:
                group.barrier()
        return out

    results = shm_world(n, job_id, body)
    expected = []
    for i, (kind, count) in enumerate(plan):
        total = sum(r + i for r in range(3))
        if kind in ("ar", "rs") or kind == "ag":
            expected.append(float(count * total))
        elif kind == "bc":
            expected.append(float(count * (i % 3 + i)))
    assert all(res == expected for res in results)


# ---- failures ----------------------------------------------------------------------------------

def test_timeout_names_the_missing_peer(job_id: str) -> None:
    def body(group: ShmGroup) -> float:
        if group.rank == 1:
            time.sleep(1.0)  # never joins the allreduce below
            return 0.0
        start = time.monotonic()
        with pytest.raises(HoraTimeoutError, match=r"rank 1 \(host loopback\)"):
            group.allreduce(np.ones(4, np.float32), ReduceOp.Sum)
        return time.monotonic() - start

    elapsed = shm_world(2, job_id, body, timeout=0.3)[0]
    assert 0.25 < elapsed < 0.9, elapsed


def test_peer_that_closes_raises_peer_lost_fast(job_id: str) -> None:
    def body(group: ShmGroup) -> float:
        if group.rank == 1:
            time.sleep(0.2)
            group.close()
            return 0.0
        start = time.monotonic()
        with pytest.raises(PeerLostError, match=r"rank 1 \(host loopback\) closed") as info:
            group.allreduce(np.ones(1 << 16, np.float32), ReduceOp.Sum)
        assert info.value.peer == 1
        return time.monotonic() - start

    elapsed = shm_world(2, job_id, body, timeout=30.0)[0]
    assert elapsed < 2.0, elapsed


def test_a_failing_rank_closes_its_group_so_peers_fail_fast(job_id: str) -> None:
    """E.g. /dev/shm full on one rank mid-collective: the others get PeerLostError at once."""

    def body(transport: Any) -> float:
        fabric = ShmFabric.create(transport.comm(), job_id, timeout=30.0)
        if transport.rank == 0:
            def full(parity: int, nbytes: int) -> Any:
                raise TransportError("cannot allocate shared memory (simulated)")

            fabric.reserve = full  # type: ignore[method-assign]
        group = ShmGroup(fabric)
        start = time.monotonic()
        try:
            if transport.rank == 0:
                with pytest.raises(TransportError, match="simulated"):
                    group.allreduce(np.ones(10), ReduceOp.Sum)
                with pytest.raises(TransportError, match="failed earlier"):
                    group.barrier()
            else:
                with pytest.raises(PeerLostError, match=r"rank 0 \(host loopback\) closed"):
                    group.allreduce(np.ones(10), ReduceOp.Sum)
            return time.monotonic() - start
        finally:
            group.close()

    assert max(run_world(3, body)) < 2.0


# ---- real processes ----------------------------------------------------------------------------

def _run(np_: int, *args: str, timeout: float = 90.0) -> tuple[int, str, str]:
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(np_), sys.executable,
           WORKER, *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    ran = run_group(cmd, timeout=timeout, env=env)
    if ran.timed_out:
        pytest.fail(f"job did not finish in {timeout} s\nstdout:\n{ran.stdout}\n"
                    f"stderr:\n{ran.stderr}")
    return ran.returncode, ran.stdout, ran.stderr


def _job_ids(out: str) -> set[str]:
    return {line.split("JOB ", 1)[1].strip() for line in out.splitlines() if "JOB " in line}


@pytest.mark.integration
@pytest.mark.parametrize("n", [2, 3])
def test_real_processes_conformance(n: int) -> None:
    rc, out, err = _run(n, "conformance")
    assert rc == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert out.count("OK conformance") == n, out
    for jid in _job_ids(out):
        assert not job_segments(jid)


@pytest.mark.integration
def test_sigkilled_rank_is_detected_and_launcher_removes_segments() -> None:
    """Rank 1 SIGKILLs itself while rank 0 waits for it in an allreduce: rank 0 raises
    PeerLostError naming rank 1 within a fraction of a second, and after the job /dev/shm holds
    nothing of it."""
    rc, out, err = _run(2, "sigkill", timeout=60.0)
    assert rc != 0
    lost = [line for line in out.splitlines() if "LOST" in line]
    assert lost and "rank 1" in lost[0], f"stdout:\n{out}\nstderr:\n{err}"
    assert float(lost[0].rsplit("after ", 1)[1].split()[0]) < 1.5, lost[0]
    jids = _job_ids(out)
    assert jids, out
    for jid in jids:
        assert not job_segments(jid), job_segments(jid)


@pytest.mark.integration
def test_nothing_is_left_by_ranks_that_all_died() -> None:
    rc, out, err = _run(2, "abandon", timeout=60.0)
    assert rc == 128 + signal.SIGKILL, f"stdout:\n{out}\nstderr:\n{err}"
    paths = [line.split("SEGMENT ", 1)[1].strip() for line in out.splitlines()
             if "SEGMENT " in line]
    assert len(paths) == 6, out  # 3 per rank
    assert not [p for p in paths if os.path.exists(p)]
