"""The eager slots of the response cache across hosts (hora.core.engine.eager): a rank's state
machine (rounds, data before the rank's own op, out-of-order arrival, dead rounds) and rank 0's
counters (dead rounds from counts, late ranks asked once per round)."""

from __future__ import annotations

import pytest

from hora.core.engine.eager import (
    EagerCounts,
    EagerRounds,
    check_pairs,
    is_data,
    pack,
    unpack,
)
from hora.errors import ProtocolError


def test_data_messages_on_the_wire() -> None:
    msg = pack(7, 3, b"abcd")
    assert is_data(msg) and not is_data(b'{"k": 1}') and not is_data(b"\x00frame")
    assert unpack(msg) == (7, 3, b"abcd", False)
    assert unpack(pack(7, 3, b"r", result=True)) == (7, 3, b"r", True)
    with pytest.raises(ProtocolError):
        unpack(b"\x01ab")
    assert check_pairs({"dead": [[1, 2]]}) == [(1, 2)]
    assert check_pairs({}) == []
    for bad in ([[1]], [["a", 1]], "x", [[1, 2, 3]]):
        with pytest.raises(ProtocolError):
            check_pairs({"dead": bad})


def test_a_round_completes_when_every_rank_committed_in_any_order() -> None:
    r = EagerRounds(rank=1, size=3)
    assert r.arrive(2, 5, 0, b"c") is None  # before this rank's own op: kept
    rnd, done = r.commit(5, "op0", b"b")
    assert rnd == 0 and done is None
    assert not r.can_commit(5)  # one round in flight per slot
    done = r.arrive(0, 5, 0, b"a")
    assert done is not None and done.op == "op0" and done.parts == [b"a", b"b", b"c"]
    # round 1: every peer's data first, out of order
    assert r.arrive(0, 5, 1, b"a1") is None
    assert r.arrive(2, 5, 1, b"c1") is None
    rnd, done = r.commit(5, "op1", b"b1")
    assert rnd == 1 and done is not None and done.parts == [b"a1", b"b1", b"c1"]
    assert r.committed[5] == 2 and not r.pending


def test_slots_are_independent_and_data_is_checked() -> None:
    r = EagerRounds(rank=0, size=2)
    r.commit(1, "x", b"x0")
    r.commit(2, "y", b"y0")
    assert r.arrive(1, 2, 0, b"y1") is not None  # slot 2 completes, slot 1 still waits
    assert 1 in r.pending
    with pytest.raises(ProtocolError):
        r.arrive(1, 2, 0, b"again")  # a round this rank completed
    r.arrive(1, 3, 0, b"z")
    with pytest.raises(ProtocolError):
        r.arrive(1, 3, 0, b"z")  # the same round twice from one rank


def test_dead_round_converts_only_the_ops_on_it() -> None:
    r = EagerRounds(rank=0, size=3)
    r.commit(4, "op0", b"a")  # pending on round 0
    converted, over = r.kill(4, 1)  # round 1 dead: round 0 goes on (every rank commits it)
    assert converted is None and not over and 4 in r.pending
    done = None
    for sender in (1, 2):
        done = r.arrive(sender, 4, 0, b"p")
    assert done is not None and r.over(4)  # nothing left: the slot is dropped
    assert not r.can_commit(4)
    assert r.arrive(1, 4, 1, b"late") is None  # data for the dead round: discarded

    r.commit(6, "op1", b"a")
    converted, over = r.kill(6, 0)  # the round it is pending on is dead
    assert converted is not None and converted.op == "op1" and over


def test_a_rank_behind_the_dead_round_still_commits_the_rounds_before_it() -> None:
    r = EagerRounds(rank=2, size=3)
    assert r.arrive(0, 9, 0, b"a") is None  # ranks 0 and 1 committed round 0 already ...
    converted, over = r.kill(9, 1)  # ... and rank 1 declared round 1 dead
    assert converted is None and not over
    assert r.can_commit(9)  # round 0 must still be committed here, eagerly
    r.arrive(1, 9, 0, b"b")
    rnd, done = r.commit(9, "op", b"c")
    assert rnd == 0 and done is not None and r.over(9)


def test_dead_round_is_the_least_declared_and_drops_early_data() -> None:
    r = EagerRounds(rank=0, size=2)
    r.arrive(1, 3, 0, b"x")
    r.kill(3, 2)
    r.kill(3, 0)
    r.kill(3, 5)  # never raised again
    assert r.dead[3] == 0 and r.over(3)
    assert not r.can_commit(3)


def test_rank0_counts_give_each_declarer_its_dead_round() -> None:
    c = EagerCounts(3)
    c.add(0, "grad")
    c.add(1, "other")
    for rank in range(3):
        c.commit(rank, 0, 0, now=0.0)
    c.commit(0, 0, 1, now=1.0)  # round 1 open: ranks 1, 2 late
    assert c.late(0) == (1, [1, 2])
    assert c.declare(0, 1) == 1  # rank 1 misses on its round 1
    assert c.declare(0, 0) is None  # rank 0 is past it: not lower
    assert c.late(0) is None  # the open round is dead
    assert c.declare_all(2) == [(1, 0)]  # a join: rank 2 committed nothing of slot 1
    assert c.declare(5, 0) is None  # unknown slot


def test_rank0_asks_about_an_open_round_once() -> None:
    c = EagerCounts(2)
    c.add(0, "s")
    c.commit(0, 0, 0, now=0.0)
    assert c.waiting(1.0, now=0.5) == []
    assert c.waiting(1.0, now=1.5) == [0]
    assert c.ask(0) == (0, [1])
    assert c.waiting(1.0, now=9.0) == []  # asked: no longer due
    c.commit(1, 0, 0, now=10.0)  # it had committed after all: the round completes
    c.commit(0, 0, 1, now=11.0)  # the next round has its own clock and its own question
    assert c.waiting(1.0, now=11.5) == [] and c.waiting(1.0, now=12.5) == [0]
    assert c.ask(0) == (1, [1]) and c.ask(0) is None
    assert c.next_due(1.0) is None


def test_rank0_round_clock_restarts_when_the_open_round_moves() -> None:
    c = EagerCounts(3)
    c.add(0, "s")
    c.commit(0, 0, 0, now=0.0)
    c.commit(1, 0, 0, now=0.1)
    c.commit(2, 0, 0, now=5.0)  # round 0 done; ...
    c.commit(0, 0, 1, now=5.0)  # ... round 1 opened at 5.0, not 0.0
    assert c.waiting(1.0, now=5.5) == []
    assert c.next_due(1.0) == 6.0


def test_a_rank_completes_with_rank0s_result_and_drops_dead_ones() -> None:
    r = EagerRounds(rank=2, size=3)
    rnd, done = r.commit(1, "op", b"mine")
    assert rnd == 0 and done is None
    done = r.result(1, 0, b"sum")
    assert done is not None and done.parts == [b"sum"] and done.op == "op"
    with pytest.raises(ProtocolError):
        r.result(1, 0, b"again")  # not waiting for it
    r.commit(1, "op2", b"mine")
    converted, over = r.kill(1, 1)
    assert converted is not None and over
    assert r.result(1, 1, b"late") is None  # a dead round's result: discarded
