"""All-to-all with uneven splits, including zeros, on n = 1..8 ranks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hora.collectives.alltoall import alltoall
from hora.collectives.ops import SUPPORTED_DTYPES
from hora.transports.loopback import make_world


def _splits(n: int, pattern: int) -> list[list[int]]:
    """``splits[src][dst]``: elements rank src sends to rank dst."""
    if pattern == 0:
        return [[2] * n for _ in range(n)]
    if pattern == 1:
        return [[(src * 3 + dst * 5) % 4 for dst in range(n)] for src in range(n)]
    if pattern == 2:
        return [[0] * n for _ in range(n)]
    return [[257 if dst == (src + 1) % n else 0 for dst in range(n)] for src in range(n)]


def _piece(src: int, dst: int, count: int, dtype: str) -> np.ndarray:
    values = src * 10_000 + dst * 100 + np.arange(count) % 100
    return (values % 2 == 1 if dtype == "bool" else values).astype(SUPPORTED_DTYPES[dtype])


@pytest.mark.parametrize("n", range(1, 9))
def test_alltoall_delivers_every_piece(fake_world: Any, n: int) -> None:
    cases = [(dtype, _splits(n, p)) for dtype in ("int32", "bool", "float64") for p in range(4)]

    def body(comm: Any) -> list[np.ndarray]:
        me, outs = comm.rank, []
        for dtype, splits in cases:
            send = np.concatenate([_piece(me, d, splits[me][d], dtype) for d in range(n)])
            recv_counts = [splits[s][me] for s in range(n)]
            recv = np.empty(sum(recv_counts), SUPPORTED_DTYPES[dtype])
            alltoall(comm, send, splits[me], recv, recv_counts)
            outs.append(recv)
        return outs

    results = fake_world(n, body)
    for i, (dtype, splits) in enumerate(cases):
        for me in range(n):
            expected = np.concatenate([_piece(s, me, splits[s][me], dtype) for s in range(n)])
            assert results[me][i].tobytes() == expected.tobytes(), (dtype, me)


def test_alltoall_argument_errors() -> None:
    comm = make_world(1)[0].comm()
    with pytest.raises(ValueError, match="send_counts has 2 entries"):
        alltoall(comm, np.zeros(2), [1, 1], np.zeros(2), [2])
    with pytest.raises(ValueError, match=r"sendbuf has 3 elements but sum\(send_counts\) = 2"):
        alltoall(comm, np.zeros(3), [2], np.zeros(2), [2])
    with pytest.raises(ValueError, match=r"recvbuf has 1 elements but sum\(recv_counts\) = 2"):
        alltoall(comm, np.zeros(2), [2], np.zeros(1), [2])
    with pytest.raises(ValueError, match="sends itself 2 elements but expects to receive 1"):
        alltoall(comm, np.zeros(2), [2], np.zeros(1), [1])
    both = np.zeros(4)
    with pytest.raises(ValueError, match="must not overlap"):
        alltoall(comm, both[:3], [3], both[1:], [3])
    with pytest.raises(TypeError, match="dtype"):
        alltoall(comm, np.zeros(2), [2], np.zeros(2, np.int64), [2])
