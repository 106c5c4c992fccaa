"""Certain deadlocks, told apart from stalls and failed on every rank (rank 0, engine thread).

A stall is uncertain: the missing rank may still be computing. A deadlock is certain: every rank
that could release the others is itself blocked in a hora wait. Ranks report the ops they have
been blocked in for ``BLOCKED_AFTER_S`` (:meth:`DeadlockDetector.waiting`; the report travels
behind the rank's requests on one ordered connection, so the op is always known first).
:meth:`DeadlockDetector.check` then works out which blocked ranks can still be released:

* a rank that is not blocked may still submit anything;
* a blocked rank may progress if one of its ops is complete or running, or misses only ranks
  that may progress (followed through process sets and joins, to a fixed point);
* the blocked ranks left over are deadlocked. Once the same ranks have been stuck in the same
  ops for ``HORA_DEADLOCK_TIME_SECONDS`` (less the report delay), their ops fail on every member
  with one message naming each rank's op and the ranks that never submitted it.

An op waiting in a fast lane is invisible to the coordinator; when one is involved the check
asks for the set's lane to close first (that hands the op over) and decides on a later check.
The assumption it rests on: a rank whose threads are blocked submits nothing until released.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Set
from dataclasses import dataclass
from typing import Protocol

from hora._util.log import get_logger
from hora.config import Config
from hora.core.op.handle import BLOCKED_AFTER_S, Handle
from hora.core.op.messages import ERROR_DEADLOCK, MSG_LANE_OFF, OpKind, Response, Wait, encode
from hora.core.op.process_set import Registry

log = get_logger(__name__)

Key = tuple[int, str]
"""(process set id, op name)."""


LANE_FLUSH = "<fast lane flush>"
"""The op name of a wait for this rank's fast-lane log to drain (before a join)."""


def close_lanes(set_ids: list[int], registry: Registry, close: Callable[[int], None],
                departed: Set[int], send: Callable[[list[int], bytes], None]) -> None:
    """Rank 0: a suspected deadlock involves ops in these sets' fast lanes: every member
    closes its log (``close`` here, ``send``: :data:`MSG_LANE_OFF` in its place among the
    responses to the others), so the lane hands them to the coordinator, which can then judge."""
    for set_id in set_ids:
        log.debug("process set %d: closing the fast lane to look for a deadlock", set_id)
        for peer in registry.ranks(set_id) or []:
            if peer == 0:
                close(set_id)
            elif peer not in departed:
                send([peer], encode(MSG_LANE_OFF, set=set_id))


class WaitReports:
    """Every rank's side: waits that lasted ``BLOCKED_AFTER_S`` (and their ends), queued by user
    threads and sent by the engine thread, behind the requests it has queued, so the
    coordinator never sees a wait before the op."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._queue: deque[Wait] = deque()

    def report(self, handle: Handle, blocked: bool) -> None:
        """Every op's :attr:`~hora.core.op.handle.Handle.report_wait` (a user thread): it has
        waited for ``handle``'s op (``blocked``), or that wait ended; a wait in a fast lane
        (the handle has a ``runner``) is reported as one."""
        self._queue.append((blocked, handle.set_id, handle.name, handle.runner is not None))
        self._wake()

    def report_flush(self, set_id: int, blocked: bool) -> None:
        """A join / remove_process_set waits for this rank's fast-lane log of ``set_id``."""
        self._queue.append((blocked, set_id, LANE_FLUSH, True))
        self._wake()

    def drain(self) -> list[Wait]:
        """The reports queued so far (engine thread)."""
        out = []
        while self._queue:
            out.append(self._queue.popleft())
        return out


class PendingOps(Protocol):
    """What the detector reads of (and does to) the coordinator's table of pending ops."""

    def submitted(self, key: Key) -> set[int] | None:
        """Ranks that submitted ``key`` while it waits for others; None if it is not waiting."""
        ...

    def is_pending(self, key: Key) -> bool: ...

    def group_siblings(self, key: Key) -> list[Key]:
        """The other pending members of the grouped op ``key`` belongs to."""
        ...

    def joined(self, set_id: int) -> list[int]: ...

    def departed(self) -> set[int]: ...

    def forget(self, key: Key) -> None:
        """Drop a failed op (``join``: the set's pending joins)."""
        ...


@dataclass
class _Wait:
    """A rank blocked in a wait on one op (``count`` threads)."""

    count: int
    lane: bool  # the op was in the fast lane when the wait began (unknown to the coordinator)


class DeadlockDetector:
    """Blocked ranks' reports, and the decision that they are deadlocked."""

    def __init__(self, registry: Registry, config: Config, pending: PendingOps) -> None:
        self._registry = registry
        self._config = config
        self._pending = pending
        self._waits: dict[int, dict[Key, _Wait]] = {}
        self._suspect: tuple[object, ...] | None = None
        self._suspect_since = 0.0

    def waiting(self, rank: int, blocked: bool, set_id: int, name: str, lane: bool) -> None:
        """``rank`` started (``blocked``) or stopped waiting for op ``name`` of ``set_id``."""
        ops = self._waits.setdefault(rank, {})
        key = (set_id, name)
        wait = ops.get(key)
        if blocked:
            if wait is None:
                ops[key] = _Wait(1, lane)
            else:
                wait.count += 1
        elif wait is not None:
            wait.count -= 1
            if wait.count <= 0:
                del ops[key]
        if not ops:
            del self._waits[rank]

    def has_waits(self) -> bool:
        return bool(self._waits)

    def check(self, now: float | None = None) -> tuple[list[Response], list[int]]:
        """Fail the ops of ranks that are certainly deadlocked.

        Returns the ERROR responses to dispatch and the process sets whose fast lanes must close
        first: before a decision, because an op waiting in a lane is invisible here (closing the
        lane hands it over, and a later check decides); with a decision, because the failed ops
        leave the members' lane logs out of step (a completed join reopens the lane).
        """
        limit = self._config.deadlock_time_seconds
        if not self._waits or limit <= 0:
            self._suspect = None
            return [], []
        now = time.monotonic() if now is None else now
        stuck = self._stuck()
        if not stuck:
            self._suspect = None
            return [], []
        signature = tuple((r, tuple(sorted(self._waits[r]))) for r in stuck)
        if signature != self._suspect:
            self._suspect, self._suspect_since = signature, now
            return [], []
        hidden = {key[0] for r in stuck for key, w in self._waits[r].items()
                  if w.lane and key[1] != "join" and not self._pending.is_pending(key)}
        if hidden:  # (asked again at every check until the ops show up: closing is idempotent)
            return [], sorted(hidden)
        if now - self._suspect_since < max(0.0, limit - BLOCKED_AFTER_S):
            return [], []
        self._suspect = None
        failed = self._declare(stuck)
        return failed, sorted({resp.set_id for resp in failed})

    # ---- the decision ------------------------------------------------------------------------
    def _missing(self, key: Key, members: list[int]) -> list[int] | None:
        """Ranks whose action op ``key`` still needs; None when unknown here (it already ran,
        runs now, or sits in a fast lane)."""
        joined = self._pending.joined(key[0])
        if key[1] == "join":
            return [r for r in members if r not in joined]
        submitted = self._pending.submitted(key)
        if submitted is None:
            return None
        return [r for r in members if r not in submitted and r not in joined]

    def _stuck(self) -> list[int]:
        """Blocked ranks that can never be released (see the module docstring)."""
        world = self._registry.ranks(0) or []
        progress = {r for r in world if r not in self._waits} | self._pending.departed()
        changed = True
        while changed:
            changed = False
            for rank, ops in self._waits.items():
                if rank not in progress and any(self._may_finish(rank, key, wait, progress)
                                                for key, wait in ops.items()):
                    progress.add(rank)
                    changed = True
        return sorted(r for r in self._waits if r not in progress)

    def _may_finish(self, rank: int, key: Key, wait: _Wait, progress: set[int]) -> bool:
        members = self._registry.ranks(key[0])
        if members is None:
            return True
        missing = self._missing(key, members)
        if missing is not None and rank in missing and not wait.lane and key[1] != "join":
            # The pending op of this name lacks this very rank: it is a later one (the others
            # are ahead), since a rank's request always arrives before its wait report; this
            # rank's own op has run or runs now, and its wait ends without anyone else.
            return True
        if missing is None and wait.lane:  # in the lane: it needs some member not blocked in
            others = [r for r in members  # the same op (optimistic: one that may progress)
                      if r != rank and key not in self._waits.get(r, {})]
            return any(r in progress for r in others) or not others
        return missing is None or all(r in progress for r in missing)

    def _declare(self, stuck: list[int]) -> list[Response]:
        parts: list[str] = []
        keys: list[Key] = []
        for rank in stuck:
            for key in sorted(self._waits[rank]):
                missing = self._missing(key, self._registry.ranks(key[0]) or []) or []
                verb = "never joined" if key[1] == "join" else "never submitted"
                where = f" of process set {key[0]}" if key[0] != 0 else ""
                who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
                parts.append(f"rank {rank} waits in {key[1]}{where}, which {who} {verb}")
                # a group completes as a whole: its other pending members fail with it
                keys += [k for k in (key, *self._pending.group_siblings(key)) if k not in keys]
        message = (
            f"Deadlock: ranks {stuck} are all blocked and none of their ops can ever complete: "
            + "; ".join(parts) + ". hora fails these ops on every rank instead of hanging "
            f"(HORA_DEADLOCK_TIME_SECONDS={self._config.deadlock_time_seconds:g}). HINT: every "
            "rank must run the same collectives in the same order; a rank that skipped one (an "
            "exception it caught, a rank-dependent branch, an early exit from a loop) leaves the "
            "others waiting.")
        log.error("%s", message)
        for key in keys:
            self._pending.forget(key)
        return [Response(kind=OpKind.ERROR, names=[name], set_id=set_id, error=message,
                         value=ERROR_DEADLOCK) for set_id, name in keys]
