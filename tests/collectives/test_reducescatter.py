"""Reduce-scatter with uneven counts on n = 1..8 ranks, every dtype x op."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hora.collectives.ops import ReduceOp
from hora.collectives.reducescatter import reducescatter
from hora.transports.loopback import make_world

from .helpers import DTYPES, OPS, make_inputs, reference, same_bytes


def _count_patterns(n: int) -> list[list[int]]:
    return [
        [3] * n,
        [(r * 5 + 2) % 4 for r in range(n)],  # uneven with zeros
        [0] * n,
        [0] * (n - 1) + [1031],
    ]


@pytest.mark.parametrize("n", range(1, 9))
def test_reducescatter_matches_numpy(fake_world: Any, n: int) -> None:
    cases = [(dtype, op, tuple(counts)) for dtype in DTYPES for op in OPS
             for counts in _count_patterns(n)]
    inputs = {case: make_inputs(case[0], case[1], n, sum(case[2]), seed=i)
              for i, case in enumerate(cases)}
    scratch = [np.empty(16, np.uint8) for _ in range(n)]

    def body(comm: Any) -> dict[Any, np.ndarray]:
        outs = {}
        for case in cases:
            _, op, counts = case
            buf = inputs[case][comm.rank].copy()
            out = np.empty(counts[comm.rank], buf.dtype)
            reducescatter(comm, buf, counts, op, out, scratch[comm.rank])
            outs[case] = out
        return outs

    results = fake_world(n, body)
    for case in cases:
        full = reference(inputs[case], case[1])
        bounds = np.cumsum((0,) + case[2])
        for rank in range(n):
            expected = full[bounds[rank]:bounds[rank + 1]]
            assert same_bytes(results[rank][case], expected), (case, rank)


def test_reducescatter_out_may_be_the_buffer_segment(fake_world: Any) -> None:
    counts = [1, 2, 3]

    def body(comm: Any) -> np.ndarray:
        buf = np.arange(6, dtype=np.int64) * (comm.rank + 1)
        start = sum(counts[:comm.rank])
        out = buf[start:start + counts[comm.rank]]
        reducescatter(comm, buf, counts, ReduceOp.Average, out)  # Average reduces as Sum
        return out.copy()

    results = fake_world(3, body)
    assert [r.tolist() for r in results] == [[0], [6, 12], [18, 24, 30]]


def test_reducescatter_argument_errors() -> None:
    comm = make_world(1)[0].comm()
    with pytest.raises(ValueError, match=r"buffer has 2 elements but sum\(counts\) = 3"):
        reducescatter(comm, np.zeros(2), [3], ReduceOp.Sum, np.zeros(3))
    with pytest.raises(ValueError, match=r"out has 2 elements but counts\[0\] = 3"):
        reducescatter(comm, np.zeros(3), [3], ReduceOp.Sum, np.zeros(2))
    with pytest.raises(TypeError, match="dtype"):
        reducescatter(comm, np.zeros(3), [3], ReduceOp.Sum, np.zeros(3, np.float32))
    with pytest.raises(NotImplementedError, match="Adasum"):
        reducescatter(comm, np.zeros(3), [3], ReduceOp.Adasum, np.zeros(3))
    with pytest.raises(ValueError, match="entries but the group has 1 ranks"):
        reducescatter(comm, np.zeros(3), [1, 2], ReduceOp.Sum, np.zeros(1))
