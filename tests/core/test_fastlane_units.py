"""Grouped calls and allgathers in the fast lane (hora.core.lane.fastlane), over a loopback world.

A grouped call's allreduces (or allgathers) are submitted together (``Engine.submit_group``) and
logged as one *unit*: the leader decides it whole, so a cached group runs as one fused allreduce
in the same order on every rank, or is split only where it exceeds the fusion limit. Allgathers
are cached too (their first dimension travels in a board word). These tests check the batching
(``describe()``), the results (exact), and that every failure a negotiated group would report
(mismatch, stall, deadlock, lost peer) is still reported on every rank.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import numpy as np
import pytest

import hora.core.lane.fastlane as fastlane
from hora.collectives.ops import check_dtype
from hora.core.lane.lane_cache import MAX_GATHER_BYTES
from hora.core.lane.lane_leader import SOLO_BYTES
from hora.core.op.entry import Entry
from hora.core.op.handle import GroupHandle, Handle
from hora.core.op.messages import OpKind, Request
from hora.errors import DeadlockError, HoraInternalError, HoraTimeoutError

from .conftest import SUM

pytestmark = pytest.mark.timeout(90)

WAIT = 20.0
"""Seconds any single handle may take (a hang fails the test, never blocks the suite)."""


def _unit(w: Any, rank: int, names: list[str], tensors: list[np.ndarray],
          kind: OpKind = OpKind.ALLREDUCE, group: str = "g", sync: bool = False,
          **kw: Any) -> GroupHandle:
    """Submit ``tensors`` under ``names`` on ``rank`` as one grouped call."""
    entries = []
    for name, tensor in zip(names, tensors):
        x = np.ascontiguousarray(tensor)
        if kind is OpKind.ALLREDUCE:
            kw.setdefault("op", SUM)
        req = Request(name=name, kind=kind, rank=rank, dtype=check_dtype(x.dtype),
                      shape=list(x.shape), group=group, **kw)
        out = np.empty_like(x) if kind is OpKind.ALLREDUCE else None
        entries.append(Entry(request=req, tensor=x, output=out, handle=Handle(name), sync=sync))
    w.engines[rank].submit_group(entries)
    return GroupHandle(group, [e.handle for e in entries])


def _stat(w: Any, key: str, ranks: list[int] | None = None) -> list[Any]:
    ranks = list(range(len(w.engines))) if ranks is None else ranks
    lanes = [w.engines[r].lane(0) for r in ranks]
    assert all(lane is not None for lane in lanes), lanes
    return [lane.describe()[key] for lane in lanes]


def _delta(before: list[int], after: list[int]) -> list[int]:
    return [a - b for a, b in zip(after, before)]


def _wait_all(handles: list[Handle]) -> list[Any]:
    """Wait for each handle on its own thread (so that every rank can be blocked at once, as
    in a real job); return each result or the exception it raised."""
    out: list[Any] = [None] * len(handles)

    def run(i: int) -> None:
        try:
            out[i] = handles[i].wait(WAIT)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(handles))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT + 10)
    assert not any(t.is_alive() for t in threads)
    return out


NAMES = [f"grouped_allreduce.g_{k + 1}of10" for k in range(10)]


def _grads(r: int, i: int) -> list[np.ndarray]:
    return [np.arange(k + 2, dtype=np.float32) * (r + 1) + 10 * i + k for k in range(10)]


# ---- grouped allreduce ------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3])
def test_cached_group_runs_as_one_fused_lane_op_with_exact_results(world: Any, n: int) -> None:
    w = world(n)
    for i in range(12):
        before = (_stat(w, "batches"), _stat(w, "fast_ops")) if i >= 2 else None
        handles = [_unit(w, r, NAMES, _grads(r, i)) for r in range(n)]
        for h in handles:
            got = h.wait(WAIT)
            for k, g in enumerate(got):
                np.testing.assert_array_equal(g, sum(_grads(r, i)[k] for r in range(n)))
        if before is not None:  # the first round was negotiated (and taught the lane)
            assert _delta(before[0], _stat(w, "batches")) == [1] * n  # one collective
            assert _delta(before[1], _stat(w, "fast_ops")) == [10] * n
    assert _stat(w, "slots") == [10] * n and _stat(w, "off") == [False] * n


@pytest.mark.parametrize(("sizes", "prescale", "batches"), [
    ([3, SOLO_BYTES // 4, 5, 7], 1.0, 1),  # reduced over the arrays themselves: all fused
    ([3, SOLO_BYTES // 4, 5, 7], 2.0, 3),  # packed (a prescale): the 1 MiB one runs alone
    ([SOLO_BYTES // 16 + 1] * 4, 2.0, 1),  # over SOLO_BYTES together, each under it (float32)
])
def test_tensors_of_a_mebibyte_run_alone_where_fusing_packs(
        world: Any, sizes: list[int], prescale: float, batches: int) -> None:
    """An allreduce of >= SOLO_BYTES is not fused where the fused op would be packed into one
    buffer (alone it needs no packing); smaller ones still fuse even when together they exceed
    it. Where the fused op runs over the ops' own arrays (no prescale, shared memory), it
    fuses with the others."""
    w = world(2)
    names = [f"solo.{k}" for k in range(len(sizes))]

    def tensors(r: int, i: int) -> list[np.ndarray]:
        return [np.arange(size, dtype=np.float32) % 97 * (r + 1) + i for size in sizes]

    for i in range(3):
        before = _stat(w, "batches") if i else []  # the first round is negotiated
        got = _wait_all([_unit(w, r, names, tensors(r, i), prescale=prescale)
                         for r in range(2)])
        for result in got:
            for k, g in enumerate(result):
                np.testing.assert_array_equal(g, (tensors(0, i)[k] + tensors(1, i)[k])
                                              * prescale)
        if i:
            assert _delta(before, _stat(w, "batches")) == [batches] * 2


def test_a_late_rank_does_not_split_the_group(world: Any) -> None:
    """Rank 0 already drives the lane (it waits) when rank 1 logs its unit: still one op."""
    w = world(2)
    _wait_all([_unit(w, r, NAMES, _grads(r, 0)) for r in range(2)])
    for i in range(1, 6):
        before = _stat(w, "batches")
        h0 = _unit(w, 0, NAMES, _grads(0, i), sync=True)
        waiter = threading.Thread(target=h0.wait, args=(WAIT,), daemon=True)
        waiter.start()
        time.sleep(0.05)
        h1 = _unit(w, 1, NAMES, _grads(1, i))
        for got in (h1.wait(WAIT), h0.wait(WAIT)):
            for k, g in enumerate(got):
                np.testing.assert_array_equal(g, _grads(0, i)[k] + _grads(1, i)[k])
        waiter.join(WAIT)
        assert _delta(before, _stat(w, "batches")) == [1, 1]


def test_consecutive_groups_and_single_ops_keep_their_order(world: Any) -> None:
    """Async groups and single ops, all in flight at once: every rank runs them in one order,
    each group whole (one batch may hold several units, never part of one)."""
    w = world(2)
    a = [f"A_{k}" for k in range(4)]
    b = [f"B_{k}" for k in range(3)]

    def submit(r: int, i: int) -> list[tuple[Handle, list[np.ndarray]]]:
        xa = [np.full(k + 1, float(r + i + k)) for k in range(4)]
        xb = [np.full(3, float(10 * r + i + k)) for k in range(3)]
        single = [np.full(2, float(r * i))]
        return [(_unit(w, r, a, xa), xa), (w.submit(r, "one", single[0], op=SUM), single),
                (_unit(w, r, b, xb), xb)]

    for i in range(8):
        before = _stat(w, "batches") if i else None
        mine = [submit(r, i) for r in range(2)]
        for r in range(2):
            for (h, xs), (_, other) in zip(mine[r], mine[1 - r]):
                got = h.wait(WAIT)
                got = got if isinstance(got, list) else [got]
                for g, x, y in zip(got, xs, other):
                    np.testing.assert_array_equal(g, x + y)
        if before is not None:
            assert all(1 <= d <= 3 for d in _delta(before, _stat(w, "batches")))
    assert _stat(w, "off") == [False, False]


def test_groups_submitted_in_different_orders_are_negotiated_whole(world: Any) -> None:
    """Rank 0 submits group A, op S, group B; rank 1 submits S, B, A (all async, as Horovod
    allows): the units disagree, so each rank hands them whole to the coordinator, which pairs
    them by name; the lane stays on and later rounds in one order take it again."""
    w = world(2)
    a, b = [f"A_{k}" for k in range(4)], [f"B_{k}" for k in range(2)]
    order = {0: ("A", "S", "B"), 1: ("S", "B", "A")}
    for i in range(6):
        handles: dict[tuple[int, str], Handle] = {}
        for r in range(2):
            for what in order[r] if i % 2 else order[0]:
                if what == "S":
                    handles[r, what] = w.submit(r, "S", np.full(3, float(r + i)), op=SUM)
                else:
                    names = a if what == "A" else b
                    handles[r, what] = _unit(w, r, names, [np.full(2, r + i + k, np.float64)
                                                           for k in range(len(names))])
        got = _wait_all(list(handles.values()))
        for (_r, what), result in zip(handles, got):
            if what == "S":
                np.testing.assert_array_equal(result, np.full(3, 2.0 * i + 1))
            else:
                for k, g in enumerate(result):
                    np.testing.assert_array_equal(g, np.full(2, 2.0 * (i + k) + 1))
    assert _stat(w, "off") == [False, False] and min(_stat(w, "fast_ops")) >= 14


@pytest.mark.parametrize("mixed", [False, True], ids=["one-dtype", "two-dtypes"])
def test_group_larger_than_the_fusion_limit_is_split_in_order(world: Any, mixed: bool) -> None:
    w = world(2, fusion_threshold=64)  # two 8-float32 tensors per fused op

    def xs(r: int, i: int) -> list[np.ndarray]:
        return [np.arange(8, dtype=np.float64 if mixed and k % 2 else np.float32) + 100 * r + i
                + k for k in range(10)]

    for i in range(6):
        before = _stat(w, "batches") if i else None
        got = _wait_all([_unit(w, r, NAMES, xs(r, i)) for r in range(2)])
        for result in got:
            for k, g in enumerate(result):
                np.testing.assert_array_equal(g, xs(0, i)[k] + xs(1, i)[k])
                assert g.dtype == xs(0, i)[k].dtype
        if before is not None:  # dtypes alternate: nothing fuses; else pairs of 64 bytes
            assert _delta(before, _stat(w, "batches")) == [10 if mixed else 5] * 2


def test_duplicate_name_in_a_group_submits_none_of_it(world: Any) -> None:
    w = world(2)
    with pytest.raises(ValueError, match="same name as another tensor.*'dup'"):
        _unit(w, 0, ["ok", "dup", "dup"], [np.ones(2)] * 3)
    got = _wait_all([_unit(w, r, ["ok", "dup"], [np.ones(2)] * 2) for r in range(2)])
    for result in got:  # "ok" was not left in flight by the refused call
        for g in result:
            np.testing.assert_array_equal(g, np.full(2, 2.0))


# ---- allgather in the lane --------------------------------------------------------------------
def test_cached_allgather_with_changing_first_dimensions(world: Any) -> None:
    w = world(3)
    for i in range(15):
        xs = [np.full(((r + i) % 3, 2, 3), 10 * r + i, np.int64) for r in range(3)]
        got = _wait_all([_unit(w, r, ["ag"], [xs[r]], OpKind.ALLGATHER) for r in range(3)])
        want = np.concatenate(xs)
        for result in got:
            assert result[0].shape == want.shape
            np.testing.assert_array_equal(result[0], want)
    assert min(_stat(w, "fast_ops")) >= 12 and _stat(w, "slots") == [1, 1, 1]


def test_allgather_too_large_for_the_lane_is_negotiated(world: Any) -> None:
    w = world(2)
    row = np.ones((1, 1024), np.float32)  # 4 KiB a row
    big = MAX_GATHER_BYTES // row.nbytes  # rows per rank: twice the lane's limit in all
    for i, rows in enumerate([1, 2, big, 3, big, 1]):
        before = _stat(w, "fast_ops") if i else None
        xs = [np.repeat(row, rows, axis=0) * (r + i) for r in range(2)]
        got = _wait_all([_unit(w, r, ["big"], [xs[r]], OpKind.ALLGATHER) for r in range(2)])
        for result in got:
            np.testing.assert_array_equal(result[0], np.concatenate(xs))
        if before is not None:
            assert _delta(before, _stat(w, "fast_ops")) == [0 if rows == big else 1] * 2
    assert _stat(w, "off") == [False, False]


def test_sparse_values_and_indices_run_as_one_unit(world: Any) -> None:
    w = world(2)
    names = ["allgather.emb.values", "allgather.emb.indices"]
    for i in range(8):
        before = (_stat(w, "batches"), _stat(w, "fast_ops")) if i else None
        parts = [[np.full((r + i % 2 + 1, 4), r + 0.5 * i, np.float32),
                  np.full((r + i % 2 + 1, 2), 7 * r + i, np.int64)] for r in range(2)]
        got = _wait_all([_unit(w, r, names, parts[r], OpKind.ALLGATHER, group="sparse")
                         for r in range(2)])
        for result in got:
            for k in range(2):
                np.testing.assert_array_equal(result[k], np.concatenate([p[k] for p in parts]))
        if before is not None:
            assert _delta(before[0], _stat(w, "batches")) == [2, 2]  # one allgather each
            assert _delta(before[1], _stat(w, "fast_ops")) == [2, 2]


def test_allgathers_too_far_ahead_are_negotiated(world: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A first dimension must not overwrite one a slow member has not read: past
    ARG_CAPACITY positions ahead of the slowest member, allgathers are misses."""
    monkeypatch.setattr(fastlane, "ARG_CAPACITY", 8)
    w = world(2)
    names = [f"t{k}" for k in range(30)]
    for name in names:  # cache every name
        _wait_all([_unit(w, r, [name], [np.ones((1, 2))], OpKind.ALLGATHER) for r in range(2)])
    before = _stat(w, "fast_ops")
    ahead = [_unit(w, 0, [name], [np.full((1, 2), float(k))], OpKind.ALLGATHER)
             for k, name in enumerate(names)]
    behind = [_unit(w, 1, [name], [np.full((2, 2), -1.0)], OpKind.ALLGATHER) for name in names]
    for k, (a, b) in enumerate(zip(ahead, behind)):
        want = np.concatenate([np.full((1, 2), float(k)), np.full((2, 2), -1.0)])
        np.testing.assert_array_equal(a.wait(WAIT)[0], want)
        np.testing.assert_array_equal(b.wait(WAIT)[0], want)
    assert 1 <= _delta(before, _stat(w, "fast_ops"))[0] < len(names)


# ---- failures ---------------------------------------------------------------------------------
def test_group_missing_a_member_on_one_rank_fails_every_rank(world: Any) -> None:
    """Rank 1 logs the cached group without its last member, then waits in another op: the
    lane hands the disagreeing unit to the coordinator, and the deadlock detector fails the
    member rank 1 never submitted and rank 1's op, on every rank, naming both."""
    w = world(2, stall_check_time_seconds=30.0)
    names = NAMES[:3]
    _wait_all([_unit(w, r, names, _grads(r, 0)[:3]) for r in range(2)])
    start = time.monotonic()
    h0 = _unit(w, 0, names, _grads(0, 1)[:3])
    h1 = _unit(w, 1, names[:2], _grads(1, 1)[:2])
    after = w.submit(1, "after", np.ones(1), op=SUM)  # rank 0 never submits it
    got = _wait_all([h0, h1, after])
    assert isinstance(got[1], list)  # the members rank 1 did submit ran (on every rank)
    for k in range(2):
        np.testing.assert_array_equal(got[1][k], _grads(0, 1)[k] + _grads(1, 1)[k])
    for error in (got[0], got[2]):
        assert isinstance(error, DeadlockError), repr(error)
        text = str(error)
        assert f"rank 0 waits in {names[2]}, which rank 1 never submitted" in text, text
        assert "rank 1 waits in after, which rank 0 never submitted" in text, text
    assert time.monotonic() - start < 10


def test_stalled_group_fails_with_the_stall_inspectors_error(world: Any) -> None:
    w = world(2, stall_check_time_seconds=1.0, stall_shutdown_time_seconds=2.0)
    _wait_all([_unit(w, r, NAMES, _grads(r, 0)) for r in range(2)])
    h = _unit(w, 0, NAMES, _grads(0, 1))  # cached; rank 1 never submits it (nor blocks)
    start = time.monotonic()
    with pytest.raises(HoraTimeoutError, match=re.escape(NAMES[0])) as info:
        h.wait(30)
    assert "never by ranks [1]" in str(info.value)
    assert time.monotonic() - start < 15
    assert _stat(w, "off", [0]) == [True]


def test_groups_blocked_on_each_other_in_the_lane_are_a_deadlock(world: Any) -> None:
    """Both ranks wait in the lane for different cached units: the coordinator closes the lane,
    then fails every member of each unit on every rank."""
    w = world(2)
    other = [f"other_{k}" for k in range(2)]
    _wait_all([_unit(w, r, NAMES, _grads(r, 0)) for r in range(2)])
    _wait_all([_unit(w, r, other, [np.ones(3)] * 2) for r in range(2)])
    start = time.monotonic()
    got = _wait_all([_unit(w, 0, NAMES, _grads(0, 1)), _unit(w, 1, other, [np.ones(3)] * 2)])
    for error in got:
        assert isinstance(error, DeadlockError), repr(error)
        assert "Deadlock: ranks [0, 1]" in str(error), str(error)
    assert time.monotonic() - start < 10
    # the job goes on: both names work again, in the lane or negotiated
    for result in _wait_all([_unit(w, r, NAMES, _grads(r, 2)) for r in range(2)]):
        np.testing.assert_array_equal(result[9], _grads(0, 2)[9] + _grads(1, 2)[9])


@pytest.mark.parametrize("kind", [OpKind.ALLREDUCE, OpKind.ALLGATHER])
def test_lost_peer_fails_a_group_pending_in_the_lane(world: Any, kind: OpKind) -> None:
    w = world(3)
    xs = [np.ones((2, 2))] * 10
    _wait_all([_unit(w, r, NAMES, xs, kind) for r in range(3)])
    hs = [_unit(w, r, NAMES, xs, kind) for r in (0, 1)]  # hits, logged; rank 2 never submits
    time.sleep(0.1)
    start = time.monotonic()
    w.transports[2].close()  # rank 2 "dies"
    for h in hs:
        assert _eventually_done(h), "group not failed"
        with pytest.raises(HoraInternalError, match="rank 2"):
            h.wait(0)
    assert time.monotonic() - start < 10


def _eventually_done(h: Handle, seconds: float = WAIT) -> bool:
    """Poll ``done()``: this thread never drives the lane (see test_fastlane.py)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not h.done():
        time.sleep(0.01)
    return h.done()


def test_automatic_names_are_not_cached(world: Any) -> None:
    """``<op>.noname.<n>`` never recurs (object collectives make one per call): caching it
    would only use up HOROVOD_CACHE_CAPACITY."""
    w = world(2, cache_capacity=4)
    for i in range(6):
        _wait_all([_unit(w, r, [f"allgather_object.noname.{i}.size"], [np.ones((1, 1))],
                         OpKind.ALLGATHER) for r in range(2)])
        _wait_all([w.submit(r, f"allreduce.noname.{i}", np.ones(2), op=SUM) for r in range(2)])
    assert _stat(w, "slots") == [0, 0]
    # names chosen by the caller are cached, even DistributedOptimizer's for unnamed parameters
    for name in ("named", "allreduce.allreduce.noname.0.1", "grouped_allreduce.allreduce."
                 "noname.0.0_1of2"):
        for _ in range(3):
            _wait_all([w.submit(r, name, np.ones(2), op=SUM) for r in range(2)])
    assert _stat(w, "slots") == [3, 3] and min(_stat(w, "fast_ops")) >= 3
