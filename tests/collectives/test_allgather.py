"""Allgather with per-rank counts (including zeros) on n = 1..8 ranks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hora.collectives.allgather import allgather
from hora.collectives.ops import SUPPORTED_DTYPES
from hora.transports.loopback import make_world


def _count_patterns(n: int) -> list[list[int]]:
    return [
        [5] * n,                               # equal
        [(r * 7 + 3) % 6 for r in range(n)],   # uneven, zeros for some n
        [0] * n,                               # nothing at all
        [0] * (n - 1) + [13],                  # only the last rank has data
        [1 if r % 2 else 0 for r in range(n)], # alternating zeros
        [2053 if r == 0 else r for r in range(n)],
    ]


def _data(rank: int, count: int, dtype: str) -> np.ndarray:
    values = np.arange(count) + 100 * rank
    return (values % 2 == 1 if dtype == "bool" else values).astype(SUPPORTED_DTYPES[dtype])


@pytest.mark.parametrize("n", range(1, 9))
def test_allgather_concatenates_in_rank_order(fake_world: Any, n: int) -> None:
    cases = [(dtype, counts) for dtype in ("uint8", "bool", "bfloat16", "int16", "float64")
             for counts in _count_patterns(n)]

    def body(comm: Any) -> list[np.ndarray]:
        outs = []
        for dtype, counts in cases:
            out = np.full(sum(counts), 7, dtype=SUPPORTED_DTYPES[dtype])
            allgather(comm, _data(comm.rank, counts[comm.rank], dtype), counts, out)
            outs.append(out)
        return outs

    results = fake_world(n, body)
    for i, (dtype, counts) in enumerate(cases):
        expected = np.concatenate([_data(r, counts[r], dtype) for r in range(n)])
        for rank in range(n):
            assert results[rank][i].tobytes() == expected.tobytes(), (dtype, counts, rank)


def test_allgather_sendbuf_may_alias_its_own_slot(fake_world: Any) -> None:
    counts = [2, 0, 3, 1]
    starts = np.cumsum([0] + counts)

    def body(comm: Any) -> np.ndarray:
        out = np.zeros(sum(counts), np.int32)
        slot = out[starts[comm.rank]:starts[comm.rank + 1]]
        slot[:] = comm.rank + 1
        allgather(comm, slot, counts, out)
        return out

    for out in fake_world(4, body):
        assert out.tolist() == [1, 1, 3, 3, 3, 4]


def test_allgather_argument_errors() -> None:
    comm = make_world(1)[0].comm()
    with pytest.raises(ValueError, match="counts has 2 entries but the group has 1 ranks"):
        allgather(comm, np.zeros(1), [1, 1], np.zeros(2))
    with pytest.raises(ValueError, match=r"sendbuf has 2 elements but counts\[0\] = 3"):
        allgather(comm, np.zeros(2), [3], np.zeros(3))
    with pytest.raises(ValueError, match=r"out has 4 elements but sum\(counts\) = 3"):
        allgather(comm, np.zeros(3), [3], np.zeros(4))
    with pytest.raises(ValueError, match="negative"):
        allgather(comm, np.zeros(0), [-1], np.zeros(0))
    with pytest.raises(TypeError, match="dtype float64 but allgather out has dtype float32"):
        allgather(comm, np.zeros(3), [3], np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        allgather(comm, np.zeros(6)[::2], [3], np.zeros(3))
    with pytest.raises(ValueError, match="1-D"):
        allgather(comm, np.zeros(3), [3], np.zeros((3, 1)))
