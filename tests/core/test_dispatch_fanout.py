"""Rank 0's fan-out encodes each distinct response list once and sends the same bytes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hora.core.engine.dispatch import Responses
from hora.core.op import messages
from hora.core.op.messages import MSG_RESPONSES, OpKind, Response, decode
from hora.core.op.process_set import Registry


def responses_for(size: int, departed: set[int] | None = None) -> tuple[Responses, Registry]:
    reg = Registry(size)
    transport = SimpleNamespace(rank=0, size=size)
    liveness = SimpleNamespace(departed=departed or set())
    none: Any = None
    return Responses(transport, reg, none, none, none, liveness, none), reg  # type: ignore[arg-type]


def resp(name: str, set_id: int = 0, kind: OpKind = OpKind.ALLREDUCE) -> Response:
    return Response(kind=kind, names=[name], set_id=set_id, dtype="float32", shapes=[[4]])


def test_one_list_for_every_rank_is_encoded_once(monkeypatch: Any) -> None:
    calls = 0
    original = messages.encode

    def counting(*args: Any, **kw: Any) -> bytes:
        nonlocal calls
        calls += 1
        return original(*args, **kw)

    monkeypatch.setattr("hora.core.engine.dispatch.encode", counting)
    sender, _ = responses_for(64, departed={7})
    ((payload, peers),) = sender._payloads([resp("a"), resp("b")])
    assert calls == 1
    assert peers == [p for p in range(1, 64) if p != 7]
    kind, body = decode(payload)
    assert kind == MSG_RESPONSES and [r.names for r in body["resps"]] == [["a"], ["b"]]


def test_distinct_lists_per_process_set_and_registry_changes() -> None:
    sender, reg = responses_for(4)
    sid = reg.register([0, 1, 2])
    batch = [resp("all"), resp("sub", sid), resp("add", kind=OpKind.ADD_PROCESS_SET)]
    got = {tuple(peers): [r.names[0] for r in decode(payload)[1]["resps"]]
           for payload, peers in sender._payloads(batch)}
    assert got == {(1, 2): ["all", "sub", "add"], (3,): ["all", "add"]}
