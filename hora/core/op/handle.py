"""Handles: the future every collective returns, and the integer handle table Horovod exposes.

A :class:`Handle` is completed exactly once by the engine's background thread, with a result or
an error. :class:`HandleTable` maps Horovod-style integer handles (counter starting at 1, reset
by ``shutdown``) to handles; it lives in the core so no adapter keeps its own map.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from hora._util.log import get_logger
from hora.errors import HoraInternalError, HoraTimeoutError

log = get_logger(__name__)

BLOCKED_AFTER_S = 0.25
"""A wait this long makes the waiting rank count as blocked in the op (deadlock detection)."""

LaneRunner = Callable[[Callable[[], bool], float | None], None]
"""A fast lane's drive loop, ``run(until, timeout)``: runs the lane (decides, applies decisions,
runs the collectives) on the calling thread until ``until()`` is true or ``timeout`` seconds
passed."""

WaitReporter = Callable[["Handle", bool], None]
"""The engine's report of a long wait: ``report(handle, True)`` once a wait on ``handle`` has
lasted :data:`BLOCKED_AFTER_S`, ``report(handle, False)`` when that wait ends (deadlock
detection)."""


class Handle:
    """The pending result of one collective.

    ``wait()`` returns the op's output (an array, or a tuple for alltoall) or raises the
    :class:`~hora.errors.HoraInternalError` subclass that failed it.

    Which thread runs the op: while it is in a fast lane, :attr:`runner` is the lane's drive
    loop and ``wait()`` runs the lane (and so the op) on the waiting thread; otherwise the
    engine thread (a negotiated op) or the lane's thread (a lane op nobody waits for yet) runs
    it and completes the handle, and ``wait()`` sleeps on the handle's gate.
    """

    __slots__ = ("_callbacks", "_done", "_early", "_error", "_gate", "_lock", "_result", "name",
                 "release", "report_wait", "runner", "set_id")

    def __init__(self, name: str, set_id: int = 0) -> None:
        self.name = name
        self.set_id = set_id  # the op's process set (for wait reports)
        self._done = False
        self._gate = threading.Lock()  # held until done: waiters block on it (cheaper than Event)
        self._gate.acquire()
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Handle], None]] = []
        self._early: list[Callable[[Handle], None]] = []
        self._lock = threading.Lock()
        # The lane's drive loop while the op is in a fast lane (set and cleared by the lane):
        # wait() lends the calling thread to run it. None: the op is not in a lane.
        self.runner: LaneRunner | None = None
        # The engine's: frees the op's name when it completes, before any waiter wakes (so a
        # loop may reuse the name at once); must not wait on the handle.
        self.release: Callable[[Handle], None] | None = None
        # The engine's (WaitReporter): told True when a wait has lasted BLOCKED_AFTER_S, False
        # when that wait ends; it reports blocked ranks to rank 0's deadlock detector.
        self.report_wait: WaitReporter | None = None

    def done(self) -> bool:
        """True once the op has finished (successfully or not)."""
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; return the result or raise the op's error.

        A wait that lasts longer than :data:`BLOCKED_AFTER_S` is reported to the engine (this
        rank is blocked in this op), so that the coordinator can tell a certain deadlock (every
        rank blocked, none of their ops able to complete) from a slow rank, and fail it.

        Args:
            timeout: seconds to wait, or None for no limit (the engine itself fails every
                pending op when a peer is lost or the ranks deadlock, so None cannot hang on a
                dead job).

        Raises:
            HoraTimeoutError: ``timeout`` passed first (the op keeps running).
            HoraInternalError: the op failed (mismatch, lost peer, deadlock, shutdown).
        """
        if not self._done:
            report = self.report_wait
            if report is None or (timeout is not None and timeout <= BLOCKED_AFTER_S):
                finished = self._wait_done(timeout)
            elif self._wait_done(BLOCKED_AFTER_S):
                finished = True
            else:
                report(self, True)
                try:
                    finished = self._wait_done(None if timeout is None
                                               else timeout - BLOCKED_AFTER_S)
                finally:
                    report(self, False)
            if not finished:
                raise HoraTimeoutError(
                    f"op '{self.name}' did not finish within {timeout} s; it is still pending. "
                    "Are all ranks submitting it? (the stall inspector names missing ranks)"
                )
        if self._error is not None:
            raise self._error
        return self._result

    def lane_runner(self) -> LaneRunner | None:
        """What runs this op on a waiting thread while it is in a fast lane (None: not in one)."""
        return self.runner

    def _driven(self) -> bool:
        """A waiter driving the lane may stop: the op finished or left the lane."""
        return self._done or self.runner is None

    def _wait_done(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` (None: no limit); True once done. Runs the op on this thread
        while it is in the fast lane."""
        runner = self.runner
        if runner is None:
            runner = self.lane_runner()  # (a group's: its members' lane)
        left = timeout
        if runner is not None and not self._done:
            start = time.monotonic()
            runner(self._driven, timeout)
            if timeout is not None:
                left = max(0.0, timeout - (time.monotonic() - start))
        return self._done or self._pass_gate(left)

    def _pass_gate(self, timeout: float | None) -> bool:
        gate = self._gate
        if not gate.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return False
        gate.release()  # let the next waiter through
        return True

    def result(self) -> Any:
        """Same as ``wait()``."""
        return self.wait()

    def add_done_callback(self, fn: Callable[[Handle], None], early: bool = False) -> None:
        """Call ``fn(handle)`` when done (at once if already done), on the completing thread.

        ``early`` callbacks run before any waiter wakes up (the engine uses this to free the
        op's name, so a waiter may reuse it at once); they must not wait on the handle.
        """
        with self._lock:
            if not self._done:
                (self._early if early else self._callbacks).append(fn)
                return
        try:
            fn(self)
        except Exception:
            _raised(self)

    def _finish(self, value: Any, error: BaseException | None = None) -> None:
        """Complete once. Whatever a callback raises is logged and goes no further: the handle
        is done and every waiter wakes regardless, every other callback still runs, and the
        completing thread (the engine's, failing many ops at once) goes on to the next op."""
        with self._lock:
            if self._done:
                return
            self._result, self._error = value, error
            try:
                if self.release is not None:
                    try:
                        self.release(self)
                    except Exception:
                        _raised(self)
                for fn in self._early:
                    try:
                        fn(self)
                    except Exception:
                        _raised(self)
            finally:
                self.report_wait = None  # (a waiter keeps its own reference to report the end)
                self._done = True
                self._gate.release()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                _raised(self)

    set_result = _finish
    """Complete with a result (``set_result(value)``)."""

    def set_error(self, error: BaseException) -> None:
        self._finish(None, error)


def _raised(handle: Handle) -> None:
    """Log the exception a done-callback of ``handle`` raised, which goes no further (as with
    :class:`concurrent.futures.Future`): one failing callback must not leave the handle undone,
    skip the other callbacks, or stop the engine failing the other ops."""
    log.exception("a done-callback of op '%s' raised; ignored", handle.name)


class DerivedHandle(Handle):
    """A handle whose result is ``convert(inner result)``, computed once, by the first waiter.

    Framework adapters wrap the core's handle in one of these so that ``synchronize`` returns a
    framework tensor: the conversion (``torch.from_numpy``, a copy back to a GPU, ...) runs in the
    waiting thread, never on the engine thread, and no adapter needs a map from handles to
    tensors. ``done()`` and callbacks follow the inner handle; errors pass through unchanged.
    """

    __slots__ = ("_inner", "_convert", "_converted", "_value")

    def __init__(self, inner: Handle, convert: Callable[[Any], Any]) -> None:
        super().__init__(inner.name)
        self._inner = inner
        self._convert = convert
        self._converted = False
        self._value: Any = None

    def done(self) -> bool:
        return self._inner.done()

    def wait(self, timeout: float | None = None) -> Any:
        raw = self._inner.wait(timeout)
        with self._lock:
            if not self._converted:
                self._value = self._convert(raw)
                self._converted = True
            return self._value

    def add_done_callback(self, fn: Callable[[Handle], None], early: bool = False) -> None:
        self._inner.add_done_callback(lambda _h: fn(self), early)

    def set_result(self, value: Any, error: BaseException | None = None) -> None:
        raise TypeError("a DerivedHandle is completed by its inner handle")

    def set_error(self, error: BaseException) -> None:
        raise TypeError("a DerivedHandle is completed by its inner handle")


class HandleTable:
    """Integer handles as Horovod hands them out (1, 2, 3, ...)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 1
        self._handles: dict[int, Handle] = {}

    def add(self, handle: Handle) -> int:
        with self._lock:
            key = self._next
            self._next += 1
            self._handles[key] = handle
            return key

    def get(self, key: int) -> Handle:
        with self._lock:
            handle = self._handles.get(key)
        if handle is None:
            raise ValueError(f"Handle {key} was not created or has been cleared.")
        return handle

    def pop(self, key: int) -> Handle | None:
        with self._lock:
            return self._handles.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._handles.clear()
            self._next = 1


class GroupHandle(Handle):
    """One handle for the ops of a grouped call (grouped collectives, sparse allreduce): it
    resolves to the list of the members' results, or to the first member's error.

    Waiting on it is waiting on its members: while one of them is in a fast lane, the waiter
    drives that lane (a grouped call's members share one lane unit); a wait that lasts
    :data:`BLOCKED_AFTER_S` is reported as a wait on its first unfinished member, whose name
    the coordinator knows (deadlock detection).
    """

    __slots__ = ("_count_lock", "_members", "_remaining", "_reported")

    def __init__(self, name: str, members: list[Handle]) -> None:
        super().__init__(name, members[0].set_id if members else 0)
        self._members = members
        self._remaining = len(members)
        self._count_lock = threading.Lock()  # members may complete on different threads
        self._reported: list[tuple[WaitReporter, Handle]] = []
        if not members:
            self.set_result([])
            return
        self.report_wait = self._report_members
        for m in members:
            m.add_done_callback(self._member_done)

    def _driven(self) -> bool:
        return self._done or self.lane_runner() is None

    def lane_runner(self) -> LaneRunner | None:
        for m in self._members:
            runner = m.runner
            if runner is not None and not m.done():
                return runner  # (one lane per set: any member's runner is the set's)
        return None

    def _member_done(self, member: Handle) -> None:
        moved: list[tuple[WaitReporter, Handle, bool]] = []
        with self._count_lock:
            self._remaining -= 1
            last = self._remaining == 0
            if not last and self._reported and self._reported[-1][1] is member:
                # a wait goes on: from now it is a wait on the next unfinished member
                member_report, _ = self._reported.pop()
                moved.append((member_report, member, False))
                following = self._first_unfinished()
                if following is not None:
                    self._reported.append(following)
                    moved.append((*following, True))
        for report, m, blocked in moved:
            report(m, blocked)
        if last:
            try:
                self.set_result([m.wait(0) for m in self._members])
            except BaseException as exc:  # noqa: BLE001 - propagate the first failure
                self.set_error(exc)

    def _first_unfinished(self) -> tuple[WaitReporter, Handle] | None:
        for m in self._members:
            member_report = m.report_wait
            if not m.done() and member_report is not None:
                return member_report, m
        return None

    def _report_members(self, _group: Handle, blocked: bool) -> None:
        """A wait on the group is a wait on its first unfinished member (and on the next one
        when that member completes first); the member's own reporter is kept, since a finished
        member's handle drops it."""
        with self._count_lock:
            if blocked:
                report = self._first_unfinished()
                if report is not None:
                    self._reported.append(report)
            else:
                report = self._reported.pop() if self._reported else None
        if report is not None:
            report[0](report[1], blocked)


__all__ = ["DerivedHandle", "GroupHandle", "Handle", "HandleTable", "HoraInternalError",
           "LaneRunner", "WaitReporter"]
