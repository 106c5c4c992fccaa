"""The engine end to end in one process: N engines on threads over the loopback transport."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from hora.core.op.messages import OpKind
from hora.errors import HoraInternalError, MismatchError, PeerLostError

from .conftest import SUM


def test_allreduce_any_submission_order(world: Any) -> None:
    w = world(3)
    names = [f"t{i}" for i in range(20)]
    handles: dict[tuple[int, str], Any] = {}
    for r in range(3):
        order = names if r != 1 else names[::-1]
        for name in order:
            k = names.index(name)
            handles[r, name] = w.submit(r, name, np.full(k + 1, r + k, np.float32), op=SUM)
    for (_r, name), h in handles.items():
        k = names.index(name)
        np.testing.assert_array_equal(h.wait(10), np.full(k + 1, 3 * k + 3, np.float32))


def test_average_and_scaling(world: Any) -> None:
    w = world(2)
    hs = [w.submit(r, "avg", np.array([2.0 * (r + 1)]), op=0, prescale=3.0, postscale=0.5)
          for r in range(2)]
    for h in hs:  # 0.5 * mean(3*2, 3*4) = 4.5
        np.testing.assert_allclose(h.wait(10), [4.5])


def test_integer_average_truncates(world: Any) -> None:
    w = world(2)
    hs = [w.submit(r, "iavg", np.array([1 + r, -(1 + r)], np.int32), op=0) for r in range(2)]
    for h in hs:  # (1+2)/2 = 1.5 -> 1 ; -1.5 -> -1
        np.testing.assert_array_equal(h.wait(10), [1, -1])


def test_many_small_tensors_fuse_correctly(world: Any) -> None:
    w = world(2, fusion_threshold=1024)
    hs = {(r, i): w.submit(r, f"g{i}", np.arange(i, i + 7, dtype=np.float64) * (r + 1), op=SUM)
          for i in range(50) for r in range(2)}
    for (_r, i), h in hs.items():
        np.testing.assert_array_equal(h.wait(10), np.arange(i, i + 7, dtype=np.float64) * 3)


def test_mismatch_fails_every_rank_with_same_text(world: Any) -> None:
    w = world(3)
    hs = [w.submit(r, "bad", np.zeros(3 if r != 2 else 4, np.float32), op=SUM) for r in range(3)]
    texts = []
    for h in hs:
        with pytest.raises(MismatchError, match="Mismatched ALLREDUCE tensor shapes") as info:
            h.wait(10)
        texts.append(str(info.value))
    assert len(set(texts)) == 1 and "ranks [2] had [4]" in texts[0]
    # the engine keeps working after a mismatch
    hs = [w.submit(r, "good", np.ones(2), op=SUM) for r in range(3)]
    for h in hs:
        np.testing.assert_array_equal(h.wait(10), [3, 3])


def test_allgather_broadcast_alltoall_reducescatter(world: Any) -> None:
    w = world(3)
    ag = [w.submit(r, "ag", np.full((r + 1, 2), r, np.int64), OpKind.ALLGATHER) for r in range(3)]
    want = np.concatenate([np.full((r + 1, 2), r) for r in range(3)])
    for h in ag:
        np.testing.assert_array_equal(h.wait(10), want)
    bc = [w.submit(r, "bc", np.full(4, r, np.float16), OpKind.BROADCAST, root=2) for r in range(3)]
    for h in bc:
        np.testing.assert_array_equal(h.wait(10), np.full(4, 2, np.float16))
    splits = [[1, 0, 2], [2, 2, 0], [0, 1, 1]]
    a2a = [w.submit(r, "a2a", np.full(sum(splits[r]), 10 * r, np.int32), OpKind.ALLTOALL,
                    splits=splits[r]) for r in range(3)]
    for r, h in enumerate(a2a):
        out, recv = h.wait(10)
        assert list(recv) == [splits[j][r] for j in range(3)]
        np.testing.assert_array_equal(out, np.repeat([0, 10, 20], recv))
    rs = [w.submit(r, "rs", np.arange(10, dtype=np.float32).reshape(5, 2) * (r + 1),
                   OpKind.REDUCESCATTER, op=SUM) for r in range(3)]
    full = np.arange(10, dtype=np.float32).reshape(5, 2) * 6
    bounds = [(0, 2), (2, 4), (4, 5)]
    for r, h in enumerate(rs):
        np.testing.assert_array_equal(h.wait(10), full[bounds[r][0]:bounds[r][1]])


def test_join_contributes_zeros(world: Any) -> None:
    w = world(2)
    j1 = w.submit(1, "join", np.empty(0, np.uint8), OpKind.JOIN)
    h = w.submit(0, "late", np.ones(3, np.float32), op=0)  # Average keeps the full divisor
    np.testing.assert_array_equal(h.wait(10), np.full(3, 0.5, np.float32))
    j0 = w.submit(0, "join", np.empty(0, np.uint8), OpKind.JOIN)
    assert j0.wait(10) == 0 and j1.wait(10) == 0


def test_duplicate_inflight_name_rejected(world: Any) -> None:
    w = world(2)
    h = w.submit(0, "dup", np.ones(1), op=SUM)
    with pytest.raises(ValueError, match="same name as another tensor"):
        w.submit(0, "dup", np.ones(1), op=SUM)
    w.submit(1, "dup", np.ones(1), op=SUM).wait(10)
    h.wait(10)
    w.submit(0, "dup", np.ones(1), op=SUM)  # reusable once done
    w.submit(1, "dup", np.ones(1), op=SUM).wait(10)


def test_lost_peer_fails_pending_ops_everywhere(world: Any) -> None:
    w = world(3)
    hs = [w.submit(r, "x", np.ones(4), op=SUM) for r in (0, 1)]
    w.transports[2].close()  # rank 2 "dies" without submitting
    start = time.monotonic()
    for h in hs:
        with pytest.raises(HoraInternalError, match="rank 2"):
            h.wait(10)
    assert time.monotonic() - start < 10
    with pytest.raises(HoraInternalError):
        w.submit(0, "after", np.ones(1), op=SUM)


def test_clean_shutdown_of_worker_fails_ops_that_need_it(world: Any) -> None:
    w = world(2)
    w.engines[1].stop(timeout=5)
    with pytest.raises(HoraInternalError, match="shut down"):
        w.submit(0, "x", np.ones(1), op=SUM).wait(10)


def test_rank0_shutdown_stops_workers(world: Any) -> None:
    w = world(2)
    w.engines[0].stop(timeout=5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            w.submit(1, f"x{time.monotonic()}", np.ones(1), op=SUM).wait(10)
        except HoraInternalError as exc:
            assert "shut down" in str(exc) or isinstance(exc, PeerLostError)
            return
    pytest.fail("rank 1 never noticed rank 0 shut down")
