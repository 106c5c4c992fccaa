"""Adasum (hora.collectives.adasum) against a numpy reference of the formula, over 2, 4 and 8
ranks of the loopback world, for float16 / bfloat16 / float32 / float64."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hora.collectives.adasum import adasum_allreduce, adasum_gathered, check_size, combine
from hora.collectives.allgather import allgather
from hora.collectives.ops import to_dtype

from .helpers import FLOAT_DTYPES


def reference(vectors: list[np.ndarray]) -> np.ndarray:
    """The recursive pairwise Adasum of ``vectors`` (len a power of two), in float64, written
    out from the formula independently of the implementation."""
    level = [v.astype(np.float64) for v in vectors]
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[0::2], level[1::2]):
            dot, an, bn = a @ b, a @ a, b @ b
            ca = 1 - dot / (2 * an) if an >= 1e-8 else 1.0
            cb = 1 - dot / (2 * bn) if bn >= 1e-8 else 1.0
            nxt.append(ca * a + cb * b)
        level = nxt
    return level[0]


def test_combine_sums_orthogonal_vectors_and_averages_equal_ones() -> None:
    a, b = np.array([1.0, 0.0]), np.array([0.0, 2.0])
    assert np.array_equal(combine(a, b), a + b)  # orthogonal: the sum
    assert np.allclose(combine(a, a), a)  # identical: the average
    assert np.array_equal(combine(a, np.zeros(2)), a)  # a zero vector keeps coefficient 1
    x, y = np.array([3.0, 1.0]), np.array([1.0, 2.0])
    dot = x @ y
    want = (1 - dot / (2 * (x @ x))) * x + (1 - dot / (2 * (y @ y))) * y
    assert np.allclose(combine(x, y), want)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_adasum_matches_the_reference_on_every_rank(fake_world: Any, n: int, dtype: str) -> None:
    dt = to_dtype(dtype)
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(37).astype(dt) for _ in range(n)]

    def body(comm: Any) -> np.ndarray:
        buf = inputs[comm.rank].copy()
        adasum_allreduce(comm, buf)
        return buf

    results = fake_world(n, body)
    # the recursion pairs rank r with r ^ 1, then r ^ 2, ...: the reference's tree order
    want = reference([x.astype(np.float64) for x in inputs])
    tol = {"float16": 5e-3, "bfloat16": 3e-2}.get(dtype, 1e-6)
    for r, got in enumerate(results):
        assert got.dtype == dt
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol,
                                   err_msg=f"rank {r}")
        assert got.tobytes() == results[0].tobytes()  # bitwise equal on every rank


def test_adasum_refuses_a_rank_count_that_is_not_a_power_of_two(fake_world: Any) -> None:
    """Horovod's exception type and words, then the count and what to do."""
    message = "non-power of 2 ranks is not supported yet: this process set has 3 ranks"
    with pytest.raises(NotImplementedError, match=message):
        check_size(3)
    check_size(1)
    check_size(8)

    def body(comm: Any) -> str:
        with pytest.raises(NotImplementedError, match=message) as info:
            adasum_allreduce(comm, np.ones(4, np.float32))
        return str(info.value)

    assert all("HINT: use op=Average" in m for m in fake_world(3, body))  # on every rank


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_fused_tensors_keep_their_own_coefficients(fake_world: Any, n: int,
                                                   dtype: str) -> None:
    """Tensors packed in one buffer (``counts``, empty ones too) give, bit for bit, what each
    gives alone: every tensor combines with its own dot products."""
    dt = to_dtype(dtype)
    rng = np.random.default_rng(3)
    counts = [5, 0, 17, 1, 40]
    tensors = [[(rng.standard_normal(c) * (1 + 5 * t * r) + t).astype(dt) for t, c in
                enumerate(counts)] for r in range(n)]

    def body(comm: Any) -> tuple[np.ndarray, list[np.ndarray]]:
        fused = np.concatenate(tensors[comm.rank])
        adasum_allreduce(comm, fused, counts=counts)
        alone = []
        for t in tensors[comm.rank]:
            buf = t.copy()
            adasum_allreduce(comm, buf)
            alone.append(buf)
        return fused, alone

    for fused, alone in fake_world(n, body):
        assert fused.tobytes() == np.concatenate(alone).tobytes()
    whole = reference([np.concatenate(tensors[r]).astype(np.float64) for r in range(n)])
    assert not np.allclose(np.concatenate(alone).astype(np.float64), whole, rtol=1e-3)


def test_counts_must_add_up(fake_world: Any) -> None:
    def body(comm: Any) -> None:
        with pytest.raises(ValueError, match=r"counts \[2, 2\] do not add up to the buffer's 5"):
            adasum_allreduce(comm, np.ones(5), counts=[2, 2])

    fake_world(2, body)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_gathered_equals_the_recursive_exchange(fake_world: Any, n: int, dtype: str) -> None:
    """One host's form (every vector gathered, the tree computed locally) gives, bit for bit,
    the recursive exchange's result, fused tensors included."""
    dt = to_dtype(dtype)
    rng = np.random.default_rng(11)
    counts = [9, 0, 30]
    inputs = [(rng.standard_normal(39) + r).astype(dt) for r in range(n)]

    def body(comm: Any) -> tuple[np.ndarray, np.ndarray]:
        exchanged, gathered = inputs[comm.rank].copy(), inputs[comm.rank].copy()
        adasum_allreduce(comm, exchanged, counts=counts)
        adasum_gathered(lambda x, out: allgather(comm, x, [x.size] * comm.size, out),
                        comm.size, gathered, counts=counts)
        return exchanged, gathered

    for exchanged, gathered in fake_world(n, body):
        assert exchanged.tobytes() == gathered.tobytes()
