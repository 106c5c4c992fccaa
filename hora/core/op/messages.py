"""Control-plane messages between ranks and the coordinator, and their wire format.

A :class:`Request` says "this rank wants op X on tensor *name* with these properties"; the
coordinator answers with :class:`Response` objects that every member of the process set executes
in the same order. Messages travel as compact JSON: slower than a binary format by microseconds,
but safe to parse from the network (no code execution, every field type-checked by
:func:`decode`).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, fields
from typing import Any

from hora.errors import ProtocolError


class OpKind(str, enum.Enum):
    """What a request asks for (Horovod's request/response types)."""

    ALLREDUCE = "ALLREDUCE"
    ALLGATHER = "ALLGATHER"
    BROADCAST = "BROADCAST"
    ALLTOALL = "ALLTOALL"
    REDUCESCATTER = "REDUCESCATTER"
    BARRIER = "BARRIER"
    JOIN = "JOIN"
    ADD_PROCESS_SET = "ADD_PROCESS_SET"
    REMOVE_PROCESS_SET = "REMOVE_PROCESS_SET"
    ERROR = "ERROR"


@dataclass
class Request:
    """One rank's request for one named op."""

    name: str
    kind: OpKind
    rank: int
    set_id: int = 0
    dtype: str = "uint8"
    shape: list[int] = field(default_factory=list)
    op: int = 1
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: list[int] | None = None
    device: str = "cpu"
    ranks: list[int] | None = None  # ADD/REMOVE_PROCESS_SET
    group: str = ""  # the grouped op this request is a member of ("": none)


@dataclass
class Response:
    """What every member of a process set executes next.

    ``names`` has several entries when tensors are fused. Per-name details: ``shapes`` (the
    agreed shape, or rank 0's for allgather/alltoall), ``first_dims`` (allgather: each rank's
    first dimension), ``splits`` (alltoall: row ``r`` = rows rank ``r`` sends to each rank).
    ``joined`` are ranks that called ``join`` and contribute zeros.
    """

    kind: OpKind
    names: list[str]
    set_id: int = 0
    dtype: str = "uint8"
    device: str = "cpu"  # the device kind every rank agreed on
    op: int = 1
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    shapes: list[list[int]] = field(default_factory=list)
    first_dims: list[list[int]] = field(default_factory=list)
    splits: list[list[list[int]]] = field(default_factory=list)
    joined: list[int] = field(default_factory=list)
    error: str = ""
    value: int = -1  # JOIN: last joined rank; ADD_PROCESS_SET: new id; REMOVE: removed id
    ranks: list[int] | None = None
    # HORA_DISABLE_GROUP_FUSION: the group this op fuses within (its grouped call, or, as in
    # Horovod where every op then forms a group, its own name); "" when the knob is off
    group: str = ""


ERROR_MISMATCH, ERROR_SHUTDOWN, ERROR_STALL, ERROR_DEADLOCK = 0, 1, 2, 3
"""Codes carried in an ERROR response's ``value``: which exception type the ranks raise."""

# Message types on the control plane.
MSG_REQUESTS = "req"   # worker -> coordinator: {"reqs": [...]}
MSG_RESPONSES = "resp"  # coordinator -> worker: {"resps": [...]}
MSG_BYE = "bye"        # worker -> coordinator: I am shutting down cleanly
MSG_ABORT = "abort"    # either way: the job is failing; {"reason": str}
MSG_SHUTDOWN = "shutdown"  # coordinator -> worker: rank 0 shut down
MSG_HEARTBEAT = "hb"   # either way: I am alive (sent when idle, every heartbeat_timeout / 4)
MSG_WAITS = "wait"     # worker -> coordinator: {"waits": [[blocked, set, name, lane], ...]}
MSG_LANE_OFF = "laneoff"  # coordinator -> worker: {"set": id}: close your fast-lane log
MSG_PARAMS = "params"  # coordinator -> worker: {"params": {...}}: autotuned tunables, apply now


_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in fields(cls)) for cls in (Request, Response)
}


def encode(kind: str, **payload: Any) -> bytes:
    """Serialize one control message."""
    body: dict[str, Any] = {"t": kind}
    for key, value in payload.items():
        if key == "reqs" or key == "resps":
            value = [_plain(v) for v in value]
        body[key] = value
    return json.dumps(body, separators=(",", ":")).encode()


def _plain(obj: Request | Response) -> dict[str, Any]:
    # Not dataclasses.asdict: it deep-copies every list, and this runs for every op.
    d = {name: getattr(obj, name) for name in _FIELDS[type(obj)]}
    d["kind"] = obj.kind.value
    return d


def decode(data: bytes) -> tuple[str, dict[str, Any]]:
    """Parse a control message into ``(type, payload)`` with requests/responses as objects.

    Raises:
        ProtocolError: anything malformed; the message says what.
    """
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ProtocolError(f"malformed control message ({exc})") from None
    if not isinstance(body, dict) or not isinstance(body.get("t"), str):
        raise ProtocolError("control message without a type")
    kind = body.pop("t")
    try:
        if "reqs" in body:
            body["reqs"] = [_build(Request, r) for r in _list(body["reqs"])]
        if "resps" in body:
            body["resps"] = [_build(Response, r) for r in _list(body["resps"])]
    except (TypeError, ValueError, KeyError) as exc:
        raise ProtocolError(f"malformed {kind!r} control message: {exc}") from None
    return kind, body


Wait = tuple[bool, int, str, bool]
"""(blocked, set id, op name, in the fast lane): a rank started or stopped waiting for an op."""


def parse_waits(body: dict[str, Any]) -> list[Wait]:
    """The wait reports of a :data:`MSG_WAITS` message, type-checked.

    Raises:
        ProtocolError: malformed.
    """
    out: list[Wait] = []
    try:
        for item in _list(body["waits"]):
            blocked, set_id, name, lane = _list(item)
            if not (isinstance(blocked, bool) and isinstance(set_id, int)
                    and not isinstance(set_id, bool) and isinstance(name, str)
                    and isinstance(lane, bool)):
                raise TypeError("bad field types")
            out.append((blocked, set_id, name, lane))
    except (TypeError, ValueError, KeyError) as exc:
        raise ProtocolError(f"malformed 'wait' control message: {exc}") from None
    return out


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError("expected a list")
    return value


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "name": str, "rank": int, "set_id": int, "dtype": str, "op": int, "root": int,
    "prescale": (int, float), "postscale": (int, float), "device": str, "group": str,
    "error": str, "value": int,
}


_REQ_LISTS = {"shape": 1, "splits": 1, "ranks": 1}
_RESP_LISTS = {"names": 1, "joined": 1, "ranks": 1, "shapes": 2, "first_dims": 2, "splits": 3}


_NULLABLE: dict[type, frozenset[str]] = {  # list fields that may be null
    Request: frozenset({"splits", "ranks"}), Response: frozenset({"ranks"}),
}


def _nested_ok(value: Any, depth: int, leaf: type) -> bool:
    if not isinstance(value, list):
        return False
    if depth == 1:
        return all(isinstance(v, leaf) and not isinstance(v, bool) for v in value)
    return all(_nested_ok(v, depth - 1, leaf) for v in value)


def _build(cls: type[Any], raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise TypeError(f"{cls.__name__} must be an object")
    raw = dict(raw)
    raw["kind"] = OpKind(raw["kind"])
    for key, value in raw.items():
        want = _FIELD_TYPES.get(key)
        if want is not None and (not isinstance(value, want) or isinstance(value, bool)):
            raise TypeError(f"field {key!r} has type {type(value).__name__}")
    nested = _REQ_LISTS if cls is Request else _RESP_LISTS
    for key, depth in nested.items():
        if key not in raw:
            continue
        value = raw[key]
        if value is None and key in _NULLABLE[cls]:
            continue
        if not _nested_ok(value, depth, str if key == "names" else int):
            raise TypeError(f"field {key!r} must be a list nested {depth} deep")
    return cls(**raw)
