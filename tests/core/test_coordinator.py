"""Negotiation on the coordinator: readiness, validation messages, fusion, join, stalls."""

from __future__ import annotations

import logging

import pytest

from hora.config import Config
from hora.core.engine.coordinator import Coordinator
from hora.core.op.messages import OpKind, ProtocolError, Request, Response, decode, encode
from hora.core.op.process_set import Registry


def make(size: int = 3, **cfg: object) -> tuple[Coordinator, Registry]:
    reg = Registry(size)
    return Coordinator(reg, Config().replace(**cfg)), reg


def req(rank: int, name: str = "allreduce.x", kind: OpKind = OpKind.ALLREDUCE,
        **kw: object) -> Request:
    fields: dict[str, object] = {"dtype": "float32", "shape": [4]}
    fields.update(kw)
    return Request(name=name, kind=kind, rank=rank, **fields)  # type: ignore[arg-type]


def test_ready_only_when_every_rank_submitted() -> None:
    coord, _ = make(3)
    coord.add([req(0)])
    coord.add([req(2)])
    assert coord.ready() == []
    coord.add([req(1)])
    (resp,) = coord.ready()
    assert resp.kind is OpKind.ALLREDUCE and resp.names == ["allreduce.x"]
    assert coord.ready() == []


def test_shape_mismatch_names_tensor_ranks_and_values() -> None:
    coord, _ = make(3)
    coord.add([req(0, shape=[2, 3])])
    coord.add([req(1, shape=[2, 3])])
    coord.add([req(2, shape=[3, 3])])
    (resp,) = coord.ready()
    assert resp.kind is OpKind.ERROR
    assert "Mismatched ALLREDUCE tensor shapes" in resp.error
    assert "'allreduce.x'" in resp.error
    assert "ranks [0, 1] had [2, 3]" in resp.error and "ranks [2] had [3, 3]" in resp.error


@pytest.mark.parametrize("field,a,b,words", [
    ("dtype", "float32", "int32", "Mismatched data types"),
    ("op", 1, 3, "Mismatched reduction operation"),
    ("prescale", 1.0, 2.0, "Mismatched prescale and/or postscale factors"),
    ("postscale", 1.0, 0.5, "Mismatched prescale and/or postscale factors"),
])
def test_field_mismatches(field: str, a: object, b: object, words: str) -> None:
    coord, _ = make(2)
    coord.add([req(0, **{field: a})])
    coord.add([req(1, **{field: b})])
    (resp,) = coord.ready()
    assert resp.kind is OpKind.ERROR and words in resp.error and "HINT" in resp.error


def test_broadcast_root_mismatch() -> None:
    coord, _ = make(2)
    coord.add([req(0, "broadcast.w", OpKind.BROADCAST, root=0)])
    coord.add([req(1, "broadcast.w", OpKind.BROADCAST, root=1)])
    (resp,) = coord.ready()
    assert "Mismatched BROADCAST root ranks" in resp.error


def test_allgather_first_dim_may_differ_but_not_others() -> None:
    coord, _ = make(2)
    coord.add([req(0, "allgather.a", OpKind.ALLGATHER, shape=[2, 5])])
    coord.add([req(1, "allgather.a", OpKind.ALLGATHER, shape=[7, 5])])
    (resp,) = coord.ready()
    assert resp.kind is OpKind.ALLGATHER and resp.first_dims == [[2, 7]]
    coord.add([req(0, "allgather.b", OpKind.ALLGATHER, shape=[2, 5])])
    coord.add([req(1, "allgather.b", OpKind.ALLGATHER, shape=[2, 6])])
    (resp,) = coord.ready()
    assert resp.kind is OpKind.ERROR and "dimension 1" in resp.error


def test_operation_mismatch() -> None:
    coord, _ = make(2)
    coord.add([req(0, "t", OpKind.ALLREDUCE)])
    coord.add([req(1, "t", OpKind.BROADCAST, root=0)])
    (resp,) = coord.ready()
    assert "Mismatched operations" in resp.error


def test_fusion_respects_threshold_and_keys() -> None:
    coord, _ = make(2, fusion_threshold=40)
    for name in ("a", "b", "c"):  # 16 bytes each: a+b fuse (32), c starts a new buffer
        for r in (0, 1):
            coord.add([req(r, name)])
    for r in (0, 1):  # different dtype never fuses with float32
        coord.add([req(r, "d", dtype="float64")])
    out = coord.ready()
    assert [r.names for r in out] == [["a", "b"], ["c"], ["d"]]


def test_fusion_disabled_with_zero_threshold() -> None:
    coord, _ = make(2, fusion_threshold=0)
    for name in ("a", "b"):
        for r in (0, 1):
            coord.add([req(r, name)])
    assert [r.names for r in coord.ready()] == [["a"], ["b"]]


def test_join_makes_allreduce_ready_and_completes_after() -> None:
    coord, _ = make(2)
    coord.add([req(1, "join", OpKind.JOIN)])
    assert coord.ready() == []
    coord.add([req(0, "x")])
    (resp,) = coord.ready()
    assert resp.kind is OpKind.ALLREDUCE and resp.joined == [1]
    coord.add([req(0, "join", OpKind.JOIN)])
    (done,) = coord.ready()
    assert done.kind is OpKind.JOIN and done.value == 0


def test_broadcast_with_joined_rank_is_an_error() -> None:
    coord, _ = make(2)
    coord.add([req(1, "join", OpKind.JOIN)])
    coord.add([req(0, "b", OpKind.BROADCAST, root=0)])
    (resp,) = coord.ready()
    assert resp.kind is OpKind.ERROR and "Broadcast is not supported with Join" in resp.error


def test_process_set_membership() -> None:
    coord, reg = make(3)
    sid = reg.register([0, 2])
    coord.add([req(0, "s", set_id=sid)])
    assert coord.ready() == []
    coord.add([req(2, "s", set_id=sid)])
    (resp,) = coord.ready()
    assert resp.set_id == sid and resp.kind is OpKind.ALLREDUCE


def test_departed_rank_fails_waiting_and_new_ops() -> None:
    coord, _ = make(2)
    coord.add([req(0, "x")])
    coord.depart(1, "it called shutdown()")
    (resp,) = coord.ready()
    assert resp.kind is OpKind.ERROR and "rank 1 shut down" in resp.error
    coord.add([req(0, "y")])
    (resp,) = coord.ready()
    assert "already shut down" in resp.error


def test_stall_warning_names_missing_ranks(caplog: pytest.LogCaptureFixture) -> None:
    coord, _ = make(3, stall_check_time_seconds=1.0, stall_shutdown_time_seconds=0.0)
    coord.add([req(0, "allreduce.slow")])
    coord.add([req(2, "allreduce.slow")])
    with caplog.at_level(logging.WARNING, logger="hora"):
        assert coord.check_stalls(now=1e12) == []
    assert "1: [allreduce.slow]" in caplog.text and "Missing ranks" in caplog.text
    assert "they wait forever (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" in caplog.text


def test_stall_warning_says_when_the_job_will_fail(caplog: pytest.LogCaptureFixture) -> None:
    coord, _ = make(2, stall_check_time_seconds=1.0, stall_shutdown_time_seconds=600.0)
    coord.add([req(0, "allreduce.slow")])
    first = next(iter(coord._table.values())).first_seen  # noqa: SLF001
    with caplog.at_level(logging.WARNING, logger="hora"):
        assert coord.check_stalls(now=first + 61) == []
    assert ("they fail on every rank once waiting 600 s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, "
            "hora run --stall-check-shutdown-time-seconds)") in caplog.text


def test_stall_shutdown_fails_the_op() -> None:
    coord, _ = make(2, stall_check_time_seconds=1.0, stall_shutdown_time_seconds=2.0)
    coord.add([req(0, "allreduce.never")])
    (resp,) = coord.check_stalls(now=1e12)
    assert resp.kind is OpKind.ERROR and "never by ranks [1]" in resp.error


def test_wire_roundtrip_and_garbage() -> None:
    r = req(1, shape=[2, 3], splits=[1, 1])
    kind, body = decode(encode("req", reqs=[r]))
    assert kind == "req" and body["reqs"] == [r]
    resp = Response(kind=OpKind.ALLGATHER, names=["a"], first_dims=[[1, 2]])
    assert decode(encode("resp", resps=[resp]))[1]["resps"] == [resp]
    for bad in (b"\xff", b"[]", b'{"t":"req","reqs":[{"kind":"NOPE"}]}',
                b'{"t":"req","reqs":[{"kind":"ALLREDUCE","name":3,"rank":0}]}'):
        with pytest.raises(ProtocolError):
            decode(bad)


def test_cycle_time_holds_ready_tensors_to_fuse_more() -> None:
    coord, _ = make(2, cycle_time=5.0)
    for r in (0, 1):
        coord.add([req(r, "a")])
    deadline = coord.next_deadline()
    assert deadline is not None
    assert coord.ready(now=deadline - 0.001) == []  # held
    for r in (0, 1):
        coord.add([req(r, "b")])
    (fused,) = coord.ready(now=deadline)
    assert fused.names == ["a", "b"]
    assert coord.next_deadline() is None


def test_readiness_is_tracked_incrementally_in_completion_order() -> None:
    coord, _ = make(2)
    coord.add([req(0, "first"), req(0, "second")])
    coord.add([req(1, "second")])
    coord.add([req(1, "first")])
    assert [r.names for r in coord.ready()] == [["second", "first"]]


def test_stall_names_a_process_set_mismatch(caplog: pytest.LogCaptureFixture) -> None:
    coord, reg = make(3, stall_check_time_seconds=1.0, stall_shutdown_time_seconds=0.0)
    sid = reg.register([1, 2])
    coord.add([req(0, "allreduce.g"), req(1, "allreduce.g")])  # global set
    coord.add([req(2, "allreduce.g", set_id=sid)])  # rank 2 used the other set
    with caplog.at_level(logging.WARNING, logger="hora"):
        coord.check_stalls(now=1e12)
    assert f"Mismatched process set: ranks [2] submitted it to process set {sid}" in caplog.text
    coord2, reg2 = make(3, stall_check_time_seconds=1.0, stall_shutdown_time_seconds=2.0)
    sid2 = reg2.register([1, 2])
    coord2.add([req(0, "x"), req(1, "x"), req(2, "x", set_id=sid2)])
    (failed,) = [r for r in coord2.check_stalls(now=1e12) if r.names == ["x"] and r.set_id == 0]
    assert "Mismatched process set" in failed.error and "never by ranks [2]" in failed.error
