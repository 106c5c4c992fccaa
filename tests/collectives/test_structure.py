"""Communication structure: who talks to whom, and how many times.

Correct results are not enough: a ring allreduce that secretly sends everything to rank 0 would
pass the value tests. A recording Comm wrapper proves each algorithm's message pattern.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from hora.collectives.allgather import allgather
from hora.collectives.alltoall import alltoall
from hora.collectives.barrier import barrier
from hora.collectives.broadcast import chain_broadcast, tree_broadcast
from hora.collectives.ops import ReduceOp
from hora.collectives.reducescatter import reducescatter
from hora.collectives.ring import ring_allreduce
from hora.collectives.small import small_allreduce
from hora.collectives.star import star_allreduce

from .helpers import RecordingComm

RANKS = range(2, 9)


def _record(fake_world: Any, n: int, fn: Any) -> list[RecordingComm]:
    def body(comm: Any) -> RecordingComm:
        rec = RecordingComm(comm)
        fn(rec)
        return rec

    return fake_world(n, body)


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("count_of", [lambda n: 1000, lambda n: 3 * n + 1, lambda n: n - 1])
def test_ring_allreduce_is_2n_minus_2_neighbour_steps(fake_world: Any, n: int,
                                                     count_of: Any) -> None:
    count = count_of(n)
    recs = _record(fake_world, n,
                   lambda c: ring_allreduce(c, np.ones(count, np.float32), ReduceOp.Sum))
    max_chunk_bytes = math.ceil(count / n) * 4
    for rank, rec in enumerate(recs):
        right, left = (rank + 1) % n, (rank - 1) % n
        assert rec.kinds_and_peers() == [("sendrecv", right, left)] * (2 * (n - 1)), rank
        assert all(c[3] <= max_chunk_bytes and c[4] <= max_chunk_bytes for c in rec.calls)
    # each phase moves the whole buffer exactly once around the ring
    sent = sum(c[3] for rec in recs for c in rec.calls)
    assert sent == 2 * (n - 1) * count * 4


@pytest.mark.parametrize("fn", [ring_allreduce, star_allreduce, small_allreduce])
def test_no_communication_for_one_rank_or_empty_buffers(fake_world: Any, fn: Any) -> None:
    assert _record(fake_world, 1, lambda c: fn(c, np.ones(5), ReduceOp.Sum))[0].calls == []
    for rec in _record(fake_world, 4, lambda c: fn(c, np.ones(0), ReduceOp.Sum)):
        assert rec.calls == []


@pytest.mark.parametrize("n", RANKS)
def test_ring_allgather_is_n_minus_1_neighbour_steps(fake_world: Any, n: int) -> None:
    counts = [(r * 7) % 5 for r in range(n)] if n > 2 else [3, 0]

    def body(c: Any) -> None:
        allgather(c, np.ones(counts[c.rank], np.int16), counts, np.empty(sum(counts), np.int16))

    for rank, rec in enumerate(_record(fake_world, n, body)):
        assert rec.kinds_and_peers() == [("sendrecv", (rank + 1) % n, (rank - 1) % n)] * (n - 1)


@pytest.mark.parametrize("n", RANKS)
def test_ring_reducescatter_is_n_minus_1_neighbour_steps(fake_world: Any, n: int) -> None:
    counts = [r % 3 + 1 for r in range(n)]

    def body(c: Any) -> None:
        reducescatter(c, np.ones(sum(counts), np.float64), counts, ReduceOp.Sum,
                      np.empty(counts[c.rank], np.float64))

    for rank, rec in enumerate(_record(fake_world, n, body)):
        assert rec.kinds_and_peers() == [("sendrecv", (rank + 1) % n, (rank - 1) % n)] * (n - 1)


@pytest.mark.parametrize("n", RANKS)
def test_star_non_roots_only_talk_to_rank_0(fake_world: Any, n: int) -> None:
    recs = _record(fake_world, n, lambda c: star_allreduce(c, np.ones(9, np.int32), ReduceOp.Sum))
    others = range(1, n)
    assert recs[0].kinds_and_peers() == ([("recv", p) for p in others] +
                                         [("send", p) for p in others])
    for rec in recs[1:]:
        assert rec.kinds_and_peers() == [("send", 0), ("recv", 0)]
    # the root's traffic grows with n: 2 (n - 1) whole buffers
    assert sum(c[2] for c in recs[0].calls) == 2 * (n - 1) * 9 * 4


@pytest.mark.parametrize("n", RANKS)
def test_small_allreduce_is_recursive_doubling(fake_world: Any, n: int) -> None:
    recs = _record(fake_world, n, lambda c: small_allreduce(c, np.ones(6, np.float32),
                                                            ReduceOp.Sum))
    pof2 = 1 << (n.bit_length() - 1)
    extra = n - pof2
    rounds = pof2.bit_length() - 1
    for rank, rec in enumerate(recs):
        calls = rec.kinds_and_peers()
        if rank < 2 * extra and rank % 2 == 1:  # folded out: hand data over, get result back
            assert calls == [("send", rank - 1), ("recv", rank - 1)]
            continue
        exchanges = [c for c in calls if c[0] == "sendrecv"]
        assert len(exchanges) == rounds
        assert all(c[1] == c[2] for c in exchanges)  # one partner per round
        if rank < 2 * extra:
            assert calls[0] == ("recv", rank + 1) and calls[-1] == ("send", rank + 1)
            assert len(calls) == rounds + 2
        else:
            assert len(calls) == rounds
    # every rank's message count is O(log n), never O(n)
    assert max(len(rec.calls) for rec in recs) <= rounds + 2


@pytest.mark.parametrize("n", RANKS)
def test_dissemination_barrier_rounds(fake_world: Any, n: int) -> None:
    for rank, rec in enumerate(_record(fake_world, n, barrier)):
        distances = [1 << k for k in range(math.ceil(math.log2(n)))]
        assert rec.kinds_and_peers() == [("sendrecv", (rank + d) % n, (rank - d) % n)
                                         for d in distances]


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("root_of", [lambda n: 0, lambda n: n - 1, lambda n: n // 2])
def test_tree_broadcast_sends_each_rank_one_copy(fake_world: Any, n: int, root_of: Any) -> None:
    root = root_of(n)
    recs = _record(fake_world, n, lambda c: tree_broadcast(c, np.ones(10, np.uint8), root))
    recvs = [[c for c in rec.calls if c[0] == "recv"] for rec in recs]
    sends = [[c for c in rec.calls if c[0] == "send"] for rec in recs]
    assert recvs[root] == []
    assert all(len(recvs[r]) == 1 for r in range(n) if r != root)
    assert sum(len(s) for s in sends) == n - 1
    assert len(sends[root]) == math.ceil(math.log2(n))  # not n - 1 copies from the root


@pytest.mark.parametrize("n", RANKS)
def test_chain_broadcast_only_uses_neighbours(fake_world: Any, n: int) -> None:
    root = n // 2
    recs = _record(fake_world, n, lambda c: chain_broadcast(c, np.ones(25, np.uint8), root,
                                                            chunk_bytes=8))
    chunks = 4
    for rank, rec in enumerate(recs):
        right, left = (rank + 1) % n, (rank - 1) % n
        for call in rec.kinds_and_peers():
            assert call in {("send", right), ("recv", left), ("sendrecv", right, left)}, call
        moved_in = sum(c[-1] for c in rec.calls if c[0] in ("recv", "sendrecv"))
        assert moved_in == (0 if rank == root else 25)
        if rank not in (root, (root - 1) % n):  # middle of the chain: pipelined forwarding
            assert [c[0] for c in rec.calls] == ["recv"] + ["sendrecv"] * (chunks - 1) + ["send"]


@pytest.mark.parametrize("n", RANKS)
def test_alltoall_pairwise_schedule(fake_world: Any, n: int) -> None:
    def body(c: Any) -> None:
        alltoall(c, np.ones(n, np.int32), [1] * n, np.empty(n, np.int32), [1] * n)

    for rank, rec in enumerate(_record(fake_world, n, body)):
        assert rec.kinds_and_peers() == [("sendrecv", (rank + k) % n, (rank - k) % n)
                                         for k in range(1, n)]
