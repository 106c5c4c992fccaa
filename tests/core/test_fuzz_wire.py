"""Fuzzing the control plane: the message decoder and the coordinator's negotiation.

* :func:`hora.core.op.messages.decode` on arbitrary bytes, on mutated valid messages and on
  structurally valid JSON with wrong fields: it returns well-typed objects or raises
  :class:`ProtocolError`, nothing else, quickly, without allocating much more than its input.
* :class:`hora.core.engine.coordinator.Coordinator` fed random request sequences (random sizes,
  process sets, op kinds, per-rank field mutations, missing ranks, arrival orders, interleaved
  ``ready()`` calls): it never raises; every name all members submitted gets exactly one
  response, others none; mismatches (and only mismatches) give an ERROR whose text does not
  depend on the arrival order; fusion respects its threshold and keys.

Bugs this fuzzing found are kept as regression tests at the end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import tracemalloc
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hora.collectives.ops import to_dtype
from hora.config import Config
from hora.core.engine.coordinator import Coordinator
from hora.core.op.messages import (
    ERROR_SHUTDOWN,
    MSG_REQUESTS,
    MSG_RESPONSES,
    OpKind,
    ProtocolError,
    Request,
    Response,
    decode,
    encode,
)
from hora.core.op.process_set import Registry

FUZZ = settings(max_examples=300, deadline=2000,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---- well-typedness of what decode returns -------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _nested(v: Any, depth: int, leaf: Any) -> bool:
    if not isinstance(v, list):
        return False
    if depth == 1:
        return all(leaf(x) for x in v)
    return all(_nested(x, depth - 1, leaf) for x in v)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _str(v: Any) -> bool:
    return isinstance(v, str)


_REQUEST_TYPES: dict[str, Any] = {
    "name": _str, "kind": lambda v: isinstance(v, OpKind), "rank": _is_int, "set_id": _is_int,
    "dtype": _str, "shape": lambda v: _nested(v, 1, _is_int), "op": _is_int, "root": _is_int,
    "prescale": _num, "postscale": _num,
    "splits": lambda v: v is None or _nested(v, 1, _is_int), "device": _str,
    "ranks": lambda v: v is None or _nested(v, 1, _is_int), "group": _str,
}
_RESPONSE_TYPES: dict[str, Any] = {
    "kind": lambda v: isinstance(v, OpKind), "names": lambda v: _nested(v, 1, _str),
    "set_id": _is_int, "dtype": _str, "device": _str, "op": _is_int, "root": _is_int,
    "prescale": _num, "postscale": _num, "shapes": lambda v: _nested(v, 2, _is_int),
    "first_dims": lambda v: _nested(v, 2, _is_int), "splits": lambda v: _nested(v, 3, _is_int),
    "joined": lambda v: _nested(v, 1, _is_int), "error": _str, "value": _is_int,
    "ranks": lambda v: v is None or _nested(v, 1, _is_int), "group": _str,
}


def _bad_fields(obj: Request | Response) -> list[str]:
    table = _REQUEST_TYPES if isinstance(obj, Request) else _RESPONSE_TYPES
    return [f.name for f in dataclasses.fields(obj) if not table[f.name](getattr(obj, f.name))]


def _check_decoded(data: bytes) -> None:
    """decode(data) must return well-typed objects or raise ProtocolError; nothing else."""
    try:
        kind, body = decode(data)
    except ProtocolError:
        return
    assert isinstance(kind, str) and isinstance(body, dict)
    for key in ("reqs", "resps"):
        for obj in body.get(key, []):
            bad = _bad_fields(obj)
            assert not bad, (obj, bad)


# ---- decode: strategies --------------------------------------------------------------------------

_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                       st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
_json = st.recursive(_json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)
_kinds = st.sampled_from([k.value for k in OpKind] + ["NOPE", "", "allreduce"])
_int_lists = st.lists(st.integers(-3, 2**40), max_size=4)
_field_values: dict[str, Any] = {
    "name": st.one_of(st.text(max_size=8), _json), "kind": st.one_of(_kinds, _json),
    "rank": st.one_of(st.integers(-2, 8), _json), "shape": st.one_of(_int_lists, _json),
    "names": st.one_of(st.lists(st.text(max_size=4), max_size=3), _json),
    "shapes": st.one_of(st.lists(_int_lists, max_size=3), _json),
    "first_dims": st.one_of(st.lists(_int_lists, max_size=3), _json),
    "splits": st.one_of(_int_lists, st.lists(st.lists(_int_lists, max_size=2), max_size=2),
                        _json),
    "prescale": st.one_of(st.floats(allow_nan=True), st.integers(), _json),
}
_other_fields = sorted({f.name for f in dataclasses.fields(Request)}
                       | {f.name for f in dataclasses.fields(Response)} | {"bogus"})


@st.composite
def _objects(draw: st.DrawFn) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(_other_fields), max_size=8, unique=True)):
        obj[key] = draw(_field_values.get(key, _json))
    if draw(st.booleans()):
        obj["kind"] = draw(_kinds)
    return obj


@st.composite
def _messages(draw: st.DrawFn) -> bytes:
    body: dict[str, Any] = {}
    if draw(st.integers(0, 9)):
        body["t"] = draw(st.one_of(st.sampled_from([MSG_REQUESTS, MSG_RESPONSES, "abort"]),
                                   _json))
    for key in draw(st.lists(st.sampled_from(["reqs", "resps", "reason", "x"]), max_size=3)):
        body[key] = draw(st.one_of(st.lists(_objects(), max_size=3), _json))
    top: Any = body if draw(st.integers(0, 9)) else draw(_json)
    return json.dumps(top).encode()


def _valid_messages() -> list[bytes]:
    req = Request(name="allreduce.g", kind=OpKind.ALLGATHER, rank=2, shape=[3, 4],
                  splits=[1, 2], ranks=[0, 1])
    resp = Response(kind=OpKind.ALLTOALL, names=["a", "b"], shapes=[[1], [2, 3]],
                    first_dims=[[1, 2]], splits=[[[1, 0], [0, 1]]], joined=[1], error="e")
    return [encode(MSG_REQUESTS, reqs=[req, req]), encode(MSG_RESPONSES, resps=[resp]),
            encode("abort", reason="rank 1 failed"), encode("bye")]


# ---- decode: properties --------------------------------------------------------------------------

@FUZZ
@given(st.binary(max_size=512))
def test_decode_arbitrary_bytes(data: bytes) -> None:
    _check_decoded(data)


@FUZZ
@given(_messages())
def test_decode_structurally_valid_but_wrong_json(data: bytes) -> None:
    _check_decoded(data)


@FUZZ
@given(st.sampled_from(_valid_messages()), st.integers(0, 10_000), st.binary(min_size=1,
                                                                              max_size=6),
       st.booleans())
def test_decode_mutated_valid_messages(msg: bytes, pos: int, junk: bytes, insert: bool) -> None:
    at = pos % (len(msg) + 1)
    data = msg[:at] + junk + msg[at + (0 if insert else len(junk)):]
    _check_decoded(data)


def test_decode_round_trips_valid_messages() -> None:
    for msg in _valid_messages():
        kind, body = decode(msg)
        assert encode(kind, **body) == msg


@settings(max_examples=60, deadline=5000,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.one_of(_messages(), st.binary(max_size=2048)), st.integers(1, 64))
def test_decode_allocates_in_proportion_to_its_input(msg: bytes, repeat: int) -> None:
    """No length field or number in a message can make decode allocate much beyond the input."""
    data = msg * repeat if msg.startswith(b"[") else msg
    tracemalloc.start()
    try:
        try:
            decode(data)
        except ProtocolError:
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 64 * len(data) + 256 * 1024, (peak, len(data))


def test_decode_huge_numbers_and_long_inputs_are_fast_protocol_errors() -> None:
    cases = [
        b'{"t":"req","reqs":[{"kind":"ALLREDUCE","name":"a","rank":' + b"9" * 100_000 + b"}]}",
        b'{"t":"req","reqs":[{"kind":"ALLREDUCE","name":"a","rank":0,"shape":[1e999]}]}',
        b'{"t":"req","reqs":[' + b'{"kind":"ALLREDUCE"},' * 20_000 + b"1]}",
        b'{"t":"req","reqs":"' + b"x" * 1_000_000 + b'"}',
    ]
    for data in cases:
        with pytest.raises(ProtocolError):
            decode(data)


# ---- coordinator ---------------------------------------------------------------------------------

_DTYPES = ["float32", "float64", "int32", "uint8", "float16"]
_KINDS = [OpKind.ALLREDUCE, OpKind.ALLGATHER, OpKind.BROADCAST, OpKind.ALLTOALL,
          OpKind.REDUCESCATTER, OpKind.BARRIER]
_MUTATIONS = ["dtype", "shape", "dim0", "op", "prescale", "postscale", "root", "kind", "device"]


@dataclasses.dataclass
class _Op:
    name: str
    set_id: int
    members: list[int]
    requests: dict[int, Request]  # by member rank; a missing member never submits


def _expected_error(reqs: list[Request], members: list[int]) -> bool:
    """The coordinator's validation rules, restated independently."""
    first = reqs[0]

    def differ(get: Any) -> bool:
        return len({json.dumps(get(r)) for r in reqs}) > 1

    if differ(lambda r: r.kind.value) or differ(lambda r: r.dtype) or \
            differ(lambda r: r.device):
        return True
    kind = first.kind
    if kind in (OpKind.ALLREDUCE, OpKind.BROADCAST, OpKind.REDUCESCATTER) and \
            differ(lambda r: r.shape):
        return True
    if kind in (OpKind.ALLREDUCE, OpKind.REDUCESCATTER) and (
            differ(lambda r: r.op) or differ(lambda r: r.prescale)
            or differ(lambda r: r.postscale)):
        return True
    if kind is OpKind.BROADCAST and (differ(lambda r: r.root) or first.root not in members):
        return True
    if kind in (OpKind.ALLGATHER, OpKind.ALLTOALL, OpKind.REDUCESCATTER) and not first.shape:
        return True
    return kind in (OpKind.ALLGATHER, OpKind.ALLTOALL) and differ(lambda r: r.shape[1:])


@st.composite
def _scenarios(draw: st.DrawFn) -> tuple[Registry, dict[int, list[int]], list[_Op], int]:
    size = draw(st.integers(1, 5))
    registry = Registry(size)
    sets = {0: list(range(size))}
    if size > 1 and draw(st.booleans()):
        subset = sorted(draw(st.sets(st.integers(0, size - 1), min_size=1, max_size=size - 1)))
        sets[registry.register(subset)] = subset
    ops: list[_Op] = []
    for i in range(draw(st.integers(1, 8))):
        set_id = draw(st.sampled_from(sorted(sets)))
        members = sets[set_id]
        kind = draw(st.sampled_from(_KINDS))
        ndim = draw(st.integers(0 if kind is OpKind.ALLREDUCE else 1, 3))
        shape = draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim))
        if kind is OpKind.BARRIER:
            shape = []
        base = Request(name=f"op{i}", kind=kind, rank=members[0], set_id=set_id,
                       dtype=draw(st.sampled_from(_DTYPES)), shape=shape,
                       op=draw(st.sampled_from([0, 1, 3])) if kind in (
                           OpKind.ALLREDUCE, OpKind.REDUCESCATTER) else 1,
                       root=draw(st.sampled_from(members)) if kind is OpKind.BROADCAST else -1)
        requests: dict[int, Request] = {}
        for rank in members:
            req = dataclasses.replace(base, rank=rank, shape=list(base.shape))
            if draw(st.integers(0, 5)) == 0:
                req = _mutate(req, draw(st.sampled_from(_MUTATIONS)), members)
            if req.kind is OpKind.ALLTOALL and req.shape:
                req.splits = [req.shape[0]] + [0] * (len(members) - 1)
            if draw(st.integers(0, 7)) != 0:  # sometimes a member never submits
                requests[rank] = req
        ops.append(_Op(base.name, set_id, members, requests))
    threshold = draw(st.sampled_from([0, 16, 64, 1024, 128 * 1024 * 1024]))
    return registry, sets, ops, threshold


def _mutate(req: Request, what: str, members: list[int]) -> Request:
    if what == "dtype":
        return dataclasses.replace(req, dtype="int64" if req.dtype != "int64" else "float32")
    if what == "shape":
        return dataclasses.replace(req, shape=req.shape + [2])
    if what == "dim0" and req.shape:
        return dataclasses.replace(req, shape=[req.shape[0] + 1] + req.shape[1:])
    if what == "op":
        return dataclasses.replace(req, op=req.op + 1)
    if what == "prescale":
        return dataclasses.replace(req, prescale=2.0)
    if what == "postscale":
        return dataclasses.replace(req, postscale=0.5)
    if what == "root":
        return dataclasses.replace(req, root=req.root + 1)  # may leave the set
    if what == "kind":
        return dataclasses.replace(req, kind=OpKind.ALLREDUCE if req.kind is not OpKind.ALLREDUCE
                                   else OpKind.BROADCAST, root=members[0])
    if what == "device":
        return dataclasses.replace(req, device="gpu:0")
    return req


def _run(registry: Registry, ops: list[_Op], order: list[tuple[int, int]],
         ready_after: set[int], threshold: int, cycle_ms: float = 0.0) -> list[Response]:
    coord = Coordinator(registry, Config().replace(fusion_threshold=threshold,
                                                   cycle_time=cycle_ms))
    out: list[Response] = []
    for i, (op_index, rank) in enumerate(order):
        coord.add([ops[op_index].requests[rank]])
        if i in ready_after:
            out += coord.ready()  # with a cycle time, may hold responses back
    out += coord.ready(now=math.inf)
    assert coord.ready(now=math.inf) == []
    return out


@FUZZ
@given(_scenarios(), st.data())
def test_coordinator_random_request_sequences(scenario: Any, data: st.DataObject) -> None:
    registry, sets, ops, threshold = scenario
    arrivals = [(i, rank) for i, op in enumerate(ops) for rank in op.requests]
    order = data.draw(st.permutations(arrivals))
    ready_after = data.draw(st.sets(st.integers(0, max(0, len(order) - 1))))
    cycle_ms = data.draw(st.sampled_from([0.0, 0.0, 5.0]))
    responses = _run(registry, ops, order, ready_after, threshold, cycle_ms)

    by_name: dict[str, list[Response]] = {}
    for resp in responses:
        for name in resp.names:
            by_name.setdefault(name, []).append(resp)
    for op in ops:
        complete = set(op.requests) == set(op.members)
        got = by_name.get(op.name, [])
        if not complete:
            assert got == [], (op, got)
            continue
        assert len(got) == 1, (op, got)
        (resp,) = got
        reqs = [op.requests[r] for r in op.members]
        if _expected_error(reqs, op.members):
            assert resp.kind is OpKind.ERROR and resp.error, (reqs, resp)
            # The same requests arriving in the opposite order give the same text.
            again = _run(registry, [op], [(0, r) for r in reversed(op.members)], set(), threshold)
            assert [r.error for r in again] == [resp.error]
        else:
            assert resp.kind is reqs[0].kind, (reqs, resp)
            assert resp.set_id == op.set_id and resp.dtype == reqs[0].dtype
            at = resp.names.index(op.name)
            assert resp.shapes[at] == reqs[0].shape
            if resp.kind is OpKind.ALLGATHER:
                assert resp.first_dims == [[r.shape[0] for r in reqs]]
            if resp.kind is OpKind.ALLTOALL:
                assert resp.splits == [[r.splits for r in reqs]]
            if resp.kind is OpKind.BROADCAST:
                assert resp.root == reqs[0].root
    for resp in responses:
        if len(resp.names) > 1:  # fused: same key, within the threshold
            assert resp.kind is OpKind.ALLREDUCE and threshold > 0
            nbytes = sum(math.prod(s) for s in resp.shapes) * to_dtype(resp.dtype).itemsize
            assert nbytes <= threshold
            for name in resp.names:
                op = next(o for o in ops if o.name == name)
                first = op.requests[op.members[0]]
                assert (first.dtype, first.op, first.prescale, first.postscale, op.set_id) == (
                    resp.dtype, resp.op, resp.prescale, resp.postscale, resp.set_id)


@FUZZ
@given(_scenarios(), st.data())
def test_coordinator_departures_and_stalls(scenario: Any, data: st.DataObject) -> None:
    """A clean departure or a stall shutdown at a random point: every name still gets an
    answer, nothing that needs the departed rank succeeds unless it was complete before."""
    registry, sets, ops, threshold = scenario
    arrivals = [(i, rank) for i, op in enumerate(ops) for rank in op.requests]
    order = data.draw(st.permutations(arrivals))
    at = data.draw(st.integers(0, len(order)))
    event = data.draw(st.sampled_from(["depart", "stall"]))
    gone = data.draw(st.integers(0, len(sets[0]) - 1))
    coord = Coordinator(registry, Config().replace(
        fusion_threshold=threshold, stall_check_time_seconds=1.0,
        stall_shutdown_time_seconds=2.0))
    out: list[Response] = []
    complete_before: set[str] = set()
    seen: dict[str, set[int]] = {}
    for i, (op_index, rank) in enumerate(order + [(-1, -1)]):
        if i == at:
            complete_before = {o.name for o in ops if seen.get(o.name, set()) >= set(o.members)}
            if event == "depart":
                coord.depart(gone, "it called shutdown()")
            else:
                out += coord.check_stalls(now=time.monotonic() + 1e6)
        if op_index < 0:
            break
        req = ops[op_index].requests[rank]
        seen.setdefault(req.name, set()).add(rank)
        coord.add([req])
        if data.draw(st.booleans()):
            out += coord.ready()
    out += coord.ready(now=math.inf)
    by_name: dict[str, list[Response]] = {}
    for resp in out:
        for name in resp.names:
            by_name.setdefault(name, []).append(resp)
    for op in ops:
        got = by_name.get(op.name, [])
        if op.name in complete_before:
            assert len(got) == 1, (op, got)  # completed first: answered normally, once
            continue
        if event == "depart" and gone in op.members and op.name in seen:
            assert got and all(r.kind is OpKind.ERROR and r.value == ERROR_SHUTDOWN
                               for r in got), (op, got)
        if event == "stall" and seen.get(op.name) and at > 0 and any(
                order.index((ops.index(op), r)) < at for r in op.requests):
            # submitted by someone before the stall check and incomplete then: failed as stalled
            assert got and got[0].kind is OpKind.ERROR, (op, got)


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 4), st.data())
def test_coordinator_join_sequences_with_ready_between_batches(size: int,
                                                               data: st.DataObject) -> None:
    """Uneven data: each rank allreduces a prefix of the names, then joins (ready() between)."""
    names = [f"step{i}" for i in range(data.draw(st.integers(1, 5)))]
    steps = {r: data.draw(st.integers(0, len(names))) for r in range(size)}
    queue = [(r, n) for r in range(size) for n in names[:steps[r]]]
    queue += [(r, "join") for r in range(size)]
    order = [x for x in data.draw(st.permutations(queue))]
    # each rank's own submissions stay in its program order
    per_rank = {r: [x for x in queue if x[0] == r] for r in range(size)}
    order = [per_rank[r].pop(0) for r, _ in order]
    coord = Coordinator(Registry(size), Config())
    out: list[Response] = []
    for rank, name in order:
        kind = OpKind.JOIN if name == "join" else OpKind.ALLREDUCE
        coord.add([Request(name=name, kind=kind, rank=rank, dtype="float32", shape=[2])])
        out += coord.ready()  # every request in its own batch
    names_out = [n for r in out for n in r.names]
    submitted = {n for r in range(size) for n in names[:steps[r]]}
    assert sorted(names_out) == sorted(submitted | {"join"})
    assert out[-1].kind is OpKind.JOIN and out[-1].value in range(size)
    for resp in out[:-1]:
        assert resp.kind is OpKind.ALLREDUCE
        for name in resp.names:
            expected = {r for r in range(size) if names.index(name) >= steps[r]}
            assert set(resp.joined) == expected, (resp, expected)


# ---- bugs found by this fuzzing (fixed; kept as regression tests) ---------------------------

@pytest.mark.parametrize("data", [b"[" * 100_000, b'{"t":"req","reqs":[' + b"[" * 5000 + b"]}"])
def test_decode_deep_nesting_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(data)


@pytest.mark.parametrize("data", [
    b'{"t":"req","reqs":[{"kind":"ALLREDUCE","name":"a","rank":0,"shape":null}]}',
    b'{"t":"resp","resps":[{"kind":"ALLREDUCE","names":null}]}',
    b'{"t":"resp","resps":[{"kind":"ALLGATHER","names":["a"],"first_dims":null}]}',
])
def test_decode_rejects_null_for_list_fields(data: bytes) -> None:
    _check_decoded(data)


def test_join_in_the_same_batch_as_a_pending_op() -> None:
    """Regression (found by this fuzzing, fixed): an op and its rank's JOIN in one batch."""
    coord = Coordinator(Registry(2), Config())
    coord.add([Request("join", OpKind.JOIN, 1)])
    assert coord.ready() == []
    coord.add([Request("x", OpKind.ALLREDUCE, 0, dtype="float32", shape=[2]),
               Request("join", OpKind.JOIN, 0)])
    out = coord.ready()
    assert [(r.kind, r.names) for r in out] == [(OpKind.ALLREDUCE, ["x"]),
                                                 (OpKind.JOIN, ["join"])]


@pytest.mark.parametrize("kind", [OpKind.ALLREDUCE, OpKind.BROADCAST])
def test_joined_ranks_survive_the_last_join(kind: OpKind) -> None:
    coord = Coordinator(Registry(2), Config())
    coord.add([Request("t", kind, 1, dtype="float32", shape=[2], root=1)])
    coord.add([Request("join", OpKind.JOIN, 0)])
    coord.add([Request("join", OpKind.JOIN, 1)])  # e.g. broadcast_async(t); join() on rank 1
    first, last = coord.ready()
    assert last.kind is OpKind.JOIN
    if kind is OpKind.ALLREDUCE:
        assert first.kind is OpKind.ALLREDUCE and first.joined == [0]
    else:
        assert first.kind is OpKind.ERROR and "not supported with Join" in first.error


@pytest.mark.parametrize("intruder", [1, 7, -1])
def test_request_from_a_non_member_never_makes_an_op_ready(intruder: int) -> None:
    registry = Registry(3)
    sid = registry.register([0, 2])
    coord = Coordinator(registry, Config())
    coord.add([Request("z", OpKind.BROADCAST, 0, set_id=sid, root=0)])
    coord.add([Request("z", OpKind.BROADCAST, intruder, set_id=sid, root=0)])
    assert all(r.kind is OpKind.ERROR for r in coord.ready())


def test_stall_check_leaves_complete_ops_to_ready() -> None:
    """Regression (found by this fuzzing, fixed): a complete op is not failed as stalled."""
    coord = Coordinator(Registry(2), Config(stall_check_time_seconds=1.0,
                                            stall_shutdown_time_seconds=2.0))
    coord.add([Request("y", OpKind.ALLREDUCE, 0)])
    coord.add([Request("y", OpKind.ALLREDUCE, 1)])
    assert coord.check_stalls(now=1e12) == []
    assert [r.kind for r in coord.ready()] == [OpKind.ALLREDUCE]
