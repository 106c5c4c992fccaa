"""The one interface between the negotiated engine and the fast lane (hora.core.lane.engine_side).

A lane reaches the engine only through its ``EngineSide`` (``requeue``, ``lane_failed``,
``flush_blocked``); the engine reaches the lanes only through ``Lanes`` (``offer``, ``learn``
and the lifecycle). These tests record the calls crossing it, over an in-process world.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

from hora.core.data.executor import Executor
from hora.core.lane.engine_side import EngineSide
from hora.errors import HoraInternalError

from .conftest import SUM

pytestmark = pytest.mark.timeout(90)

WAIT = 20.0


def _reduce_all(w: Any, name: str, n: int, value: float = 1.0) -> list[np.ndarray]:
    hs = [w.submit(r, name, np.full(3, value + r), op=SUM) for r in range(n)]
    return [h.wait(WAIT) for h in hs]


def test_the_engine_is_every_lanes_engine_side(world: Any) -> None:
    w = world(2)
    _reduce_all(w, "a", 2)
    for engine in w.engines:
        assert isinstance(engine, EngineSide)
        lane = engine.lane(0)
        assert lane is not None and lane._engine is engine  # one object, no bound methods


def test_the_executor_calls_nothing_back() -> None:
    """The lanes learn from the engine's Responses, not from an executor callback."""
    assert "on_negotiated" not in inspect.signature(Executor.__init__).parameters


def test_lanes_learn_each_negotiated_response_once_before_it_runs(world: Any) -> None:
    w = world(2)
    seen: list[list[tuple[str, ...]]] = [[], []]
    for r, engine in enumerate(w.engines):
        lanes = engine._lanes
        learn = lanes.learn

        def record(route: Any, resp: Any, _learn: Any = learn, _r: int = r) -> None:
            seen[_r].append(tuple(resp.names))
            _learn(route, resp)

        lanes.learn = record
    for i in range(5):
        for got in _reduce_all(w, "grad", 2, float(i)):
            np.testing.assert_array_equal(got, np.full(3, 2.0 * i + 1))
    # negotiated once (the first round), then hits in the lane: learned once on every rank
    assert seen == [[("grad",)], [("grad",)]]
    assert all(e.lane(0).describe()["fast_ops"] >= 3 for e in w.engines)


def test_diverged_ops_come_back_through_requeue_in_log_order(world: Any) -> None:
    w = world(2)
    handed: list[list[str]] = [[], []]
    for r, engine in enumerate(w.engines):
        requeue = engine.requeue

        def record(entries: list[Any], _requeue: Any = requeue, _r: int = r) -> None:
            handed[_r].extend(e.request.name for e in entries)
            _requeue(entries)

        engine.requeue = record
    _reduce_all(w, "A", 2)
    _reduce_all(w, "B", 2)
    hs = [w.submit(0, "A", np.full(3, 1.0), op=SUM), w.submit(0, "B", np.full(3, 2.0), op=SUM),
          w.submit(1, "B", np.full(3, 20.0), op=SUM), w.submit(1, "A", np.full(3, 10.0), op=SUM)]
    expected = [11.0, 22.0, 22.0, 11.0]
    for h, value in zip(hs, expected):
        np.testing.assert_array_equal(h.wait(WAIT), np.full(3, value))
    assert handed == [["A", "B"], ["B", "A"]]  # each rank's own log order
    assert [e.lane(0).describe()["off"] for e in w.engines] == [False, False]


def test_a_failed_lane_collective_reaches_the_engine_through_lane_failed(world: Any) -> None:
    w = world(2)
    for _ in range(3):
        _reduce_all(w, "f", 2)
    failures: list[BaseException] = []
    engine = w.engines[0]
    lane_failed = engine.lane_failed

    def record(error: BaseException) -> None:
        failures.append(error)
        lane_failed(error)

    engine.lane_failed = record
    lane = engine.lane(0)
    assert lane is not None

    def broken(*_args: Any) -> None:
        raise RuntimeError("broken collective")

    lane._executor.execute = lane._executor.execute_one = broken  # (a lone op: execute_one)
    hs = [w.submit(r, "f", np.ones(3), op=SUM) for r in range(2)]
    for h in hs:
        with pytest.raises(HoraInternalError):
            h.wait(WAIT)
    assert len(failures) == 1 and "broken collective" in str(failures[0])
    assert "broken collective" in str(engine.error)
