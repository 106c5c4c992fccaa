"""The cross-host response cache's protocol (hora.core.engine.cross_cache): slots, host bits,
rank 0's decisions."""

from __future__ import annotations

import pytest

from hora.core.engine.cross_cache import (
    CacheCoordinator,
    HostBits,
    SlotTable,
    decode_bits,
    encode_bits,
    slots_of,
)
from hora.core.op.messages import OpKind, Request, Response
from hora.errors import ProtocolError


def _resp(name: str, shape: list[int] | None = None, **kw: object) -> Response:
    return Response(kind=OpKind.ALLREDUCE, names=[name], dtype="float32",
                    shapes=[shape or [4]], **kw)  # type: ignore[arg-type]


def _req(name: str, shape: list[int] | None = None, **kw: object) -> Request:
    return Request(name=name, kind=OpKind.ALLREDUCE, rank=0, dtype="float32",
                   shape=shape or [4], **kw)  # type: ignore[arg-type]


def test_slots_hits_and_misses() -> None:
    table = SlotTable()
    assert table.learn(_resp("a")) == 0
    assert table.learn(_resp("b")) == 1
    assert table.learn(_resp("a")) == 0  # known
    assert table.learn(_resp("allreduce.noname.3")) is None  # automatic names never recur
    fused = Response(kind=OpKind.ALLREDUCE, names=["x", "y"], dtype="float32",
                     shapes=[[2], [3]])
    assert table.learn(fused) == 2  # each name of a fused response: its own slot
    assert table.hit(_req("y", shape=[3])) == 3 and table.response(3).shapes == [[3]]
    assert table.learn(_resp("e", error="boom")) is None
    assert table.hit(_req("a")) == 0
    assert table.hit(_req("a", shape=[5])) is None  # a mismatch is a miss: negotiated
    assert table.hit(_req("a", op=2)) is None
    assert table.hit(_req("zzz")) is None
    resp = table.response(1)
    assert resp.names == ["b"] and resp.shapes == [[4]]
    resp.names.append("mutated")
    assert table.response(1).names == ["b"]  # a copy each time
    assert table.invalidate(0) == "a"
    assert table.hit(_req("a")) is None
    assert table.learn(_resp("a")) == 4  # learned again: a new slot


def test_capacity() -> None:
    table = SlotTable(capacity=2)
    assert [table.learn(_resp(n)) for n in "abc"] == [0, 1, None]
    table.invalidate(0)
    assert table.learn(_resp("c")) == 2  # room again; slot numbers are never reused


def test_bits_on_the_wire() -> None:
    assert decode_bits(encode_bits(0b1011)) == 0b1011
    assert slots_of(0b1011) == [0, 1, 3]
    for bad in ("", "xyz", 5, None, "f" * 100_000):
        with pytest.raises(ProtocolError):
            decode_bits(bad)


def test_host_bits_send_each_round_once() -> None:
    host = HostBits(3)
    host.mark(0, 2)
    host.mark(1, 2)
    assert host.delta() == 0  # not on every local rank yet
    host.mark(2, 2)
    host.mark(0, 5)
    assert host.delta() == 1 << 2
    assert host.delta() == 0  # told once
    host.decided([2])
    for local in range(3):  # the next round of the same slot
        host.mark(local, 2)
    assert host.delta() == 1 << 2


def test_rank0_decides_when_every_host_reported() -> None:
    cc = CacheCoordinator(3)
    cc.add(0, 0b110, now=0.0)
    cc.add(1, 0b010, now=1.0)
    assert cc.ready() == []
    assert cc.missing_hosts(1) == [2]
    assert cc.waiting(older_than=5.0, now=2.0) == []
    assert cc.waiting(older_than=5.0, now=6.0) == [1, 2]  # the stall inspector's cue
    cc.add(2, 0b011, now=3.0)
    assert cc.ready() == [1]
    assert cc.ready() == []  # decided once
    cc.invalidate([2])
    assert cc.waiting(older_than=0.0, now=9.0) == [0]
    cc.add(1, 0b1, now=9.0)
    assert cc.ready() == []
    assert cc.missing_hosts(0) == [0]
    cc.add(0, 0b1, now=9.0)
    assert cc.ready() == [0]
