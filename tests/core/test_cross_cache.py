"""The cross-host response cache's protocol (hora.core.engine.cross_cache): slots, host bits,
a leader's round counters, rank 0's decisions; and its order across the relay
(hora.core.engine.cross_host, cross_link) on a fake transport."""

from __future__ import annotations

from typing import Any

import pytest

from hora import config as config_mod
from hora.core.engine.cross_cache import (
    MSG_CACHE_BITS,
    MSG_CACHE_DECIDE,
    MSG_CACHE_MARK,
    CacheCoordinator,
    HostRounds,
    SlotTable,
    decode_bits,
    encode_bits,
    slots_of,
)
from hora.core.engine.cross_host import (
    MSG_RELAY_END,
    HostLayout,
    Relay,
    RelayGate,
    frame,
    unframe,
)
from hora.core.engine.cross_link import CrossCache
from hora.core.op.messages import MSG_RESPONSES, OpKind, Request, Response, decode, encode
from hora.errors import PeerLostError, ProtocolError


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


def test_host_rounds_under_reordered_marks() -> None:
    host = HostRounds([2, 3])
    host.mark(3, 1 << 4)  # rank 3: round 1 of slot 4
    assert host.delta() == 0
    assert host.laggards(4) == [2]
    host.mark(2, 1 << 4)  # rank 2: round 1
    assert host.delta() == 1 << 4  # told once ...
    assert host.delta() == 0  # ... and only once
    # rank 0 decided round 1; rank 3 already marked round 2 before rank 2's round-2 mark: with
    # bits the leader's clear at decision time could have erased it, counters keep it
    host.mark(3, 1 << 4)
    assert host.delta() == 0  # round 2 is not complete: rank 2 has not marked it
    host.mark(2, 1 << 4 | 1 << 7)
    assert host.delta() == 1 << 4  # round 2, once; slot 7 waits for rank 3
    host.drop([7])  # invalidated: forgotten
    host.mark(3, 1 << 7)
    assert host.delta() == 0  # a fresh round 1 of the dropped slot: rank 2 has not marked it
    with pytest.raises(ProtocolError):
        host.mark(1, 1)  # not a rank of this host


def test_host_rounds_two_rounds_behind() -> None:
    host = HostRounds([0, 1])
    for _ in range(2):  # (the engine cannot do this: a rank marks again only after a decision)
        host.mark(0, 1)
        host.mark(1, 1)
    assert host.delta() == 1  # one round per report: rank 0 decides one round at a time
    assert host.delta() == 1


def test_layout_leaders_and_links() -> None:
    layout = HostLayout(["a", "a", "a", "b", "b", "c"])
    assert layout.hosts == [[0, 1, 2], [3, 4], [5]]
    assert layout.leaders == [1, 3, 5]  # rank 0 hands its host to its neighbour
    assert layout.linked(0) == [] and layout.linked(1) == [2] and layout.linked(2) == [1]
    assert layout.linked(3) == [4] and layout.linked(5) == []
    alone = HostLayout(["a", "b", "b"])
    assert alone.leaders == [0, 1]
    assert HostLayout(["a", "a", "b"], per_rank=True).leaders == [0, 1, 2]


def test_relay_frames() -> None:
    assert unframe(b'{"t":"hb"}') is None
    assert unframe(frame([3, 4], True, b'{"t":"x"}')) == ([3, 4], True, b'{"t":"x"}')
    for bad in (b"\x00[1]", b"\x00nope\x00{}", b'\x00[["a"],true]\x00{}'):
        with pytest.raises(ProtocolError):
            unframe(bad)


class _Wire:
    """A fake transport: what each rank was sent, in order."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.sent: list[tuple[int, bytes]] = []

    def send_control(self, peer: int, payload: bytes) -> None:
        self.sent.append((peer, payload))

    def wake(self) -> None:
        pass


class _Runs:
    def __init__(self) -> None:
        self.ran: list[list[str]] = []
        self.send_ordered: Any = None

    def execute(self, responses: list[Response]) -> None:
        self.ran.append([n for r in responses for n in r.names])


def test_rank0_relays_one_message_per_host() -> None:
    layout = HostLayout(["a", "a", "a", "b", "b", "c"])
    wire = _Wire(0, 6)
    relay = Relay(wire, layout, departed={4})  # type: ignore[arg-type]
    relay.send_all(b"{}")
    relay.send([2, 3, 5], b"{1}")
    assert wire.sent == [(1, frame([2], True, b"{}")), (3, b"{}"), (5, b"{}"),
                         (1, frame([2], False, b"{1}")), (3, b"{1}"), (5, b"{1}")]
    wire.sent.clear()
    relay.end(0, b"END")
    relay.send_all(b"{}")  # host 0's relay ended: straight to its ranks
    assert wire.sent == [(1, frame([2], True, b"END")), (1, b"{}"), (2, b"{}"), (3, b"{}"),
                         (5, b"{}")]


def _resp4(name: str) -> Response:
    return Response(kind=OpKind.ALLREDUCE, names=[name], dtype="float32", shapes=[[4]])


def test_a_decision_cannot_overtake_a_response() -> None:
    """Rank 3 (host b = ranks 2, 3; leader 2). Rank 0 sends a response through the leader,
    ends the host's relay (the leader left) and sends a decision straight: the decision
    arrives first and is held until the relay's last frame; the ranks run the response first,
    as every other rank does."""
    layout = HostLayout(["a", "a", "b", "b"])
    wire, runs = _Wire(3, 4), _Runs()
    cache = CrossCache(wire, config_mod.load({}), runs, None, set(),  # type: ignore[arg-type]
                       layout)
    response = encode(MSG_RESPONSES, resps=[_resp4("x")])
    decision = encode(MSG_CACHE_DECIDE, groups=[[0]], inval=[])
    # the decision, sent later on the direct path, overtakes the relayed response
    assert cache.take(0, decision) == []  # held
    assert runs.ran == []
    left = cache.take(2, response)  # relayed: the engine runs it (slot 0 learned first)
    assert [k for _, k, _ in left] == [MSG_RESPONSES] and left[0][0] == 0
    assert cache.take(2, encode(MSG_RELAY_END)) == []  # the relay ends: the decision runs
    assert runs.ran == [["x"]]
    assert cache.lost(PeerLostError("gone", peer=2))  # the leader left: not a failure
    assert cache.take(0, encode("hb")) != []  # heartbeats are never held


def test_gate_holds_only_while_relayed() -> None:
    gate = RelayGate(True)
    assert gate.direct((0, "hb", {})) == [(0, "hb", {})]
    assert gate.direct((0, "resp", {"n": 1})) == []
    assert gate.direct((0, "cdec", {"n": 2})) == []
    assert gate.end() == [(0, "resp", {"n": 1}), (0, "cdec", {"n": 2})]
    assert gate.direct((0, "resp", {})) == [(0, "resp", {})]


def test_a_leader_forwards_before_it_runs_and_combines_its_hosts_marks() -> None:
    layout = HostLayout(["a", "a", "b", "b", "b"])  # host b: ranks 2, 3, 4; leader 2
    wire, runs = _Wire(2, 5), _Runs()
    cache = CrossCache(wire, config_mod.load({}), runs, None, set(),  # type: ignore[arg-type]
                       layout)
    response = encode(MSG_RESPONSES, resps=[_resp4("x")])
    left = cache.take(0, frame([3, 4], True, response))
    assert wire.sent == [(3, response), (4, response)]  # forwarded first
    assert [k for _, k, _ in left] == [MSG_RESPONSES]
    wire.sent.clear()
    assert cache.submit([_req("x")]) == []  # a hit: marked at home, nothing sent yet
    assert wire.sent == []
    cache.take(4, encode(MSG_CACHE_MARK, bits=encode_bits(1)))
    assert wire.sent == []
    cache.take(3, encode(MSG_CACHE_MARK, bits=encode_bits(1)))  # the host's round complete
    assert [(p, decode(m)[0]) for p, m in wire.sent] == [(0, MSG_CACHE_BITS)]
    decision = encode(MSG_CACHE_DECIDE, groups=[[0]], inval=[])
    cache.take(0, frame([3, 4], True, decision))
    assert runs.ran == [["x"]]


def test_gate_keeps_rank0s_loss_behind_its_relayed_messages() -> None:
    gate = RelayGate(True)
    assert gate.lost(PeerLostError("rank 0 gone", peer=0), leader=2)  # not yet a failure
    assert gate.direct((0, "shutdown", {})) == []
    assert gate.end() == [(0, "shutdown", {})]  # a clean shutdown: no error
    gate = RelayGate(True)
    gate.lost(PeerLostError("rank 0 gone", peer=0), leader=2)
    assert gate.end() == [(0, "abort", {"reason": "rank 0 gone"})]  # gone without a word
    gate = RelayGate(True)
    gate.lost(PeerLostError("rank 0 gone", peer=0), leader=2)
    with pytest.raises(PeerLostError, match="rank 0 gone"):
        gate.lost(PeerLostError("leader gone", peer=2), leader=2)  # rank 0 named, not 2
    assert not RelayGate(False).lost(PeerLostError("x", peer=0), leader=2)


def test_host_rounds_patience() -> None:
    host = HostRounds([2, 3])
    assert host.next_due(0.5) is None
    host.mark(2, 1 << 1, now=10.0)
    assert host.next_due(0.5) == 10.5
    assert host.waiting(0.5, now=10.2) == []
    assert host.waiting(0.5, now=10.6) == [1]  # marked by rank 2 only, for too long
    assert host.waiting(0.5, now=11.0) == []  # told once
    assert host.next_due(0.5) is None
    host.mark(3, 1 << 1, now=11.0)
    assert host.delta() == 1 << 1  # completed after all: a round, and no longer waiting
    host.mark(3, 1 << 1, now=12.0)
    assert host.waiting(0.5, now=13.0) == [1]  # the next round's own clock
