"""The fast lane (hora.core.lane.fastlane) end to end, over an in-process loopback world.

Every world here has all its ranks on one host, so each process set gets a shared-memory route
and a fast lane: after an allreduce name has been negotiated once, later allreduces of it with the
same dtype/shape/op/scales skip rank 0's coordinator. These tests check that the lane is really
taken (``describe()["fast_ops"]``), that its results are exactly the negotiated path's, and that
everything the lane cannot decide (disagreement, joins, stalls) falls back to the coordinator
with the coordinator's errors.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hora.core.op.messages import OpKind
from hora.errors import HoraInternalError, HoraTimeoutError, MismatchError

from .conftest import SUM, World

pytestmark = pytest.mark.timeout(90)

AVERAGE = 0
WAIT = 20.0
"""Seconds any single handle may take (a hang fails the test, never blocks the suite)."""


def _reduce_all(w: Any, name: str, inputs: list[np.ndarray], ranks: list[int] | None = None,
                **kw: Any) -> list[np.ndarray]:
    """Submit ``inputs[i]`` on ``ranks[i]`` (all ranks by default) and wait for every result."""
    ranks = list(range(len(inputs))) if ranks is None else ranks
    kw.setdefault("op", SUM)
    hs = [w.submit(r, name, x, **kw) for r, x in zip(ranks, inputs)]
    return [h.wait(WAIT) for h in hs]


def _lanes(w: Any, set_id: int = 0, ranks: list[int] | None = None) -> list[Any]:
    ranks = list(range(len(w.engines))) if ranks is None else ranks
    lanes = [w.engines[r].lane(set_id) for r in ranks]
    assert all(lane is not None for lane in lanes), lanes
    return lanes


def _stat(w: Any, key: str, set_id: int = 0, ranks: list[int] | None = None) -> list[Any]:
    return [lane.describe()[key] for lane in _lanes(w, set_id, ranks)]


def _eventually(cond: Callable[[], bool], seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


# ---- 1. steady state --------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("op", [SUM, AVERAGE], ids=["sum", "average"])
def test_steady_state_runs_in_the_lane_with_exact_results(world: Any, n: int, op: int) -> None:
    w = world(n)
    shape = (3, 5)
    for i in range(40):
        inputs = [np.arange(15, dtype=np.float64).reshape(shape) * (r + 1) + 100 * i + r
                  for r in range(n)]
        total = np.sum(inputs, axis=0)
        for got in _reduce_all(w, "grad", inputs, op=op):
            assert got.shape == shape and got.dtype == np.float64
            if op == SUM:
                np.testing.assert_array_equal(got, total)
            else:
                np.testing.assert_allclose(got, total / n, rtol=1e-15, atol=0)
    for d in (lane.describe() for lane in _lanes(w)):
        # the first op was negotiated (it taught the lane); (nearly) all the others took the lane
        assert 35 <= d["fast_ops"] <= 39, d
        assert d["slots"] == 1 and d["off"] is False and d["set"] == 0, d
        assert d["logged"] == 40, d  # every allreduce is a log position (the first a miss)
        assert 1 <= d["batches"] <= d["fast_ops"], d
        assert 0 <= d["thread_ops"] <= d["fast_ops"], d


def test_describe_reports_every_documented_key(world: Any) -> None:
    w = world(2)
    assert w.engines[0].lane(0) is None  # no lane before the set's first allreduce
    _reduce_all(w, "k", [np.ones(2), np.ones(2)])
    for lane in _lanes(w):
        assert set(lane.describe()) == {"set", "slots", "logged", "fast_ops", "thread_ops",
                                        "batches", "off"}


def test_integer_sum_and_in_place_outputs_through_the_lane(world: Any) -> None:
    w = world(2)
    for i in range(10):
        xs = [np.arange(6, dtype=np.int32) * (r + 1) + i for r in range(2)]
        hs = [w.submit(r, "inplace", x, op=SUM, inplace=True) for r, x in enumerate(xs)]
        for x, h in zip(xs, hs):
            got = h.wait(WAIT)
            assert got is x  # written into the caller's array
            np.testing.assert_array_equal(got, np.arange(6, dtype=np.int32) * 3 + 2 * i)
    assert min(_stat(w, "fast_ops")) >= 7


def test_scale_factors_are_part_of_the_cached_response(world: Any) -> None:
    w = world(2)
    for i in range(8):
        # alternate the prescale: each change is a miss, negotiated, and relearned
        pre = 2.0 if i % 2 else 3.0
        got = _reduce_all(w, "scaled", [np.full(4, 1.0 + r) for r in range(2)],
                          prescale=pre, postscale=0.5)
        for g in got:
            np.testing.assert_array_equal(g, np.full(4, 0.5 * pre * 3.0))
    for i in range(8):  # constant factors: hits
        got = _reduce_all(w, "scaled", [np.full(4, 1.0 + r + i) for r in range(2)],
                          prescale=2.0, postscale=0.5)
        for g in got:
            np.testing.assert_array_equal(g, np.full(4, 0.5 * 2.0 * (3.0 + 2 * i)))
    assert min(_stat(w, "fast_ops")) >= 5


# ---- 2. out-of-order submissions ---------------------------------------------------------------
@pytest.mark.parametrize("rounds", [1, 5])
def test_out_of_order_async_submissions_of_cached_names(world: Any, rounds: int) -> None:
    w = world(2)
    _reduce_all(w, "A", [np.full(3, 1.0), np.full(3, 2.0)])
    _reduce_all(w, "B", [np.full(5, 1.0), np.full(5, 2.0)])
    for i in range(rounds):
        a = [np.full(3, 10.0 * i + r) for r in range(2)]
        b = [np.full(5, 100.0 * i + 7 * r) for r in range(2)]
        ha0 = w.submit(0, "A", a[0], op=SUM)
        hb0 = w.submit(0, "B", b[0], op=SUM)
        hb1 = w.submit(1, "B", b[1], op=SUM)
        ha1 = w.submit(1, "A", a[1], op=SUM)
        for h in (ha0, ha1):
            np.testing.assert_array_equal(h.wait(WAIT), a[0] + a[1])
        for h in (hb0, hb1):
            np.testing.assert_array_equal(h.wait(WAIT), b[0] + b[1])
    # disagreement was handed to the coordinator, not a reason to turn the lane off
    assert _stat(w, "off") == [False, False]
    got = _reduce_all(w, "A", [np.full(3, 1.0), np.full(3, 2.0)])
    for g in got:
        np.testing.assert_array_equal(g, np.full(3, 3.0))


def test_out_of_order_waits_in_reverse_order(world: Any) -> None:
    """Each rank waits for its ops in a different order than it submitted them."""
    w = world(3)
    names = [f"r{k}" for k in range(6)]
    for k, name in enumerate(names):
        _reduce_all(w, name, [np.full(k + 1, float(r)) for r in range(3)])
    for i in range(4):
        hs: dict[tuple[int, str], Any] = {}
        for r in range(3):
            order = names if r == 0 else names[::-1] if r == 1 else names[1::2] + names[::2]
            for name in order:
                k = names.index(name)
                hs[r, name] = w.submit(r, name, np.full(k + 1, float(r + k + i)), op=SUM)
        for (_r, name), h in sorted(hs.items(), key=lambda kv: kv[0][1], reverse=True):
            k = names.index(name)
            np.testing.assert_array_equal(h.wait(WAIT), np.full(k + 1, float(3 * (k + i) + 3)))


# ---- 3. shape changes under a cached name ------------------------------------------------------
def test_consistent_shape_change_is_renegotiated_not_an_error(world: Any) -> None:
    """Horovod's cache: a changed shape is a miss; if every rank changed alike it just runs."""
    w = world(2)
    for _ in range(3):
        _reduce_all(w, "reshaped", [np.ones(4), np.ones(4)])
    for g in _reduce_all(w, "reshaped", [np.ones(6), np.full(6, 2.0)]):
        np.testing.assert_array_equal(g, np.full(6, 3.0))
    before = _stat(w, "fast_ops")
    for i in range(5):  # the new shape was relearned: hits again
        for g in _reduce_all(w, "reshaped", [np.full(6, float(i)), np.ones(6)]):
            np.testing.assert_array_equal(g, np.full(6, i + 1.0))
    after = _stat(w, "fast_ops")
    assert all(a - b >= 3 for a, b in zip(after, before)), (before, after)


def test_shape_flips_between_fused_batches_are_relearned(world: Any) -> None:
    """A name's shape changes back and forth (on every rank alike) between fused lane batches:
    every result must use the shape submitted, never a stale cached one."""
    w = world(2)
    for p in range(6):
        n = 4 if p % 2 == 0 else 7
        for i in range(4):
            hs = []
            for r in (1, 0):
                hs.append((n, w.submit(r, "flip", np.full(n, float(r + i + p)), op=SUM)))
                hs.append((3, w.submit(r, "fixed", np.full(3, float(10 * r + i)), op=SUM)))
            for size, h in hs:
                got = h.wait(WAIT)
                want = 2.0 * (i + p) + 1 if size == n else 10.0 + 2 * i
                assert got.shape == (size,)
                np.testing.assert_array_equal(got, np.full(size, want))
    assert min(_stat(w, "fast_ops")) >= 20
    assert _stat(w, "slots") == [2, 2]


def test_shape_change_on_every_rank_differently_fails_every_rank(world: Any) -> None:
    w = world(3)
    for _ in range(3):
        _reduce_all(w, "shape", [np.ones(4) for _ in range(3)])
    hs = [w.submit(r, "shape", np.ones(5 + r), op=SUM) for r in range(3)]
    texts = []
    for h in hs:
        with pytest.raises(MismatchError, match="Mismatched ALLREDUCE tensor shapes") as info:
            h.wait(WAIT)
        texts.append(str(info.value))
    assert len(set(texts)) == 1, texts
    assert "shape" in texts[0] and re.search(r"\[[567]\]", texts[0]), texts[0]
    # the name is usable again, with the old shape (a hit) and a new one alike
    for g in _reduce_all(w, "shape", [np.ones(4) for _ in range(3)]):
        np.testing.assert_array_equal(g, np.full(4, 3.0))


@pytest.mark.parametrize("changer", [0, 1])
def test_shape_change_on_one_rank_fails_both_with_the_same_text(world: Any,
                                                                changer: int) -> None:
    w = world(2)
    for _ in range(3):
        _reduce_all(w, "grad.w", [np.ones((2, 3)), np.ones((2, 3))])
    assert min(_stat(w, "fast_ops")) >= 1
    shapes = [(2, 3), (2, 3)]
    shapes[changer] = (4, 3)
    hs = [w.submit(r, "grad.w", np.ones(shapes[r]), op=SUM) for r in range(2)]
    texts = []
    for h in hs:
        with pytest.raises(MismatchError, match="Mismatched ALLREDUCE tensor shapes") as info:
            h.wait(WAIT)
        texts.append(str(info.value))
    assert texts[0] == texts[1], texts
    assert "[4, 3]" in texts[0] and "[2, 3]" in texts[0], texts[0]
    assert f"ranks [{changer}]" in texts[0], texts[0]
    # both ranks go on: the cached shape still works (and still takes the lane)
    before = _stat(w, "fast_ops")
    for i in range(4):
        for g in _reduce_all(w, "grad.w", [np.full((2, 3), float(i)), np.ones((2, 3))]):
            np.testing.assert_array_equal(g, np.full((2, 3), i + 1.0))
    assert all(a > b for a, b in zip(_stat(w, "fast_ops"), before))


def test_dtype_or_op_change_on_one_rank_is_a_mismatch(world: Any) -> None:
    w = world(2)
    for _ in range(2):
        _reduce_all(w, "typed", [np.ones(3, np.float32), np.ones(3, np.float32)])
    hs = [w.submit(0, "typed", np.ones(3, np.float32), op=SUM),
          w.submit(1, "typed", np.ones(3, np.float64), op=SUM)]
    for h in hs:
        with pytest.raises(MismatchError, match="Mismatched data types"):
            h.wait(WAIT)
    hs = [w.submit(0, "typed", np.ones(3, np.float32), op=SUM),
          w.submit(1, "typed", np.ones(3, np.float32), op=AVERAGE)]
    for h in hs:
        with pytest.raises(MismatchError, match="Mismatched reduction operation"):
            h.wait(WAIT)


@pytest.mark.parametrize("field,value,words", [
    ("device", "cuda", "CPU/GPU device selection"),
    ("dtype", "float32", "Mismatched data types"),
    ("shape", (4,), "tensor shapes"),
    ("op", AVERAGE, "Mismatched reduction operation"),
    ("prescale", 2.0, "Mismatched prescale"),
    ("postscale", 0.5, "Mismatched prescale"),
])
def test_any_field_mismatch_on_a_cached_name_fails_as_on_the_negotiated_path(
        world: Any, field: str, value: Any, words: str) -> None:
    """One rule decides agreement on both paths (hora.core.op.agreement): a cached name whose
    request differs on one rank in any field the coordinator checks (the device included) is
    negotiated and fails on every rank with the coordinator's text, the same text as for a
    name that was never cached."""
    w = world(2)

    def submit_pair(name: str) -> list[str]:
        kw: list[dict[str, Any]] = [{"op": SUM}, {"op": SUM}]
        tensors = [np.ones(3), np.ones(3)]
        if field == "dtype":
            tensors[1] = np.ones(3, np.float32)
        elif field == "shape":
            tensors[1] = np.ones(value)
        else:
            kw[1][field] = value
        hs = [w.submit(r, name, tensors[r], **kw[r]) for r in range(2)]
        texts = []
        for h in hs:
            with pytest.raises(MismatchError, match=words) as info:
                h.wait(WAIT)
            texts.append(str(info.value))
        assert texts[0] == texts[1], texts
        return texts

    for _ in range(3):
        _reduce_all(w, "cached", [np.ones(3), np.ones(3)])
    assert min(_stat(w, "fast_ops")) >= 1
    cached = submit_pair("cached")
    fresh = submit_pair("fresh")
    assert cached[0].replace("'cached'", "'fresh'") == fresh[0]
    for got in _reduce_all(w, "cached", [np.ones(3), np.ones(3)]):  # the job goes on
        np.testing.assert_array_equal(got, np.full(3, 2.0))


# ---- 4. fusion ---------------------------------------------------------------------------------
def test_cached_async_ops_are_fused_in_the_lane(world: Any) -> None:
    w = world(2)
    names = [f"layer{k}" for k in range(10)]

    def inputs(r: int, k: int, i: int) -> np.ndarray:
        return np.arange(k + 3, dtype=np.float32) * (r + 1) + 10 * k + i

    for k, name in enumerate(names):  # cache every name
        _reduce_all(w, name, [inputs(r, k, 0) for r in range(2)])
    fast0, batches0 = _stat(w, "fast_ops"), _stat(w, "batches")
    fused_rounds = 0
    rounds = 8
    for i in range(1, rounds + 1):
        b = _stat(w, "batches")
        hs = {}
        for r in (1, 0):  # every rank's ops are logged before anyone waits
            for k, name in enumerate(names):
                hs[r, k] = w.submit(r, name, inputs(r, k, i), op=SUM)
        for (_r, k), h in hs.items():
            np.testing.assert_array_equal(h.wait(WAIT), inputs(0, k, i) + inputs(1, k, i))
        if all(after - before < len(names) for after, before in zip(_stat(w, "batches"), b)):
            fused_rounds += 1
    fast = [a - b for a, b in zip(_stat(w, "fast_ops"), fast0)]
    batches = [a - b for a, b in zip(_stat(w, "batches"), batches0)]
    assert fast == [rounds * len(names)] * 2, fast  # every cached op took the lane
    assert all(b < f for b, f in zip(batches, fast)), (batches, fast)  # some were fused
    assert fused_rounds >= 1


def test_fusion_respects_the_threshold(world: Any) -> None:
    # each tensor is 400 bytes; a 1000-byte threshold fuses at most two of them
    w = world(2, fusion_threshold=1000)
    names = [f"big{k}" for k in range(6)]
    for name in names:
        _reduce_all(w, name, [np.ones(100, np.float32), np.ones(100, np.float32)])
    b0, f0 = _stat(w, "batches"), _stat(w, "fast_ops")
    for i in range(5):
        hs = [w.submit(r, name, np.full(100, float(r + i), np.float32), op=SUM)
              for r in (1, 0) for name in names]
        for h in hs:
            np.testing.assert_array_equal(h.wait(WAIT), np.full(100, 2.0 * i + 1, np.float32))
    batches = [a - b for a, b in zip(_stat(w, "batches"), b0)]
    fast = [a - b for a, b in zip(_stat(w, "fast_ops"), f0)]
    assert fast == [30, 30], fast
    assert all(b >= 15 for b in batches), batches  # never more than 2 x 400 bytes per batch


def test_different_dtypes_are_not_fused_together(world: Any) -> None:
    w = world(2)
    dtypes = [np.float32, np.float64, np.int32, np.int64]
    for k, dt in enumerate(dtypes):
        _reduce_all(w, f"d{k}", [np.ones(3, dt), np.ones(3, dt)])
    b0 = _stat(w, "batches")
    for i in range(3):
        hs = [(k, w.submit(r, f"d{k}", np.full(3, r + i, dt), op=SUM))
              for r in (1, 0) for k, dt in enumerate(dtypes)]
        for k, h in hs:
            got = h.wait(WAIT)
            assert got.dtype == dtypes[k]
            np.testing.assert_array_equal(got, np.full(3, 2 * i + 1, dtypes[k]))
    batches = [a - b for a, b in zip(_stat(w, "batches"), b0)]
    assert batches == [12, 12], batches  # one batch per op: no two dtypes fuse


# ---- 5. cache capacity ---------------------------------------------------------------------------
def test_cache_capacity_zero_means_no_lane(world: Any) -> None:
    w = world(2, cache_capacity=0)
    for i in range(10):
        for g in _reduce_all(w, "nocache", [np.full(3, float(i)), np.full(3, 1.0)]):
            np.testing.assert_array_equal(g, np.full(3, i + 1.0))
    assert w.engines[0].lane(0) is None and w.engines[1].lane(0) is None


def test_cache_capacity_bounds_the_slots(world: Any) -> None:
    w = world(2, cache_capacity=2)
    names = ["c0", "c1", "c2", "c3"]
    for i in range(6):
        for k, name in enumerate(names):
            for g in _reduce_all(w, name, [np.full(k + 1, float(i)), np.full(k + 1, float(k))]):
                np.testing.assert_array_equal(g, np.full(k + 1, float(i + k)))
    for d in (lane.describe() for lane in _lanes(w)):
        assert d["slots"] <= 2, d
        assert d["off"] is False, d
        # the two cached names hit from their second use on; the other two were negotiated
        assert d["fast_ops"] == 2 * 5, d


def test_timeline_disables_the_lane(world: Any, tmp_path: Any) -> None:
    w = world(2, timeline=str(tmp_path / "timeline.json"))
    for i in range(5):
        for g in _reduce_all(w, "tl", [np.full(2, float(i)), np.ones(2)]):
            np.testing.assert_array_equal(g, np.full(2, i + 1.0))
    assert w.engines[0].lane(0) is None and w.engines[1].lane(0) is None


# ---- 6. join -------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", [SUM, AVERAGE], ids=["sum", "average"])
def test_join_with_uneven_counts_turns_the_lane_off(world: Any, op: int) -> None:
    w = world(2)
    for _ in range(2):  # cache the name; the lane is on
        _reduce_all(w, "step", [np.ones(4), np.ones(4)], op=op)
    lanes = _lanes(w)
    assert min(lane.describe()["fast_ops"] for lane in lanes) >= 1

    def x(r: int, i: int) -> np.ndarray:
        return np.arange(4, dtype=np.float64) + 10 * i + r + 1

    def want(i: int, ranks: tuple[int, ...] = (0, 1)) -> np.ndarray:
        total = sum(x(r, i) for r in ranks)
        return total if op == SUM else total / 2  # Average keeps the set size as divisor

    for i in range(3):  # both ranks
        for g in _reduce_all(w, "step", [x(0, i), x(1, i)], op=op):
            np.testing.assert_array_equal(g, want(i))
    fast_before = [lane.describe()["fast_ops"] for lane in lanes]
    j1 = w.submit(1, "join", np.empty(0, np.uint8), OpKind.JOIN)
    for i in range(3, 5):  # rank 0 alone: the joined rank 1 contributes zeros
        np.testing.assert_array_equal(w.submit(0, "step", x(0, i), op=op).wait(WAIT),
                                      want(i, (0,)))
    assert not j1.done()
    # join closed rank 1's log: the lane is off on both ranks, rank 0's lone ops were negotiated
    assert _eventually(lambda: [lane.describe()["off"] for lane in lanes] == [True, True])
    assert [lane.describe()["fast_ops"] for lane in lanes] == fast_before
    j0 = w.submit(0, "join", np.empty(0, np.uint8), OpKind.JOIN)
    assert j0.wait(WAIT) == 0 and j1.wait(WAIT) == 0  # the last rank to join: 0
    assert all(lane.describe()["off"] for lane in lanes)  # a closed lane stays off
    # later allreduces are right (and, where the lane was reopened after everyone joined, the
    # cached name is still cached there)
    for i in range(5, 10):
        for g in _reduce_all(w, "step", [x(0, i), x(1, i)], op=op):
            np.testing.assert_array_equal(g, want(i))
    for r, old in enumerate(lanes):
        lane = w.engines[r].lane(0)
        if lane is old:
            assert old.describe()["off"] is True
        elif lane is not None:
            d = lane.describe()
            assert d["slots"] == 1 and d["off"] is False and d["fast_ops"] >= 3, d


def test_join_before_any_cached_op(world: Any) -> None:
    """A rank joins while the other's cached op is already logged in the lane."""
    w = world(2)
    _reduce_all(w, "early", [np.ones(2), np.ones(2)])
    h0 = w.submit(0, "early", np.full(2, 5.0), op=SUM)  # a hit, waiting for rank 1 in the lane
    j1 = w.submit(1, "join", np.empty(0, np.uint8), OpKind.JOIN)
    np.testing.assert_array_equal(h0.wait(WAIT), np.full(2, 5.0))
    j0 = w.submit(0, "join", np.empty(0, np.uint8), OpKind.JOIN)
    assert j0.wait(WAIT) == 0 and j1.wait(WAIT) == 0


# ---- 7. process sets -----------------------------------------------------------------------------
def _add_set(w: Any, ranks: list[int]) -> int:
    hs = [w.submit(r, f"add_process_set.{ranks}", np.empty(0, np.uint8),
                   OpKind.ADD_PROCESS_SET, ranks=ranks) for r in range(len(w.engines))]
    ids = {int(h.wait(WAIT)) for h in hs}
    assert len(ids) == 1, ids
    return ids.pop()


def test_process_set_gets_its_own_lane_beside_global_ops(world: Any) -> None:
    w = world(3)
    set_id = _add_set(w, [0, 1])
    assert set_id != 0
    for i in range(20):
        hs_set = [w.submit(r, "pair", np.full(3, float(r + i)), op=SUM, set_id=set_id)
                  for r in (0, 1)]
        hs_all = [w.submit(r, "all", np.full(2, float(10 * r + i)), op=SUM) for r in range(3)]
        for h in hs_set:
            np.testing.assert_array_equal(h.wait(WAIT), np.full(3, 2.0 * i + 1))
        for h in hs_all:
            np.testing.assert_array_equal(h.wait(WAIT), np.full(2, 30.0 + 3 * i))
    for d in (lane.describe() for lane in _lanes(w, set_id, [0, 1])):
        assert d["set"] == set_id and d["slots"] == 1, d
        assert 15 <= d["fast_ops"] <= 19, d
    assert w.engines[2].lane(set_id) is None  # not a member
    assert min(_stat(w, "fast_ops", 0)) >= 15  # the global set has its own lane too


def test_process_set_lane_average_uses_the_set_size(world: Any) -> None:
    w = world(3)
    set_id = _add_set(w, [1, 2])
    for i in range(10):
        hs = [w.submit(r, "pavg", np.full(2, float(2 * r + i)), op=AVERAGE, set_id=set_id)
              for r in (1, 2)]
        for h in hs:  # (2 + i + 4 + i) / 2
            np.testing.assert_array_equal(h.wait(WAIT), np.full(2, 3.0 + i))
    assert min(_stat(w, "fast_ops", set_id, [1, 2])) >= 7
    assert w.engines[0].lane(set_id) is None


def test_removing_a_process_set_stops_its_lane(world: Any) -> None:
    w = world(3)
    set_id = _add_set(w, [0, 1])
    for i in range(5):
        for g in _reduce_all(w, "rm", [np.full(2, float(i)), np.ones(2)], [0, 1],
                             set_id=set_id):
            np.testing.assert_array_equal(g, np.full(2, i + 1.0))
    assert min(_stat(w, "fast_ops", set_id, [0, 1])) >= 3
    hs = [w.submit(r, f"remove_process_set.{set_id}", np.empty(0, np.uint8),
                   OpKind.REMOVE_PROCESS_SET, root=set_id) for r in range(3)]
    for h in hs:
        h.wait(WAIT)
    assert all(e.lane(set_id) is None for e in w.engines)
    for g in _reduce_all(w, "after_rm", [np.ones(2)] * 3):
        np.testing.assert_array_equal(g, np.full(2, 3.0))


# ---- 8. stalls -----------------------------------------------------------------------------------
def test_stalled_cached_op_fails_with_the_stall_inspectors_error(world: Any) -> None:
    w = world(2, stall_check_time_seconds=1.0, stall_shutdown_time_seconds=2.0)
    name = "stalled.tensor_7"
    for _ in range(3):
        _reduce_all(w, name, [np.ones(3), np.ones(3)])
    assert min(_stat(w, "fast_ops")) >= 1
    start = time.monotonic()
    h = w.submit(0, name, np.ones(3), op=SUM)  # a hit; rank 1 never submits it
    with pytest.raises(HoraInternalError, match=re.escape(name)) as info:
        h.wait(30)
    elapsed = time.monotonic() - start
    assert elapsed < 10, elapsed
    # the coordinator's stall inspector failed it (not this wait's own timeout)
    assert "never by ranks [1]" in str(info.value), str(info.value)
    assert _stat(w, "off", ranks=[0]) == [True]


def test_late_rank_inside_the_stall_time_still_takes_the_lane(world: Any) -> None:
    w = world(2, stall_check_time_seconds=5.0)
    _reduce_all(w, "late", [np.ones(2), np.ones(2)])
    h0 = w.submit(0, "late", np.full(2, 2.0), op=SUM)
    time.sleep(0.5)  # rank 1 is slow, but well within the stall time
    h1 = w.submit(1, "late", np.full(2, 3.0), op=SUM)
    for h in (h0, h1):
        np.testing.assert_array_equal(h.wait(WAIT), np.full(2, 5.0))
    assert _stat(w, "fast_ops") == [1, 1] and _stat(w, "off") == [False, False]


def _wait_without_driving(h: Any, seconds: float = WAIT) -> Any:
    """Wait for a handle by polling ``done()``: this thread never runs (drives) the lane.

    (A thread driving the lane while the engine stops can see a raw ValueError: see
    test_engine_stop_while_a_thread_drives_the_lane_raises_a_hora_error.)
    """
    assert _eventually(h.done, seconds), f"{h.name} not done after {seconds} s"
    return h.wait(0)


@pytest.mark.parametrize("victim", [0, 2], ids=["leader", "member"])
def test_lost_peer_fails_ops_pending_in_the_lane(world: Any, victim: int) -> None:
    w = world(3)
    for _ in range(3):
        _reduce_all(w, "lost", [np.ones(2)] * 3)
    assert min(_stat(w, "fast_ops")) >= 1
    survivors = [r for r in range(3) if r != victim]
    hs = [w.submit(r, "lost", np.ones(2), op=SUM) for r in survivors]  # hits, logged
    time.sleep(0.1)
    start = time.monotonic()
    w.transports[victim].close()  # the victim "dies" without submitting
    for h in hs:
        with pytest.raises(HoraInternalError, match=f"rank {victim}"):
            _wait_without_driving(h)
    assert time.monotonic() - start < 10
    with pytest.raises(HoraInternalError):
        w.submit(survivors[0], "after", np.ones(1), op=SUM)


# ---- 9. mixed ops --------------------------------------------------------------------------------
def test_cached_allreduces_interleaved_with_other_collectives(world: Any) -> None:
    w = world(2)
    for i in range(20):
        hs_ar = [w.submit(r, "mix.ar", np.full(4, float(r + i)), op=SUM) for r in range(2)]
        hs_bc = [w.submit(r, "mix.bc", np.full(3, float(10 * r + i)), OpKind.BROADCAST, root=1)
                 for r in range(2)]
        hs_ag = [w.submit(r, "mix.ag", np.full((r + 1, 2), r + i, np.int64), OpKind.ALLGATHER)
                 for r in range(2)]
        hs_ar2 = [w.submit(r, "mix.ar2", np.full(2, float(i * r)), op=AVERAGE)
                  for r in (1, 0)]
        for h in hs_ar:
            np.testing.assert_array_equal(h.wait(WAIT), np.full(4, 2.0 * i + 1))
        for h in hs_bc:
            np.testing.assert_array_equal(h.wait(WAIT), np.full(3, 10.0 + i))
        want = np.concatenate([np.full((r + 1, 2), r + i, np.int64) for r in range(2)])
        for h in hs_ag:
            np.testing.assert_array_equal(h.wait(WAIT), want)
        for h in hs_ar2:
            np.testing.assert_array_equal(h.wait(WAIT), np.full(2, i / 2))
    for d in (lane.describe() for lane in _lanes(w)):
        assert d["slots"] == 3, d  # allreduces and allgathers are cached, broadcasts not
        assert d["logged"] == 60, d
        assert d["fast_ops"] >= 45, d


# ---- 10. random schedules ------------------------------------------------------------------------
_NAMES = ["h.a", "h.b", "h.c", "h.d"]
_SHAPES = {"h.a": (3,), "h.b": (2, 2), "h.c": (1,), "h.d": (5,)}


@st.composite
def _schedules(draw: Any) -> tuple[int, list[list[list[str]]]]:
    n = draw(st.integers(2, 3))
    rounds = []
    for _ in range(draw(st.integers(1, 6))):
        subset = draw(st.lists(st.sampled_from(_NAMES), min_size=1, max_size=4, unique=True))
        rounds.append([draw(st.permutations(subset)) for _ in range(n)])
    return n, rounds


@pytest.mark.timeout(300)
@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_schedules())
def test_random_schedules_of_cached_names(schedule: tuple[int, list[list[list[str]]]]) -> None:
    n, rounds = schedule
    w = World(n)
    try:
        for name in _NAMES:  # cache every name first
            for g in _reduce_all(w, name, [np.ones(_SHAPES[name]) for _ in range(n)]):
                np.testing.assert_array_equal(g, np.full(_SHAPES[name], float(n)))
        for i, orders in enumerate(rounds):
            hs: list[tuple[str, Any]] = []
            for r, order in enumerate(orders):
                for name in order:
                    x = np.full(_SHAPES[name], float(100 * i + 10 * r + _NAMES.index(name)))
                    hs.append((name, w.submit(r, name, x, op=SUM)))
            for name, h in hs:
                k = _NAMES.index(name)
                want = sum(100.0 * i + 10 * r + k for r in range(n))
                np.testing.assert_array_equal(h.wait(WAIT), np.full(_SHAPES[name], want))
        for d in (lane.describe() for lane in _lanes(w)):
            assert d["slots"] == len(_NAMES) and d["off"] is False, d
    finally:
        w.close()


# ---- regressions: bugs found while writing these tests -----------------------------------
def test_op_submitted_before_the_lane_opened_does_not_shift_the_logs(world: Any) -> None:
    w = world(2, stall_check_time_seconds=8.0)
    # rank 1 submits X and Z before any allreduce ran (rank 0 has submitted nothing): no lane
    hx1 = w.submit(1, "X", np.ones(2), op=SUM)
    hz1 = w.submit(1, "Z", np.ones(2), op=SUM)
    assert w.engines[1].lane(0) is None
    hx0 = w.submit(0, "X", np.ones(2), op=SUM)
    hx0.wait(WAIT)  # X ran on rank 0: its lane is open, so its Z is logged (a miss)
    assert w.engines[0].lane(0) is not None
    hz0 = w.submit(0, "Z", np.ones(2), op=SUM)
    for h in (hx1, hz0, hz1):
        np.testing.assert_array_equal(h.wait(WAIT), np.full(2, 2.0))
    start = time.monotonic()
    for i in range(5):  # X is cached everywhere: this must not wait for the stall time
        for g in _reduce_all(w, "X", [np.full(2, float(i)), np.ones(2)]):
            np.testing.assert_array_equal(g, np.full(2, i + 1.0))
    elapsed = time.monotonic() - start
    assert elapsed < 4, f"5 cached allreduces took {elapsed:.1f} s (stalled in the lane)"
    assert _stat(w, "off") == [False, False]


def test_engine_stop_while_a_thread_drives_the_lane_raises_a_hora_error(
        world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import hora.transports.shm as shm

    w = world(2)
    for _ in range(2):
        _reduce_all(w, "drv", [np.ones(2), np.ones(2)])
    lane = w.engines[1].lane(0)
    assert lane is not None
    real_wait = shm.futex_wait

    def slow_wait(address: int, expected: int, seconds: float) -> None:
        """The waiter is descheduled in its doorbell wait until the lane has been stopped
        (the race window of a real run, made deterministic)."""
        if threading.current_thread().name != "lane-waiter":
            real_wait(address, expected, seconds)
            return
        _eventually(lambda: lane._stop, 10.0)
        time.sleep(0.3)

    monkeypatch.setattr(shm, "futex_wait", slow_wait)
    h = w.submit(1, "drv", np.ones(2), op=SUM)  # a hit; rank 0 never submits it
    caught: list[BaseException] = []

    def waiter() -> None:
        try:
            h.wait(WAIT)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            caught.append(exc)

    t = threading.Thread(target=waiter, name="lane-waiter", daemon=True)
    t.start()
    time.sleep(0.3)  # the waiter is driving the lane (rank 0 has not submitted)
    w.engines[1].stop(timeout=5)  # e.g. shutdown() from another thread, or a lost peer
    t.join(15)
    assert not t.is_alive()
    assert len(caught) == 1
    assert isinstance(caught[0], HoraInternalError), repr(caught[0])
    assert "shut down" in str(caught[0])


def test_wait_timeout_on_a_negotiated_op_is_the_timeout_asked(world: Any) -> None:
    """The reference for the test below: an op outside the lane times out at ``timeout``."""
    w = world(2, cache_capacity=0)
    h = w.submit(0, "alone", np.ones(2), op=SUM)  # rank 1 never submits it
    start = time.monotonic()
    with pytest.raises(HoraTimeoutError, match="did not finish within 1.0 s"):
        h.wait(1.0)
    assert 0.9 <= time.monotonic() - start < 1.6


def test_wait_timeout_on_a_lane_op_is_the_timeout_asked(world: Any) -> None:
    w = world(2)
    for _ in range(2):
        _reduce_all(w, "alone", [np.ones(2), np.ones(2)])
    h = w.submit(0, "alone", np.ones(2), op=SUM)  # a hit; rank 1 has not submitted it yet
    assert h.runner is not None  # it is in the lane: wait() drives it
    start = time.monotonic()
    with pytest.raises(HoraTimeoutError, match="did not finish within 1.0 s"):
        h.wait(1.0)
    elapsed = time.monotonic() - start
    h1 = w.submit(1, "alone", np.ones(2), op=SUM)  # the op is still pending, and completes
    for hh in (h, h1):
        np.testing.assert_array_equal(hh.wait(WAIT), np.full(2, 2.0))
    assert 0.9 <= elapsed < 1.6, f"wait(1.0) raised after {elapsed:.2f} s"


def test_rank_that_joined_before_the_lane_opened_is_not_waited_for(world: Any) -> None:
    # Rank 1 joins before any allreduce ran (it has no lane yet, so it logs nothing); rank 0's
    # first allreduce opens the lanes; rank 0's join must not wait for rank 1's log (it used to
    # wait for the stall time, 60 s by default, inside submit).
    w = world(2)
    j1 = w.submit(1, "join", np.empty(0, np.uint8), OpKind.JOIN)
    h = w.submit(0, "late", np.ones(3, np.float32), op=SUM)
    np.testing.assert_array_equal(h.wait(WAIT), np.ones(3, np.float32))
    start = time.monotonic()
    j0 = w.submit(0, "join", np.empty(0, np.uint8), OpKind.JOIN)
    assert j0.wait(WAIT) == 0 and j1.wait(WAIT) == 0
    assert time.monotonic() - start < 10, "join waited for a rank that had already joined"
    for _ in range(3):  # the reopened lane works
        got = _reduce_all(w, "after", [np.ones(2), np.ones(2)])
        for g in got:
            np.testing.assert_array_equal(g, np.full(2, 2.0))


def test_full_log_turns_the_lane_off_and_every_op_still_completes(world: Any) -> None:
    from hora.core.lane.fastlane import LOG_CAPACITY

    w = world(2)
    for _ in range(2):  # open the lanes
        _reduce_all(w, "warm", [np.ones(1), np.ones(1)])
    n = LOG_CAPACITY + 50  # rank 0 runs this far ahead of rank 1: its log fills up
    ahead = [w.submit(0, f"t{i}", np.full(1, float(i)), op=SUM) for i in range(n)]
    behind = [w.submit(1, f"t{i}", np.ones(1), op=SUM) for i in range(n)]
    for i, (a, b) in enumerate(zip(ahead, behind)):
        np.testing.assert_array_equal(a.wait(WAIT), np.full(1, i + 1.0))
        np.testing.assert_array_equal(b.wait(WAIT), np.full(1, i + 1.0))
    assert _stat(w, "off") == [True, True]
