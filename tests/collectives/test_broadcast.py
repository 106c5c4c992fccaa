"""Broadcast (tree, chain and the dispatcher) from every root, and the barrier."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from hora.collectives.barrier import barrier
from hora.collectives.broadcast import broadcast, chain_broadcast, tree_broadcast
from hora.collectives.ops import SUPPORTED_DTYPES
from hora.transports.loopback import make_world

SIZES = [0, 1, 7, 2053]


def _payload(root: int, count: int, dtype: str) -> np.ndarray:
    values = np.arange(count) * 3 + root
    return (values % 3 == 0 if dtype == "bool" else values).astype(SUPPORTED_DTYPES[dtype])


@pytest.mark.parametrize("n", range(1, 9))
def test_broadcast_from_every_root(fake_world: Any, n: int) -> None:
    variants = {
        "broadcast": lambda c, b, r: broadcast(c, b, r),
        "tree": tree_broadcast,
        "chain": lambda c, b, r: chain_broadcast(c, b, r, chunk_bytes=100),
    }
    cases = [(name, root, count, dtype) for name in variants for root in range(n)
             for count in SIZES for dtype in ("uint8", "bfloat16", "float64", "bool")]

    def body(comm: Any) -> list[np.ndarray]:
        outs = []
        for name, root, count, dtype in cases:
            if comm.rank == root:
                buf = _payload(root, count, dtype)
            else:
                buf = np.zeros(count, SUPPORTED_DTYPES[dtype])
            variants[name](comm, buf, root)
            outs.append(buf)
        return outs

    results = fake_world(n, body)
    for i, (name, root, count, dtype) in enumerate(cases):
        expected = _payload(root, count, dtype).tobytes()
        for rank in range(n):
            assert results[rank][i].tobytes() == expected, (name, root, count, dtype, rank)


def test_large_broadcast_takes_the_pipelined_chain(fake_world: Any) -> None:
    count = 3 * 1024 * 1024 // 4 + 5  # 3 MiB of float32: 4 chunks of 1 MiB on 4 ranks

    def body(comm: Any) -> bool:
        buf = np.arange(count, dtype=np.float32) if comm.rank == 2 else np.zeros(count, np.float32)
        broadcast(comm, buf, 2)
        return bool((buf == np.arange(count, dtype=np.float32)).all())

    assert fake_world(4, body) == [True] * 4


def test_broadcast_argument_errors() -> None:
    comm = make_world(1)[0].comm()
    with pytest.raises(ValueError, match="root 1 is not a rank of a group of 1"):
        broadcast(comm, np.zeros(3), 1)
    with pytest.raises(ValueError, match="root -1"):
        tree_broadcast(comm, np.zeros(3), -1)
    with pytest.raises(ValueError, match="chunk_bytes must be positive"):
        chain_broadcast(comm, np.zeros(3), 0, chunk_bytes=0)
    with pytest.raises(ValueError, match="C-contiguous"):
        broadcast(comm, np.zeros(6)[::2], 0)


@pytest.mark.parametrize("n", range(1, 9))
def test_barrier_waits_for_the_last_arrival(fake_world: Any, n: int) -> None:
    lock = threading.Lock()
    arrivals: list[float] = []
    departures: list[float] = []

    def body(comm: Any) -> None:
        for _ in range(3):
            barrier(comm)  # repeated barriers must not confuse each other
        time.sleep(0.005 * comm.rank)
        with lock:
            arrivals.append(time.monotonic())
        barrier(comm)
        with lock:
            departures.append(time.monotonic())

    fake_world(n, body)
    assert min(departures) >= max(arrivals)
