"""The coordinator's deadlock detector, driven directly (no threads, explicit clock).

Ranks report the ops they have been blocked in (``waiting``); ``check_deadlocks(now)`` fails
them once no blocked rank can be released and the situation held for the deadlock time.
"""

from __future__ import annotations

import pytest

from hora.config import Config
from hora.core.engine.coordinator import Coordinator
from hora.core.op.handle import BLOCKED_AFTER_S
from hora.core.op.messages import (
    ERROR_DEADLOCK,
    OpKind,
    ProtocolError,
    Request,
    decode,
    encode,
    parse_waits,
)
from hora.core.op.naming import AutoNames
from hora.core.op.process_set import Registry

LIMIT = 1.0
SETTLE = LIMIT - BLOCKED_AFTER_S  # how long a stuck state must hold


def make(size: int = 3, **cfg: object) -> tuple[Coordinator, Registry]:
    reg = Registry(size)
    settings: dict[str, object] = {"deadlock_time_seconds": LIMIT, **cfg}
    return Coordinator(reg, Config().replace(**settings)), reg


def req(rank: int, name: str, kind: OpKind = OpKind.ALLREDUCE, set_id: int = 0) -> Request:
    return Request(name=name, kind=kind, rank=rank, set_id=set_id, dtype="float32", shape=[4])


def blocked_in(coord: Coordinator, *ops: tuple[int, str], lane: bool = False) -> None:
    """Each ``(rank, name)``: the rank submitted allreduce ``name`` and is blocked in it."""
    for rank, name in ops:
        coord.add([req(rank, name)])
        coord.deadlocks.waiting(rank, True, 0, name, lane)


def settle(coord: Coordinator, start: float = 100.0) -> tuple[list, list[int]]:
    """First check notes the suspicion; the second, after the settle time, decides."""
    first = coord.deadlocks.check(start)
    assert first == ([], [])
    return coord.deadlocks.check(start + SETTLE + 0.01)


def test_ranks_waiting_for_each_others_ops_deadlock_with_a_message_naming_both() -> None:
    coord, _ = make(2)
    coord.add([req(0, "reducescatter.noname.14", OpKind.REDUCESCATTER)])
    coord.add([req(1, "barrier.noname.14", OpKind.BARRIER)])
    coord.deadlocks.waiting(0, True, 0, "reducescatter.noname.14", False)
    coord.deadlocks.waiting(1, True, 0, "barrier.noname.14", False)
    failed, lanes = settle(coord)
    assert {r.names[0] for r in failed} == {"reducescatter.noname.14", "barrier.noname.14"}
    assert all(r.kind is OpKind.ERROR and r.value == ERROR_DEADLOCK for r in failed)
    msg = failed[0].error
    assert "rank 0 waits in reducescatter.noname.14, which rank 1 never submitted" in msg
    assert "rank 1 waits in barrier.noname.14, which rank 0 never submitted" in msg
    assert lanes == [0]  # the failed ops' set: its fast lane closes
    assert coord.pending_names() == []  # the failed ops are gone; the job can go on


def test_not_declared_before_the_deadlock_time() -> None:
    coord, _ = make(2)
    blocked_in(coord, (0, "a"), (1, "b"))
    assert coord.deadlocks.check(10.0) == ([], [])
    assert coord.deadlocks.check(10.0 + SETTLE / 2) == ([], [])
    failed, _ = coord.deadlocks.check(10.0 + SETTLE + 0.01)
    assert len(failed) == 2


def test_a_rank_that_is_not_blocked_may_still_submit_so_nothing_fails() -> None:
    coord, _ = make(3)
    blocked_in(coord, (0, "a"), (1, "a"))
    assert settle(coord) == ([], [])  # rank 2 is computing: it may submit 'a' yet


def test_a_released_rank_ends_the_suspicion() -> None:
    coord, _ = make(2)
    blocked_in(coord, (0, "a"), (1, "b"))
    assert coord.deadlocks.check(1.0) == ([], [])
    coord.deadlocks.waiting(1, False, 0, "b", False)  # its wait ended (e.g. a timeout it asked for)
    assert coord.deadlocks.check(1.0 + SETTLE + 0.01) == ([], [])
    coord.deadlocks.waiting(1, True, 0, "b", False)  # blocked again: the clock starts over
    assert coord.deadlocks.check(1.0 + SETTLE + 0.02) == ([], [])


def test_chain_through_a_process_set_is_followed() -> None:
    """Rank 2 waits on a set whose other member (1) waits on an op rank 2 never submits."""
    coord, reg = make(3)
    pair = reg.register([1, 2])
    blocked_in(coord, (0, "step"), (1, "step"))
    coord.add([req(2, "broadcast.noname.1", OpKind.BROADCAST, set_id=pair)])
    coord.deadlocks.waiting(2, True, pair, "broadcast.noname.1", False)
    failed, _ = settle(coord)
    msg = failed[0].error
    assert "rank 0 waits in step, which rank 2 never submitted" in msg
    assert "rank 2 waits in broadcast.noname.1 of process set 1, which rank 1 never " \
           "submitted" in msg


def test_join_wait_counts_ranks_that_never_joined() -> None:
    coord, _ = make(2)
    coord.add([req(0, "join", OpKind.JOIN)])
    coord.add([req(1, "x")])
    coord.deadlocks.waiting(0, True, 0, "join", False)
    coord.deadlocks.waiting(1, True, 0, "x", False)
    # rank 0 joined, so 'x' is complete (rank 0 contributes zeros): not a deadlock
    assert any(r.names == ["x"] for r in coord.ready())
    coord.deadlocks.waiting(1, False, 0, "x", False)
    assert settle(coord) == ([], [])  # rank 1 is free to call join


def test_join_deadlocks_when_the_others_wait_for_each_other() -> None:
    coord, reg = make(3)
    pair = reg.register([1, 2])
    coord.add([req(0, "join", OpKind.JOIN)])
    coord.add([req(1, "allgather.o.size", OpKind.ALLGATHER, set_id=pair)])
    coord.add([req(2, "barrier.noname.1", OpKind.BARRIER, set_id=pair)])
    coord.deadlocks.waiting(0, True, 0, "join", False)
    coord.deadlocks.waiting(1, True, pair, "allgather.o.size", False)
    coord.deadlocks.waiting(2, True, pair, "barrier.noname.1", False)
    failed, _ = settle(coord)
    assert "rank 0 waits in join, which ranks [1, 2] never joined" in failed[0].error
    assert ["join"] in [r.names for r in failed]


def test_an_op_in_a_fast_lane_closes_the_lane_before_anything_is_declared() -> None:
    coord, _ = make(2)
    coord.add([req(1, "barrier.noname.3", OpKind.BARRIER)])
    coord.deadlocks.waiting(0, True, 0, "allreduce.cached", True)  # invisible: in rank 0's lane
    coord.deadlocks.waiting(1, True, 0, "barrier.noname.3", False)
    assert coord.deadlocks.check(5.0) == ([], [])
    assert coord.deadlocks.check(5.0 + SETTLE + 0.01) == ([], [0])  # close set 0's lane
    coord.add([req(0, "allreduce.cached")])  # the lane handed the op over
    failed, _ = coord.deadlocks.check(5.0 + 2 * SETTLE + 0.02)
    assert "rank 0 waits in allreduce.cached, which rank 1 never submitted" in failed[0].error


def test_disabled_with_zero() -> None:
    coord, _ = make(2, deadlock_time_seconds=0.0)
    blocked_in(coord, (0, "a"), (1, "b"))
    assert coord.deadlocks.check(0.0) == ([], []) and coord.deadlocks.check(99.0) == ([], [])


def test_wait_reports_travel_and_are_type_checked() -> None:
    _, body = decode(encode("wait", waits=[(True, 0, "allreduce.x", False)]))
    assert parse_waits(body) == [(True, 0, "allreduce.x", False)]
    with pytest.raises(ProtocolError, match="malformed 'wait'"):
        parse_waits({"waits": [[1, 0, "x", False]]})
    with pytest.raises(ProtocolError, match="malformed 'wait'"):
        parse_waits({"waits": "x"})


def test_automatic_names_are_counted_per_kind_and_resynced_by_failures() -> None:
    names = AutoNames()
    assert names.name("allgather", None, 0) == "allgather.noname.1"
    assert names.name("allgather_object", None, 0) == "allgather_object.noname.1"
    assert names.name("allgather", "grads", 0) == "allgather.grads"
    assert names.base("grouped_allreduce", None, 3) == "noname.1"
    # another rank's allgather.noname.5 failed: this rank numbers its next one after it
    names.observe(0, "allgather.noname.5")
    assert names.name("allgather", None, 0) == "allgather.noname.6"
    names.observe(0, "grouped_allreduce.noname.4_2of3")
    names.observe(0, "allgather.noname.2")  # never backwards
    names.observe(0, "allreduce.named")  # named ops change nothing
    assert names.name("allgather", None, 0) == "allgather.noname.7"
    assert names.base("grouped_allreduce", None, 0) == "noname.5"
    assert names.name("allgather", None, 1) == "allgather.noname.1"  # per process set


def test_a_deadlocked_grouped_op_fails_as_a_whole() -> None:
    """The wait on a group reports its first pending member; every pending member fails, or
    the group would wait for the rest forever."""
    coord, _ = make(2)
    group = "grouped_allreduce.noname.1"  # hora.core.frontend.api names each member so
    members = [req(0, f"{group}_{i}of3") for i in (1, 2, 3)]
    for member in members:
        member.group = group
    coord.add(members)
    blocked_in(coord, (1, "allreduce.other"))
    coord.deadlocks.waiting(0, True, 0, "grouped_allreduce.noname.1_1of3", False)
    failed, _ = settle(coord)
    assert sorted(n for r in failed for n in r.names) == [
        "allreduce.other", "grouped_allreduce.noname.1_1of3", "grouped_allreduce.noname.1_2of3",
        "grouped_allreduce.noname.1_3of3"]
    assert coord.pending_names() == []


def test_a_wait_on_an_earlier_op_of_a_reused_name_is_not_a_deadlock() -> None:
    """Rank 2 still waits for its op "x" (it ran; the wait ends once its thread runs again)
    while ranks 0 and 1 already submitted the next "x": the pending "x" lacks rank 2 itself,
    so it is a later op, not the one rank 2 waits for."""
    coord, _ = make(3)
    coord.add([req(0, "x"), req(1, "x")])  # the next step's "x", rank 2 not there yet
    coord.deadlocks.waiting(2, True, 0, "x", False)
    assert settle(coord) == ([], [])
    assert coord.deadlocks.check(200.0) == ([], [])
