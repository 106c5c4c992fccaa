"""The background engine: one thread per process that negotiates and runs every collective.

User threads call :meth:`Engine.submit`, which queues an :class:`~hora.core.data.executor.Entry` and
wakes the thread. The thread's loop (event-driven; it sleeps in the transport's control wait, so
an idle job burns no CPU):

1. move newly submitted entries into the pending table and send their requests to rank 0
   (rank 0 feeds its own requests straight to its
   :class:`~hora.core.engine.coordinator.Coordinator`);
2. receive control messages: on rank 0, requests from workers; on workers, ordered response
   lists from rank 0;
3. rank 0: collect ready (validated, fused) responses, send them to the workers, then execute;
   workers: execute responses in the order received;
4. periodically (rank 0) run the stall inspector.

Failure is loud: if a peer is lost or a collective fails, every pending and future op on this
rank fails with the cause, and rank 0 tells every other rank to do the same.

Beside it: :mod:`hora.core.engine.liveness` (heartbeats, goodbyes, abort reasons),
:mod:`hora.core.lane.lanes` (the fast lanes' lifecycle), :mod:`hora.core.engine.deadlock` (wait
reports and the detector), :mod:`hora.core.engine.dispatch` (sending and running response
batches, the table of ops awaiting their response), :mod:`hora.core.data.executor` (running an
agreed response), :mod:`hora.core.autotune.autotune` (the tunables).

**The engine and the fast lane** meet through one stated interface
(:mod:`hora.core.lane.engine_side`): the engine calls its :class:`~hora.core.lane.lanes.Lanes`
(``offer`` from user threads, ``learn`` and the lane's lifecycle from the engine thread), and
implements :class:`~hora.core.lane.engine_side.EngineSide` for the lanes (:meth:`Engine.requeue`,
:meth:`Engine.lane_failed`, :meth:`Engine.flush_blocked`). Which thread runs an op: a negotiated
op, the engine thread; a lane op, the thread driving the lane (a waiting caller, through its
handle's ``runner``, or the lane's thread).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from functools import partial
from typing import Any, cast

from hora import errors
from hora._util.log import get_logger
from hora.config import Config
from hora.core.autotune.autotune import Tuning
from hora.core.data.executor import Executor
from hora.core.engine import affinity, trace
from hora.core.engine.coordinator import Coordinator
from hora.core.engine.cross_host import OrderedTransport, goodbye
from hora.core.engine.cross_link import CrossCache
from hora.core.engine.deadlock import WaitReports, close_lanes
from hora.core.engine.dispatch import Responses
from hora.core.engine.liveness import Liveness, RemoteAbort
from hora.core.lane.fastlane import FastLane
from hora.core.lane.lanes import Lanes
from hora.core.op.entry import Entry, InFlight
from hora.core.op.messages import (
    MSG_ABORT,
    MSG_BYE,
    MSG_HEARTBEAT,
    MSG_LANE_OFF,
    MSG_PARAMS,
    MSG_REQUESTS,
    MSG_RESPONSES,
    MSG_SHUTDOWN,
    MSG_WAITS,
    OpKind,
    Request,
    decode,
    encode,
    parse_waits,
)
from hora.core.op.naming import AutoNames
from hora.core.op.process_set import Registry
from hora.errors import HoraError, HoraInternalError, PeerLostError, ShutdownError
from hora.timeline.writer import Timeline
from hora.transports.base import Transport

log = get_logger(__name__)

_ALLREDUCE, _ALLGATHER = OpKind.ALLREDUCE, OpKind.ALLGATHER  # (submit's: see lane/fastlane.py)

ABORT_GATHER_SECONDS = 0.5
"""On a local failure, how long to listen for other ranks' reasons before failing the ops."""


class Engine:
    """Owns the transport, the submission queue and the background thread of one process; the
    fast lanes' :class:`~hora.core.lane.engine_side.EngineSide`."""

    def __init__(self, transport: Transport, config: Config, registry: Registry, *,
                 hostnames: list[str] | None = None, job_id: str = "") -> None:
        self.transport = transport
        self.config = config
        self.registry = registry
        self.rank = transport.rank
        self.size = transport.size
        self._queue: deque[Entry] = deque()
        self._in_flight = InFlight()  # names of the ops in flight, per set
        self.names = AutoNames()  # automatic op names (user threads; resynced on errors)
        self.timeline = Timeline.from_config(config, self.rank)
        self._executor = Executor(transport.comm(), registry, config, self.timeline,
                                  hostnames=hostnames, job_id=job_id)
        self._reports = WaitReports(transport.wake)  # this rank's long waits, for rank 0
        self._report_wait = self._reports.report  # bound once: every op's handle shares them
        self._release_name = self._in_flight.release
        self._lanes = Lanes(transport, registry, config, job_id, self)  # (self: EngineSide)
        self._lane_error: BaseException | None = None
        self._coordinator = Coordinator(registry, config) if self.rank == 0 else None
        self._stop = threading.Event()
        self._stopping = False  # _stop is set (a plain read for the submit path)
        self._error: HoraInternalError | None = None
        self._drained = False  # the thread has failed every op and reads no more submissions
        # Control peers must be heard from within heartbeat_timeout_seconds.
        self._liveness = Liveness(transport, config.heartbeat_timeout_seconds)
        self._departed = self._liveness.departed  # (read here; Liveness writes it)
        # the ops awaiting their response are the Responses' (expect, fail_all)
        self._responses = Responses(transport, registry, self._executor, self._lanes, self.names,
                                    self._liveness, self.timeline)
        self._dispatch = self._responses.dispatch
        # the response cache across hosts (None on one host): hooks in _take_submissions,
        # _receive and rank 0's loop
        self._cross = CrossCache.for_job(transport, config, hostnames, self._responses,
                                         self._coordinator, self._departed,
                                         self.timeline.recording, job_id)
        if self._cross is not None:
            self._dispatch = self._cross.wrap_dispatch(self._dispatch)
        ordered = self._responses.send_ordered  # (tunables keep their place among responses)
        self.tuning = Tuning(  # autotune: what reads the tunables, what runs collectives
            config, cast(Transport, OrderedTransport(transport, lambda p, m: ordered([p], m))),
            self._departed, hostnames,
            retunables=[self._lanes, self._executor] if self._coordinator is None
            else [self._coordinator, self._lanes, self._executor],
            observed=[self._lanes, self._executor])
        self._thread = threading.Thread(target=self._run, name="hora-engine", daemon=True)
        self._cpu_core: int | None = None

    # ---- user side ---------------------------------------------------------------------------
    def start(self, cpu_core: int | None = None) -> None:
        """Start the background thread; ``cpu_core``: pin it (and the fast-lane threads it
        starts) to that core (``HOROVOD_THREAD_AFFINITY``, :mod:`hora.core.engine.affinity`)."""
        self._cpu_core = cpu_core
        self._thread.start()

    def submit(self, entry: Entry) -> None:
        """Queue an op. Raises ValueError for a duplicate in-flight name, or the engine's error."""
        if self._error is not None or self._stopping:
            raise errors.op_error(self._final_error(), entry.request.name)
        req = entry.request
        self._in_flight.take(req.set_id, req.name)
        handle = entry.handle
        handle.set_id = req.set_id
        handle.release = self._release_name  # frees the name before any waiter wakes
        handle.report_wait = self._report_wait  # one bound method for every op (no allocation)
        kind = req.kind
        if kind is _ALLREDUCE or kind is _ALLGATHER:
            lane = self._lanes.by_set.get(req.set_id)  # (an open lane: no lock, no call)
            if lane is not None and lane.offer([entry]) or lane is None and \
                    self._lanes.offer([entry]):
                return  # the fast lane took it: no negotiation
        elif kind is OpKind.JOIN:
            self._lanes.before_join(kind, entry.request.set_id)
        elif kind is OpKind.REMOVE_PROCESS_SET:
            self._lanes.before_join(kind, entry.request.root)
        self._enqueue(entry)

    def submit_group(self, entries: list[Entry]) -> None:
        """Queue the ops of one grouped call (one kind, one process set, in order). In a fast
        lane they are one unit: run together, or all negotiated. Raises as :meth:`submit`; a
        duplicate name queues none of them."""
        if not entries:
            return
        if self._error is not None or self._stopping:
            raise self._final_error()
        self._in_flight.take_all(entries[0].request.set_id, [e.request.name for e in entries])
        for entry in entries:
            self._track(entry)
        kind = entries[0].request.kind
        if (kind is OpKind.ALLREDUCE or kind is OpKind.ALLGATHER) and self._lanes.offer(entries):
            return  # the fast lane took them: no negotiation
        for entry in entries:
            self._enqueue(entry)

    def _track(self, entry: Entry) -> None:
        """Free the op's name when it completes; report long waits on it."""
        entry.handle.set_id = entry.request.set_id
        entry.handle.release = self._release_name
        entry.handle.report_wait = self._report_wait  # one bound method for every op

    def _enqueue(self, entry: Entry) -> None:
        """Hand ``entry`` to the engine thread. If that thread has already failed or drained
        every op (it stopped after this call's checks), fail the entry here: it must never sit
        in a queue nobody reads. (``_fail_all`` sets ``_drained`` before it drains, so either it
        sees the entry, or this check sees the flag; failing twice is harmless.)"""
        self._queue.append(entry)
        self.transport.wake()
        if self._drained:
            entry.handle.set_error(self._final_error())

    def _final_error(self) -> HoraInternalError:
        error = self._error or ShutdownError(
            "Horovod has been shut down. This was caused by an exception on one of the ranks or "
            "an attempt to use an op after shutdown().")
        return errors.copy_error(error)  # (its attributes kept: PeerLostError.peer, ...)

    def _send_waits(self) -> bool:
        updates = self._reports.drain()
        if not updates:
            return False
        if self._coordinator is not None:
            if self._cross is not None:
                self._cross.watch_waits(updates)
            for blocked, set_id, name, lane in updates:
                self._coordinator.deadlocks.waiting(0, blocked, set_id, name, lane)
        else:
            self.transport.send_control(0, encode(MSG_WAITS, waits=updates))
        return True

    # ---- the fast lanes' EngineSide (hora.core.lane.engine_side; threads: there) ---------------
    def requeue(self, entries: list[Entry]) -> None:
        """A fast lane hands ops back (the thread driving it, in log order): they are
        negotiated like any other, or fail at once if the engine has stopped."""
        for entry in entries:
            if self._stop.is_set() or self._error is not None:
                entry.handle.set_error(errors.op_error(self._error or ShutdownError(
                    "Horovod has been shut down before this op ran."), entry.request.name))
            else:
                self._enqueue(entry)

    def lane_failed(self, error: BaseException) -> None:
        """A fast lane collective failed (the thread driving it): the engine thread aborts the
        job at its next pass."""
        if self._lane_error is None:
            self._lane_error = error
        self.transport.wake()

    def flush_blocked(self, set_id: int, blocked: bool) -> None:
        """A user thread draining the set's lane log has been blocked (or no longer is): a wait
        in the lane, for rank 0's deadlock detector."""
        self._reports.report_flush(set_id, blocked)

    def lane(self, set_id: int = 0) -> FastLane | None:
        return self._lanes.get(set_id)  # the set's fast lane, if it has one (tests, benchmarks)

    def data_path(self, set_id: int = 0) -> str | None:
        return self._executor.route_name(set_id)  # after its first collective (logs, benchmarks)

    @property
    def error(self) -> HoraInternalError | None:
        return self._error

    def _halt(self) -> None:
        self._stopping = True
        self._stop.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread: pending ops fail with ShutdownError; tell the coordinator we left."""
        self._halt()
        self.transport.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self.timeline.stop()
        self.transport.close()

    # ---- background thread -------------------------------------------------------------------
    def _run(self) -> None:
        if self._cpu_core is not None:
            try:
                affinity.pin_current_thread(self._cpu_core)
                log.info("background threads pinned to core %d (HOROVOD_THREAD_AFFINITY)",
                         self._cpu_core)
            except OSError as exc:  # checked at init(); the core may have gone offline since
                log.error("could not pin the background threads to core %d "
                          "(HOROVOD_THREAD_AFFINITY): %s", self._cpu_core, exc)
        check_every = max(0.5, min(5.0, self.config.stall_check_time_seconds / 4))
        next_check = time.monotonic() + check_every
        deadlock_every = max(0.02, min(0.1, self.config.deadlock_time_seconds / 8))
        next_deadlock = 0.0
        try:
            while not self._stop.is_set():
                if self._lane_error is not None:
                    self._responses.executing = True  # a lane op failed: gather the reasons
                    raise self._lane_error
                self.timeline.mark_cycle()
                self._liveness.beat()
                busy = self._take_submissions()
                busy = self._send_waits() or busy
                busy = self._receive(0.0) or busy
                if self._cross is not None:  # (rank 0 and the hosts' leaders: the patience)
                    busy = self._cross.poll() or busy
                coordinator = self._coordinator
                if coordinator is not None:
                    now = time.monotonic()
                    if now >= next_check:
                        next_check = now + check_every
                        self._dispatch(coordinator.check_stalls())
                    if coordinator.deadlocks.has_waits() and now >= next_deadlock:
                        next_deadlock = now + deadlock_every
                        failed, lanes = coordinator.deadlocks.check(now)
                        close_lanes(lanes, self.registry, self._lanes.close, self._departed,
                                    self._responses.send_ordered)
                        self._dispatch(failed)
                    busy = self.tuning.poll() or busy  # (between batches of responses)
                    busy = self._dispatch(coordinator.ready()) or busy
                if not busy and not self._stop.is_set():
                    # Nothing to do: sleep until a control message, a submission (wake) or the
                    # next stall check. Whatever arrives is handled on the next pass.
                    wait: float | None = None
                    if coordinator is not None:
                        due = min(next_check, coordinator.next_deadline() or next_check)
                        if coordinator.deadlocks.has_waits():
                            due = min(due, next_deadlock)
                        wait = max(0.0, due - time.monotonic())
                    beat = self._liveness.next_beat_in()
                    if beat is not None:
                        wait = beat if wait is None else min(wait, beat)
                    self._receive(wait if self._cross is None else self._cross.due(wait))
            goodbye(self._cross, self._liveness.say_goodbye, self._coordinator is not None)
        except HoraError as exc:
            self._abort(exc)
        except Exception as exc:  # a bug: fail every op of this rank, abort the job
            log.exception("hora's engine thread failed")
            self._error = self._error or errors.internal_error("hora's engine thread", exc)
            self._abort(self._error)  # (if it raises, the ops still fail below)
        finally:
            for step in (partial(self._lanes.stop_all, self._error), self._executor.close):
                try:  # lanes, then shared memory (unmap, unlink); a raise must not skip _fail_all
                    step()
                except Exception:  # noqa: BLE001
                    log.exception("hora: winding the engine down failed")
            self._fail_all(self._final_error())

    def _take_submissions(self) -> bool:
        requests: list[Request] = []
        while self._queue:
            entry = self._queue.popleft()
            self._responses.expect(entry)
            requests.append(entry.request)
        if not requests:
            return False
        if self._cross is not None:
            requests = self._cross.submit(requests)  # hits: marked ready, not requested
            if not requests:
                return True
        if self._coordinator is not None:
            trace.negotiation_ready(self.timeline, self.registry, requests)
            self._coordinator.add(requests)
        else:
            if self.timeline.recording:  # per-rank files: this rank's own wait for the others
                for req in requests:
                    self.timeline.negotiate_start(req.name, req.kind)
            self.transport.send_control(0, encode(MSG_REQUESTS, reqs=requests))
        return True

    def _receive(self, wait: float | None) -> bool:
        """Handle every control message available; block up to ``wait`` for the first.

        Returns True if any message was handled.
        """
        timeout = wait
        if self._queue or self._stop.is_set():
            timeout = 0.0
        handled = False
        while True:
            try:
                msg = self.transport.recv_control(timeout)
            except PeerLostError as exc:
                if exc.peer is not None and (exc.peer in self._departed or self._cross
                                             is not None and self._cross.lost(exc)):
                    continue  # it said goodbye first: a clean exit
                raise
            if msg is None:
                return handled
            timeout = 0.0
            handled = True
            sender, payload = msg
            if self._cross is None:
                if self._handle(sender, *decode(payload)):
                    return True
                continue
            for item in self._cross.take(sender, payload):  # (relays, host links, the cache)
                if self._handle(*item):
                    return True

    def _handle(self, sender: int, kind: str, body: dict[str, Any]) -> bool:
        """One control message (:meth:`_receive`'s); True when the thread must stop."""
        self._liveness.heard(sender)
        if kind == MSG_HEARTBEAT:
            pass
        elif kind == MSG_REQUESTS and self._coordinator is not None:
            for req in body["reqs"]:
                req.rank = sender  # the authenticated connection says who sent it
            trace.negotiation_ready(self.timeline, self.registry, body["reqs"])
            self._coordinator.add(body["reqs"])
        elif kind == MSG_RESPONSES and self._coordinator is None:
            trace.negotiation_done(self.timeline, body["resps"])
            self._responses.execute(body["resps"])
        elif kind == MSG_WAITS and self._coordinator is not None:
            for blocked, set_id, name, lane in parse_waits(body):
                self._coordinator.deadlocks.waiting(sender, blocked, set_id, name, lane)
        elif kind == MSG_PARAMS and self._coordinator is None:
            self.tuning.receive(body)
        elif kind == MSG_LANE_OFF and self._coordinator is None:
            lane_set = body.get("set")
            if isinstance(lane_set, int):
                self._lanes.close(lane_set)
        elif kind == MSG_BYE and self._coordinator is not None:
            self._liveness.depart(sender)
            self._coordinator.depart(sender, "it called shutdown() or exited")
        elif kind == MSG_SHUTDOWN:
            self._error = ShutdownError(
                "Horovod has been shut down: rank 0 called shutdown() or exited; no more "
                "collectives can run in this job.")
            self._halt()
            return True
        elif kind == MSG_ABORT:
            raise RemoteAbort(str(body.get("reason", "another rank failed")), sender)
        return self._stop.is_set()

    # ---- shutdown and failure ------------------------------------------------------------------
    def _abort(self, exc: HoraError) -> None:
        """Fail this rank loudly: unblock peers at once, tell the others, collect their causes."""
        remote = isinstance(exc, RemoteAbort)
        error = (HoraInternalError(str(exc)) if remote or not isinstance(exc, HoraInternalError)
                 else exc)
        self.transport.shutdown_data()  # peers blocked on our data get EOF now, not a timeout
        self._liveness.send_abort(exc)
        if self._responses.executing and not remote:
            # A data-plane error may only be an echo (a peer that failed first shut its data
            # down): add what the other ranks report, so the message names the root cause.
            others = self._liveness.gather_abort_reasons(
                ABORT_GATHER_SECONDS, exc.peer if isinstance(exc, PeerLostError) else None)
            if others:
                reasons = " | ".join(others)
                error = errors.copy_error(error, f"{error}; other ranks report: {reasons}")
        if self._error is None:
            self._error = error
        log.error("%s", self._error)
        self.timeline.fail_all(str(self._error))
        self._halt()

    def _fail_all(self, error: HoraInternalError) -> None:
        self._drained = True  # before draining: see _enqueue
        self._executor.fail_unfinished(error)  # a failed collective's ops: the merged error
        while self._queue:
            self._responses.expect(self._queue.popleft())
        self._responses.fail_all(error)
