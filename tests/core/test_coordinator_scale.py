"""The coordinator's per-request cost does not grow with the set: arrivals are counted, the
member set is cached per registered tuple, the full check runs once per name; and the same
agreement rule holds on the incremental path (joins, duplicates, re-registered sets)."""

from __future__ import annotations

from typing import Any

from hora.config import Config
from hora.core.engine.coordinator import Coordinator
from hora.core.op.messages import OpKind, Request
from hora.core.op.process_set import Registry


class CountingRegistry(Registry):
    """Counts the O(N) copies (``ranks``) the coordinator asks for."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.copies = 0

    def ranks(self, set_id: int) -> list[int] | None:
        self.copies += 1
        return super().ranks(set_id)


def req(rank: int, name: str = "allreduce.x", set_id: int = 0, **kw: Any) -> Request:
    fields: dict[str, Any] = {"dtype": "float32", "shape": [4], "kind": OpKind.ALLREDUCE}
    fields.update(kw)
    return Request(name=name, rank=rank, set_id=set_id, **fields)


def test_add_copies_no_member_list_and_checks_membership_once_per_name() -> None:
    size = 512
    reg = CountingRegistry(size)
    coord = Coordinator(reg, Config())
    checks = 0
    original = coord._complete

    def counted(key: tuple[int, str]) -> bool:
        nonlocal checks
        done = original(key)
        checks += done
        return done

    coord._complete = counted  # type: ignore[method-assign]
    for cycle in range(3):
        for rank in range(size):
            coord.add([req(rank, name=f"t{cycle}")])
        assert reg.copies == 0  # add never copies the member list
        (resp,) = coord.ready()
        assert resp.names == [f"t{cycle}"] and resp.kind is OpKind.ALLREDUCE
        reg.copies = 0
    assert checks == 3  # complete exactly once per name


def test_duplicate_request_from_one_rank_counts_once() -> None:
    coord = Coordinator(Registry(3), Config())
    coord.add([req(0)])
    coord.add([req(0)])
    coord.add([req(1)])
    assert coord.ready() == []
    coord.add([req(2)])
    assert [r.names for r in coord.ready()] == [["allreduce.x"]]


def test_joined_ranks_count_with_submissions_and_reset_after_join() -> None:
    coord = Coordinator(Registry(4), Config())
    coord.add([req(3, name="join", kind=OpKind.JOIN)])
    coord.add([req(3, name="join", kind=OpKind.JOIN)])  # twice: still one joined rank
    for rank in (0, 1):
        coord.add([req(rank)])
    assert coord.ready() == []
    coord.add([req(2)])
    (resp,) = coord.ready()
    assert resp.joined == [3]
    assert coord.joined(0) == [3]
    for rank in (0, 1, 2):
        coord.add([req(rank, name="join", kind=OpKind.JOIN)])
    (join,) = coord.ready()
    assert join.kind is OpKind.JOIN and coord.joined(0) == []
    coord.add([req(0, name="after")])  # nobody is joined any more: waits for everyone
    assert coord.ready() == []


def test_process_set_members_and_non_members() -> None:
    reg = Registry(6)
    coord = Coordinator(reg, Config())
    sid = reg.register([1, 3, 5])
    coord.add([req(0, set_id=sid)])  # not a member: ignored
    coord.add([req(1, set_id=sid), req(3, set_id=sid)])
    assert coord.ready() == []
    coord.add([req(5, set_id=sid)])
    assert [r.set_id for r in coord.ready()] == [sid]


def test_set_re_registered_under_the_same_id_uses_its_new_members() -> None:
    reg = Registry(6)
    coord = Coordinator(reg, Config())
    sid = reg.register([0, 1])
    coord.add([req(0, set_id=sid)])
    reg.register([0, 1, 2], set_id=sid)  # (a fresh tuple: the cached set must not be reused)
    coord.add([req(1, set_id=sid)])
    assert coord.ready() == []
    coord.add([req(2, set_id=sid)])
    assert [r.set_id for r in coord.ready()] == [sid]


def test_departed_member_fails_new_ops_of_its_sets_only() -> None:
    reg = Registry(4)
    coord = Coordinator(reg, Config())
    sid = reg.register([0, 1])
    coord.depart(3, "finished")
    coord.add([req(0, set_id=sid), req(1, set_id=sid)])
    assert [r.kind for r in coord.ready()] == [OpKind.ALLREDUCE]
    coord.add([req(0, name="g")])
    (err,) = coord.ready()
    assert err.kind is OpKind.ERROR and "rank 3: finished" in err.error
