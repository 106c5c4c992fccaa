"""A done-callback that raises is logged and goes no further (concurrent.futures' rule).

Before: an exception in a handle's callback propagated out of ``Handle._finish``; raised by an
early callback it left the handle undone (every waiter hung), raised by a late one it skipped
the callbacks after it, and raised while the engine failed its pending ops
(``Responses.fail_all``) it stopped the engine from failing the ops after it (their waiters hung).
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from hora.core.engine.dispatch import Responses
from hora.core.op.entry import Entry
from hora.core.op.handle import Handle
from hora.core.op.messages import OpKind, Request
from hora.core.op.process_set import Registry
from hora.errors import HoraInternalError, PeerLostError


def _boom(_h: Handle) -> None:
    raise RuntimeError("callback bug")


def test_raising_callbacks_leave_the_handle_done_and_the_others_run(
        caplog: pytest.LogCaptureFixture) -> None:
    h = Handle("grad.w")
    seen: list[str] = []
    h.add_done_callback(_boom, early=True)
    h.add_done_callback(lambda _h: seen.append("early"), early=True)
    h.add_done_callback(_boom)
    h.add_done_callback(lambda _h: seen.append("late"))
    woke = threading.Event()

    def waiter() -> None:
        assert h.wait(5.0) == 42
        woke.set()

    t = threading.Thread(target=waiter)
    t.start()
    with caplog.at_level(logging.ERROR):
        h.set_result(42)  # raises nothing
    t.join(5.0)
    assert woke.is_set() and h.done()
    assert seen == ["early", "late"]
    logged = [r for r in caplog.records if "done-callback of op 'grad.w' raised" in r.getMessage()]
    assert len(logged) == 2 and all(r.exc_info for r in logged)


def test_a_raising_release_still_completes() -> None:
    h = Handle("x")
    h.release = _boom
    h.set_error(PeerLostError("rank 1 lost", peer=1))
    with pytest.raises(PeerLostError, match="rank 1 lost"):
        h.wait(1.0)


def test_callback_added_after_done_does_not_raise_into_the_caller() -> None:
    h = Handle("y")
    h.set_result(1)
    h.add_done_callback(_boom)  # logged, not raised
    assert h.wait(0.1) == 1


def test_fail_all_fails_every_op_when_a_callback_raises() -> None:
    transport = SimpleNamespace(rank=0, size=2)
    none: Any = None
    responses = Responses(transport, Registry(2), none, none, none,  # type: ignore[arg-type]
                          SimpleNamespace(departed=set()), none)  # type: ignore[arg-type]
    handles = []
    for name in ("a", "b", "c"):
        h = Handle(name)
        h.add_done_callback(_boom)
        handles.append(h)
        req = Request(kind=OpKind.ALLREDUCE, name=name, set_id=0, dtype="float32", shape=[2],
                      rank=0)
        responses.expect(Entry(req, np.zeros(2, np.float32), None, h))
    responses.fail_all(PeerLostError("rank 1 exited", peer=1))
    for h in handles:
        assert h.done()
        with pytest.raises(HoraInternalError, match="rank 1 exited"):
            h.wait(0.1)
