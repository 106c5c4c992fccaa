"""The fast lane: allreduce and allgather without a coordinator round trip, for a process set on
one host.

Horovod's *response cache*, redone for shared memory. Once an allreduce or allgather named
``n`` has been negotiated (by rank 0's :class:`~hora.core.engine.coordinator.Coordinator`), every
member remembers its agreed properties (dtype, shape, op, scale factors) in a numbered *slot*
(:mod:`hora.core.lane.lane_cache`), assigned while that response runs, so every member numbers slots
alike. A later op of ``n`` with the same properties (an allgather's first dimension may differ)
is a *hit*: it needs no negotiation, only agreement on *when* to run it.

**Logs.** Each member owns an append-only log in its shared-memory board (board words are read
and written by :class:`~hora.transports.shm_board.LaneBoards`). Every allreduce and allgather
submitted on the set appends one entry: its slot on a hit, ``MISS`` otherwise (then negotiated,
as before), so position ``p`` of every log is that member's ``p``-th such op. A grouped call (a
grouped op, a sparse allreduce's two allgathers) appends its members as one *unit*: all hits or
all misses, visible in one store; an allgather's entry carries its first dimension.

**Decisions.** Group rank 0 (the *leader*, :mod:`hora.core.lane.lane_leader`) reads the unit at
position ``p`` of every log and publishes one decision in its board:

* ``FAST k``: positions ``p .. p+k-1`` hold the same units on every member: every member runs
  them, as one fused shared-memory allreduce (packed straight into the segment; one dtype, op
  and scales, at most ``HOROVOD_FUSION_THRESHOLD`` bytes), or as one allgather per position;
* ``DIVERGED k``: the members disagree (different order, a miss, a changed shape): each member
  hands its ops there (if they were hits) to the negotiated path, where the coordinator pairs
  ops by name, or reports the mismatch naming the ranks;
* ``OFF``: a member closed its log at ``p`` (``join``, its log full, a stall): every member hands
  every op at ``p`` or later to the negotiated path and stops appending. When a ``join``
  completes, the engine starts a fresh lane (a new group, the same slots) on every member.

Every member applies the same decisions in the same order, so an op runs through the lane on
all members or on none, in one order everywhere, and a unit runs whole (split only where it
exceeds one fused op). The lane has its own shared-memory group and runs on its own thread, or
on a thread waiting for one of its ops (a handle's ``runner``; a grouped call's handle drives
its members' lane), saving two thread hand-offs; it never waits for the engine thread, nor the
engine for it: a member blocked in a negotiated op cannot deadlock a lane op. It reaches the
engine only through one :class:`~hora.core.lane.engine_side.EngineSide`.

**Waiting.** Appending rings the leader's doorbell (a board word), deciding rings every
member's; an idle lane thread sleeps on its own (``FUTEX_WAIT``, in slices: a lost wakeup costs
at most a slice).

**Failure.** A position undecided for ``HOROVOD_STALL_CHECK_TIME_SECONDS`` is decided ``OFF`` by
the leader, so the stalled ops reach the coordinator, whose stall inspector names the missing
ranks. A lost peer inside a lane collective raises in the lane thread; the engine then aborts as
for any failed collective.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from hora._util.log import get_logger
from hora.config import Config
from hora.core.data.executor import Executor
from hora.core.data.routing import Route
from hora.core.lane.engine_side import EngineSide
from hora.core.lane.lane_cache import MAX_BYTES, SlotCache
from hora.core.lane.lane_leader import Leader
from hora.core.op.entry import Entry
from hora.core.op.handle import BLOCKED_AFTER_S
from hora.core.op.messages import OpKind, Response
from hora.errors import HoraError, ShutdownError, copy_error, internal_error, op_error
from hora.transports.shm_board import (
    ARG_CAPACITY,
    DIVERGED,
    FAST,
    GROUPED,
    LOG_CAPACITY,
    MISS,
    LaneBoards,
)

log = get_logger(__name__)

IDLE_SLICE_S = 0.05
"""Doorbell wait slice with nothing pending."""

BUSY_SLICE_S = 0.005
"""Doorbell wait slice while ops are pending (bounds the cost of a lost wakeup)."""

ROOM_WAIT_S = 2.0
"""How long a submission waits for room in a full log before it closes the log (the lane is
then off until a ``join``): a burst far ahead of a slower member usually finds room sooner."""

DRIVER_SPIN_FACTOR = 8
"""A waiting caller checks its doorbell this many times a collective's spin before sleeping."""

_ALLGATHER = OpKind.ALLGATHER  # (an enum member through its class costs 100-200 ns in 3.11)
KINDS = (OpKind.ALLREDUCE, OpKind.ALLGATHER)
"""The ops a lane logs (each takes one log position, hit or miss)."""

MAX_UNIT = LOG_CAPACITY // 8
"""A grouped call's members are logged in units of at most this many, in order (a unit must
fit the log at once; one of more than ``LOG_CAPACITY`` would close it)."""


class FastLane:
    """The fast lane of one process set on this rank. See the module docstring.

    Args:
        set_id: the process set.
        route: the set's route (its ``lane_group`` carries the lane).
        config: fusion threshold, cache capacity, stall time.
        executor: the lane's own (:meth:`~hora.core.lane.lanes.Lanes.lane_executor`); it is
            pointed at the lane's route and used only by the thread driving the lane.
        engine: the negotiated path: ops handed back, a failure, a blocked flush.
        start: allreduces and allgathers this rank submitted on the set before the lane
            existed; the log begins with that many misses.
    """

    def __init__(self, set_id: int, route: Route, config: Config, executor: Executor,
                 engine: EngineSide, *, start: int = 0) -> None:
        lane_route = route.lane_route()
        if lane_route is None or route.lane_group is None:
            raise ValueError("the route has no lane group")
        fabric = route.lane_group.fabric
        self.set_id, self._fabric, self._executor = set_id, fabric, executor
        executor.adopt_route(set_id, lane_route)
        self._engine = engine
        self.size, self.rank = fabric.size, fabric.rank
        self._boards = LaneBoards(fabric)
        # slots: written on the engine thread, read by submitters and the driving thread
        self._cache = SlotCache(set_id, lane_route, config.cache_capacity,
                                min(max(0, config.fusion_threshold), MAX_BYTES))
        self._leader = None if self.rank else Leader(
            set_id, self._boards, self._cache, lane_route,
            stall_s=0.0 if config.stall_check_disable
            else max(0.0, config.stall_check_time_seconds))
        # A waiter spins longer than a collective's wait: its peer is a whole op of Python
        # behind (tens of microseconds), and sleeping costs a wake-up on both sides.
        self._spin = fabric.spin_checks * DRIVER_SPIN_FACTOR
        # this rank's log (guarded by _append_lock)
        self._append_lock = threading.Lock()
        self._count = 0
        self._entries: dict[int, Entry] = {}
        self._running: list[Entry] = []  # the batch being run (the driving thread's)
        self._floor = 0  # a lower bound of every member's consumed position
        self._closed = False  # this rank appends no more (join, full, stop)
        self._off = False  # an OFF decision was applied: everything is negotiated
        self._error: BaseException | None = None
        # driving (one driver at a time: the lane thread or a waiting user thread)
        self._drive_lock = threading.Lock()
        self._consumed = self._read = 0
        # ops this rank ran through the lane, of them run by its thread (the rest: by waiting
        # callers), and collectives run (tests, benchmarks)
        self.fast_ops = self.thread_ops = self.batches = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"hora-lane-{set_id}", daemon=True)
        if start:
            self._boards.prefill(start)
            self._count = start

    def start(self) -> None:
        self._thread.start()

    # ---- cache (engine thread) ---------------------------------------------------------------
    def learn(self, resp: Response) -> None:
        """Remember a negotiated allreduce's or allgather's tensors (before it runs, on every
        member alike)."""
        self._cache.learn(resp)

    def adopt_cache(self, old: FastLane) -> None:
        """Take over another lane's slots (a lane reopened after ``join``)."""
        self._cache.adopt(old._cache)

    def retune(self, fusion_threshold: int) -> None:
        """Autotune: the leader fuses up to ``fusion_threshold`` bytes (at most
        :data:`~hora.core.lane.lane_cache.MAX_BYTES`) from its next decision on."""
        self._cache.limit = min(max(0, fusion_threshold), MAX_BYTES)

    # ---- submission (user threads) -----------------------------------------------------------
    def offer(self, entries: list[Entry]) -> bool:
        """Log a unit: one op, or the members of one grouped call, all of one kind in
        :data:`KINDS` (a user thread). True if the lane took all of them (each handle's
        ``runner`` is then this lane's drive loop), False if every one must be negotiated."""
        n = len(entries)
        gather = entries[0].request.kind is _ALLGATHER
        if self._count + n - self._floor > LOG_CAPACITY:  # (a stale floor over-counts)
            self._make_room(n)
        with self._append_lock:
            if self._closed or self._off:
                return False
            count = self._count
            ahead = count + n - self._floor
            if ahead >= LOG_CAPACITY // 2 or (gather and ahead > ARG_CAPACITY):
                self._floor = count - self._boards.backlog(count)
                ahead = count + n - self._floor
            if ahead > LOG_CAPACITY:
                self._close_locked()
                log.debug("fast lane of set %d: log full, negotiating from now on", self.set_id)
                return False
            slots = self._cache.hits(entries)
            rows = None
            if slots is not None and gather:
                if ahead > ARG_CAPACITY:  # a first dimension could overwrite an unread one
                    slots = None
                else:
                    rows = [e.request.shape[0] for e in entries]
            if slots is None:
                values = [MISS] * n
            else:
                values = [slots[0].index] if n == 1 else (  # (one op: no comprehension)
                    [slot.index | GROUPED for slot in slots[:-1]] + [slots[-1].index])
                drive = self._drive
                for i, entry in enumerate(entries):
                    self._entries[count + i] = entry
                    entry.handle.runner = drive
            hit = slots is not None
            # A caller that waits at once runs its ops: rings go to it, not to the lane thread
            # (two thread hand-offs saved).
            self._boards.append(count, values, rows, hit and entries[-1].sync)
            self._count = count + n
        if self._leader is None:
            self._boards.ring(0)
        elif hit and not entries[-1].sync:
            self._boards.ring_lane()  # nobody waits yet: the lane thread decides and runs it
        return hit

    def _make_room(self, n: int) -> None:
        """``n`` more entries may not fit the log (a burst far ahead of the slowest member): drive
        the lane until they do, as :meth:`flush`, for up to :data:`ROOM_WAIT_S`."""
        self._wait_lane(lambda: self._closed or self._boards.backlog(self._count) + n
                        <= LOG_CAPACITY, ROOM_WAIT_S)

    def close_log(self) -> None:
        """Append no more (ops are negotiated from now); the leader turns the lane off here."""
        with self._append_lock:
            if not self._closed:
                self._close_locked()
        self._boards.ring(0)

    def _close_locked(self) -> None:
        self._closed = True
        self._boards.close_at(self._count)

    def flush(self) -> None:
        """Wait until every op this rank logged has run or been handed to the negotiated path
        (the caller drives the lane meanwhile: :meth:`_wait_lane`)."""
        self._wait_lane(lambda: self._consumed >= self._count, None)
        if self._error is not None:
            raise copy_error(self._error)

    def _wait_lane(self, done: Callable[[], bool], limit: float | None) -> None:
        """Drive the lane until ``done()`` (or for ``limit`` seconds). A wait of
        ``BLOCKED_AFTER_S`` reports this rank blocked in the lane (``EngineSide.flush_blocked``):
        members that never log what it waits for are a deadlock, which the coordinator resolves
        by closing the lane (else the position is decided OFF after the stall time)."""
        reported = False
        start = time.monotonic()
        end = math.inf if limit is None else start + limit
        try:
            while not done() and self._error is None and not self._stop:
                now = time.monotonic()
                if now >= end:
                    return
                step = min(end - now, math.inf if reported else BLOCKED_AFTER_S)
                self._drive(done, None if step == math.inf else step)
                if not reported and not done() and time.monotonic() >= start + BLOCKED_AFTER_S:
                    self._engine.flush_blocked(self.set_id, True)
                    reported = True
        finally:
            if reported:
                self._engine.flush_blocked(self.set_id, False)

    # ---- driving -----------------------------------------------------------------------------
    def _drive(self, until: Callable[[], bool], timeout: float | None) -> None:
        """Run the lane on the calling thread (a waiter: this is its ops' ``Handle.runner``)
        until ``until()`` or ``timeout``: decide (the leader), apply decisions, run batches."""
        end = None if timeout is None else time.monotonic() + timeout
        if not self._drive_lock.acquire(timeout=-1 if timeout is None else timeout):
            return
        if self._stop or self._error is not None:  # failed or stopped (its boards may be gone):
            self._drive_lock.release()  # the engine completes the ops; the caller waits for that
            return
        boards, leader = self._boards, self._leader
        seen = boards.start_driving()  # rings now wake this thread, not the lane thread
        try:
            while not self._stop and self._error is None:
                busy = leader.decide() if leader is not None else False
                if self._apply():
                    busy = True
                if until():
                    return
                if busy:
                    seen = boards.doorbell()
                    continue
                if end is not None and time.monotonic() >= end:
                    return
                # a peer a step behind rings within microseconds: spin before sleeping
                seen = boards.wait_doorbell(seen, self._spin, BUSY_SLICE_S)
        except BaseException as exc:  # noqa: BLE001 - the lane fails; waiters see the error
            self._fail(exc)
        finally:
            rang = boards.stop_driving(seen)
            self._drive_lock.release()
            if rang and self._consumed < self._count:
                boards.ring_lane()  # a ring came after our last look: pass it on

    def _run(self) -> None:
        try:
            while not self._stop:
                seen = self._boards.lane_bell()
                busy = False
                if self._drive_lock.acquire(blocking=False):
                    try:
                        n = self.fast_ops
                        if self._error is None:  # decide (the leader) and apply decisions
                            busy = self._leader.decide() if self._leader is not None else False
                            busy = self._apply() or busy
                        self.thread_ops += self.fast_ops - n
                    finally:
                        self._drive_lock.release()
                if not busy and not self._stop:
                    self._boards.wait_lane_bell(
                        seen, BUSY_SLICE_S if self._pending() else IDLE_SLICE_S)
        except BaseException as exc:  # noqa: BLE001
            self._fail(exc)

    def _pending(self) -> bool:
        """Whether this rank has work in the lane: its own ops, decisions, peers' ops."""
        return (self._consumed < self._count or self._boards.decisions_waiting(self._read)
                or (self._leader is not None and self._leader.pending()))

    # ---- every member ------------------------------------------------------------------------
    def _apply(self) -> bool:
        if self._off:
            return False
        boards = self._boards
        decisions = boards.decisions(self._read)
        for kind, length in decisions:
            if self._off:
                break
            if kind == FAST:
                self._run_batch(self._consumed, length)
                self._consumed += length
            elif kind == DIVERGED:
                handed: list[Entry] = []
                for position in range(self._consumed, self._consumed + length):
                    entry = self._entries.pop(position, None)
                    if entry is not None:
                        entry.handle.runner = None
                        handed.append(entry)
                if handed:
                    self._engine.requeue(handed)
                self._consumed += length
            else:
                self._go_off()
            self._read += 1
            boards.consumed(self._read, self._consumed)
        return bool(decisions)

    def _run_batch(self, start: int, length: int) -> None:
        entries: list[Entry] = []
        self._running = entries  # (from the first pop: a failure below fails them, none is lost)
        for position in range(start, start + length):
            entry = self._entries.pop(position, None)
            if entry is None:  # a bug: _fail makes it every op's internal error
                raise RuntimeError(f"out of step at position {position} (batch {start}+{length})")
            entries.append(entry)
        try:
            responses = self._cache.responses(entries, self._boards.rows, start)
            if length == 1:  # (one op: no dict; a lone allreduce runs without detours)
                self._executor.execute_one(responses[0], entries[0])
            elif len(responses) == 1:
                self._executor.execute(responses[0], {e.request.name: e for e in entries})
            else:  # allgathers: one collective each
                for resp, entry in zip(responses, entries):
                    self._executor.execute(resp, {entry.request.name: entry})
        except BaseException:
            # Failed with the job's error once the engine has heard every rank's reason
            # (abort(), from the engine's stop_all): this error may be another rank's echo.
            self._executor.unfinished.extend(entries)
            raise
        finally:
            self._running = []
        self.fast_ops += length
        self.batches += len(responses)

    def _go_off(self) -> None:
        with self._append_lock:
            self._off = self._closed = True
            leftovers = [entry for _, entry in sorted(self._entries.items())]
            self._entries.clear()
            self._consumed = self._count
        for entry in leftovers:
            entry.handle.runner = None
        if leftovers:
            self._engine.requeue(leftovers)
        log.debug("fast lane of process set %d is off: every op is negotiated", self.set_id)

    # ---- shutdown and failure ----------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        if self._stop:
            return  # stopping: the engine fails what is left
        error = exc if isinstance(exc, HoraError) else internal_error(
            f"the fast lane of process set {self.set_id}", exc)
        self.abort(error, fail_ops=False)  # the ops wait for the job's error: the engine aborts
        self._engine.lane_failed(error)  # the job, then calls abort() with that error

    def abort(self, error: BaseException, settle: float = 0.0, fail_ops: bool = True) -> None:
        """Close the lane, send its drivers away, and fail every op still in it with ``error``
        (not with ``fail_ops=False``); log nothing more. ``settle``: a peer shut down: a batch
        running now may end first, within that long."""
        if settle:
            self._stop = True  # a driver leaves after its batch (within a doorbell slice)
            if self._drive_lock.acquire(timeout=settle):
                self._drive_lock.release()
        with self._append_lock:
            if self._error is None:
                self._error = error
            self._closed = self._off = True
            # (the batch a driver runs now, too: stop() may close the fabric under it, and its
            # ops must fail with this error, not with what that closing raises there)
            entries = list(self._entries.values()) + self._running if fail_ops else []
            if fail_ops:
                self._entries.clear()
        for entry in entries:
            entry.handle.set_error(op_error(error, entry.request.name))
        if fail_ops:
            self._executor.fail_unfinished(error)
        self._boards.wake_driver()
        self._boards.ring_lane()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the lane thread; ops still in the lane fail with ShutdownError."""
        failed = self._error is not None
        if not failed:
            self.close_log()  # the leader hands peers' pending ops to the coordinator
            self.abort(ShutdownError("Horovod has been shut down before this op ran."))
        self._stop = True
        self._boards.ring_lane()
        if failed:  # peers blocked in a lane collective with us raise now, not at a timeout
            self._fabric.close()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._drive_lock.acquire(timeout=timeout):  # no caller is running the lane now
            try:
                self._boards.release()
            finally:
                self._drive_lock.release()

    def describe(self) -> dict[str, Any]:
        return {"set": self.set_id, "slots": len(self._cache.slots), "logged": self._count,
                "fast_ops": self.fast_ops, "thread_ops": self.thread_ops,
                "batches": self.batches, "off": self._off}
