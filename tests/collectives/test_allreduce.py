"""Allreduce (ring, star, small) against numpy: n = 1..8, every dtype x op, odd/empty sizes."""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest

from hora.collectives.allreduce import (
    ALGORITHMS,
    allreduce,
    ring_allreduce,
    small_allreduce,
    star_allreduce,
)
from hora.collectives.comm import Buffer, SubComm
from hora.collectives.ops import ReduceOp
from hora.transports.loopback import make_world

from .helpers import DTYPES, FLOAT_DTYPES, OPS, make_inputs, reference, same_bytes, sizes_for

ALGOS = list(ALGORITHMS)


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("algorithm", ALGOS)
def test_allreduce_matches_numpy_every_dtype_and_op(fake_world: Any, algorithm: str,
                                                    n: int) -> None:
    cases = [(d, op, c) for d in DTYPES for op in OPS for c in sizes_for(n)]
    inputs = {case: make_inputs(*case[:2], n, case[2], seed=i) for i, case in enumerate(cases)}
    scratch = [np.empty(64, np.uint8) for _ in range(n)]  # reused; too small for big cases

    def body(comm: Any) -> dict[Any, np.ndarray]:
        out = {}
        for case in cases:
            buf = inputs[case][comm.rank].copy()
            allreduce(comm, buf, case[1], algorithm, scratch[comm.rank])
            out[case] = buf
        return out

    results = fake_world(n, body)
    for case in cases:
        expected = reference(inputs[case], case[1])
        for rank in range(n):
            got = results[rank][case]
            assert same_bytes(got, expected), (
                f"{algorithm} n={n} rank {rank} {case}: got {got[:8]} expected {expected[:8]}")


@pytest.mark.parametrize("n", [2, 3, 5, 6, 8])
@pytest.mark.parametrize("algorithm", ALGOS)
def test_float_results_bitwise_identical_on_every_rank(fake_world: Any, algorithm: str,
                                                       n: int) -> None:
    """Random floats round differently in different orders: every rank must still agree."""
    rng = np.random.default_rng(n)
    cases: list[tuple[str, ReduceOp, list[np.ndarray]]] = []
    for dtype in FLOAT_DTYPES:
        for op in (ReduceOp.Sum, ReduceOp.Product):
            raw = rng.normal(size=(n, 997)) * (1.0 if op == ReduceOp.Product else 1000.0)
            cases.append((dtype, op, [raw[r].astype(dtype) for r in range(n)]))
        # min(0.0, -0.0) is not bitwise commutative: the order must be fixed across ranks
        zeros = rng.choice(np.array([0.0, -0.0]), size=(n, 101))
        for op in (ReduceOp.Min, ReduceOp.Max):
            cases.append((dtype, op, [zeros[r].astype(dtype) for r in range(n)]))

    def body(comm: Any) -> list[np.ndarray]:
        out = []
        for _, op, data in cases:
            buf = data[comm.rank].copy()
            allreduce(comm, buf, op, algorithm)
            out.append(buf)
        return out

    results = fake_world(n, body)
    for i, (dtype, op, data) in enumerate(cases):
        for rank in range(1, n):
            assert same_bytes(results[rank][i], results[0][i]), (dtype, op.name, rank)
        if op == ReduceOp.Sum:  # and the value is right, within the dtype's rounding
            exact = np.sum([d.astype(np.float64) for d in data], axis=0)
            tol = {"float16": 2e-2, "bfloat16": 1e-1, "float32": 1e-4, "float64": 1e-9}[dtype]
            np.testing.assert_allclose(results[0][i].astype(np.float64), exact,
                                       rtol=tol, atol=tol * 1000 * n)


@pytest.mark.parametrize("algorithm", ALGOS)
def test_average_is_reduced_as_sum_and_adasum_is_rejected(fake_world: Any,
                                                         algorithm: str) -> None:
    def body(comm: Any) -> np.ndarray:
        buf = np.full(5, comm.rank + 1, dtype=np.float32)
        allreduce(comm, buf, ReduceOp.Average, algorithm)  # the caller applies 1/size
        with pytest.raises(NotImplementedError, match="Adasum"):
            allreduce(comm, buf.copy(), ReduceOp.Adasum, algorithm)
        return buf

    for result in fake_world(3, body):
        assert (result == 6).all()


def test_allreduce_rejects_unknown_algorithm() -> None:
    comm = make_world(1)[0].comm()
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'auto'.*ring, star, small"):
        allreduce(comm, np.zeros(3), ReduceOp.Sum, "auto")


@pytest.mark.parametrize("fn", [ring_allreduce, star_allreduce, small_allreduce])
def test_allreduce_argument_errors(fn: Any) -> None:
    comm = make_world(1)[0].comm()
    with pytest.raises(ValueError, match="1-D"):
        fn(comm, np.zeros((2, 3), np.float32), ReduceOp.Sum)
    with pytest.raises(ValueError, match="C-contiguous"):
        fn(comm, np.zeros(8, np.float32)[::2], ReduceOp.Sum)
    read_only = np.zeros(4, np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        fn(comm, read_only, ReduceOp.Sum)
    with pytest.raises(TypeError, match="unsupported dtype complex64"):
        fn(comm, np.zeros(4, np.complex64), ReduceOp.Sum)
    with pytest.raises(TypeError, match="numpy array"):
        fn(comm, [1.0, 2.0], ReduceOp.Sum)
    with pytest.raises(ValueError, match="uint8"):
        fn(comm, np.zeros(4, np.float32), ReduceOp.Sum, np.zeros(64, np.float32))


@pytest.mark.parametrize("algorithm", ALGOS)
def test_allreduce_on_disjoint_process_sets_at_once(fake_world: Any, algorithm: str) -> None:
    """Two sub-groups of one world run collectives concurrently without crosstalk."""
    groups = [[0, 2, 3], [1, 4]]

    def body(comm: Any) -> np.ndarray:
        members = groups[0] if comm.rank in groups[0] else groups[1]
        sub = SubComm(comm, members)
        buf = np.full(11, comm.rank, dtype=np.int64)
        for _ in range(3):
            allreduce(sub, buf, ReduceOp.Max, algorithm)
            buf += 1
        return buf

    results = fake_world(5, body)
    assert [int(r[0]) for r in results] == [6, 7, 6, 6, 7]


class _MirrorComm:
    """A single-threaded Comm whose peers 'send' exactly what this rank sends (no copies)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def describe(self, peer: int) -> str:
        return f"rank {peer}"

    def send(self, peer: int, buf: Buffer) -> None:
        raise AssertionError("ring allreduce only uses sendrecv")

    def recv_into(self, peer: int, buf: Buffer) -> None:
        raise AssertionError("ring allreduce only uses sendrecv")

    def sendrecv(self, send_peer: int, send_buf: Buffer, recv_peer: int, recv_buf: Buffer) -> None:
        np.copyto(recv_buf, send_buf)


def test_ring_allreduce_with_scratch_allocates_nothing_large() -> None:
    comm = _MirrorComm(rank=1, size=4)
    buf = np.ones(1 << 18, dtype=np.float32)  # 1 MiB, chunks of 256 KiB
    scratch = np.empty(buf.nbytes, dtype=np.uint8)
    ring_allreduce(comm, buf, ReduceOp.Sum, scratch)  # warm up
    buf[:] = 1
    tracemalloc.start()
    try:
        ring_allreduce(comm, buf, ReduceOp.Sum, scratch)
        _, with_scratch = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        ring_allreduce(comm, buf, ReduceOp.Sum, None)
        _, without_scratch = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert with_scratch < 32 * 1024, with_scratch
    assert without_scratch >= buf.nbytes // 4  # the measurement does see a chunk allocation
