"""The ``fake_world`` fixture: run a function on ``n`` threads over the loopback transport."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from hora.collectives.comm import Comm
from hora.transports.loopback import run_world

T = TypeVar("T")

DATA_TIMEOUT = 10.0
"""Seconds a receive may wait without progress before the transport raises (names the peer)."""

JOIN_TIMEOUT = 45.0
"""Hard limit for one world, far under pytest-timeout's 120 s: a hung test fails, never hangs."""

FakeWorld = Callable[..., list[Any]]


@pytest.fixture
def fake_world() -> FakeWorld:
    """``fake_world(n, fn)`` runs ``fn(comm)`` on ranks ``0..n-1`` (one thread each).

    Returns the per-rank results in rank order; re-raises the first exception any rank raised;
    fails if a rank is still running after :data:`JOIN_TIMEOUT` or if bytes were left unread.
    """

    def run(n: int, fn: Callable[[Comm], T], *, timeout: float = DATA_TIMEOUT) -> list[T]:
        return run_world(n, lambda transport: fn(transport.comm()), timeout=timeout,
                         join_timeout=JOIN_TIMEOUT)

    return run
