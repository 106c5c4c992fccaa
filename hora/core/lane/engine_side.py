"""The one interface between the negotiated engine and the fast lane, and which thread calls what.

The engine and the lanes of one rank meet only here; neither hands the other bound methods.

**Engine -> lanes**: the engine owns one :class:`~hora.core.lane.lanes.Lanes` and calls

===============================  ========================================================
``Lanes.offer(entries)``         a user thread, at submit: True if the set's lane took the
                                 unit (it runs there, no negotiation), False: negotiate it.
                                 (The engine may call ``FastLane.offer`` of an open lane
                                 from ``Lanes.by_set`` directly: the same answer, one call.)
``Lanes.before_join(kind, set)`` a user thread submitting ``join`` / ``remove_process_set``:
                                 the lane's log closes and drains first.
``Lanes.learn(route, resp)``     the engine thread, before a negotiated allreduce or
                                 allgather runs: the set's lane opens (the first time) and
                                 learns the response's slots. The only place a lane learns.
``Lanes.joined`` / ``join_failed`` / ``remove`` / ``close`` / ``retune`` / ``stop_all``
                                 the engine thread (responses, rank 0's requests, autotune,
                                 shutdown).
===============================  ========================================================

**Lanes -> engine**: a lane holds one :class:`EngineSide` (the engine implements it) and calls
only its three methods, below, each saying which thread calls it.

**Which thread runs an op** (docs/design.md, "Which thread runs an op"): a lane op runs on the
thread *driving* the lane: the caller that waits for it (its handle's
:attr:`~hora.core.op.handle.Handle.runner` is the lane's drive loop, so ``Handle.wait`` runs
it) or, when nobody waits yet, the lane's own thread ``hora-lane-<set>``. A negotiated op (a
miss, an op handed back through :meth:`EngineSide.requeue`, any other collective) runs on the
engine thread ``hora-engine``. A lane builds its own executor
(:meth:`~hora.core.lane.lanes.Lanes.lane_executor`), used only by the thread driving it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from hora.core.op.entry import Entry


@runtime_checkable
class EngineSide(Protocol):
    """What a fast lane may ask of the negotiated engine (implemented by
    :class:`~hora.core.engine.engine.Engine`). None of these may block or wait on a lane."""

    def requeue(self, entries: list[Entry]) -> None:
        """Negotiate ``entries``, which the lane hands back (a ``DIVERGED`` or ``OFF`` decision),
        in log order. Called by the thread driving the lane (its lane thread or a waiting
        caller); the engine thread then sends their requests as for any submission (or fails
        them at once if the engine has stopped)."""
        ...

    def lane_failed(self, error: BaseException) -> None:
        """A lane collective failed with ``error``. Called once per lane, by the thread that
        was driving it; the engine thread then aborts the job (every rank hears the reason) and
        fails the lane's ops through :meth:`~hora.core.lane.lanes.Lanes.stop_all`."""
        ...

    def flush_blocked(self, set_id: int, blocked: bool) -> None:
        """A user thread draining the lane of ``set_id`` (a ``join`` / ``remove_process_set``,
        or a submission waiting for room in a full log) has waited ``BLOCKED_AFTER_S``
        (``blocked``), or that wait ended: the engine reports it to rank 0's deadlock
        detector as a wait in the lane."""
        ...


__all__ = ["EngineSide"]
