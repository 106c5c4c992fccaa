"""The timeline writer: Horovod's Chrome-trace timeline (``HOROVOD_TIMELINE``), written off-thread.

Observability layer under the engine: the engine's background thread calls the hooks of
:class:`Timeline` (``negotiate_*``, ``op_start``, ``activity_*``, ``op_end``, ``mark_cycle``);
each hook only appends a small tuple to a queue (a no-op returning at once when nothing is being
recorded), and a writer thread turns the queue into JSON and writes it: woken when the queue
stops being empty (so an event is on disk within milliseconds: tools and tests tail the file
while the job runs), and at least every ``flush_interval`` seconds. While events arrive faster
than it writes, the writer batches them without further wake-ups. The engine thread never
formats, never touches the file and never waits for the disk.

File format: Horovod's Chrome trace (opens in Perfetto / ``chrome://tracing``), valid after every
flush; :mod:`hora.timeline.trace_file` describes it and holds the writer thread.

Which rank writes: only the coordinator (rank 0), which sees every rank's readiness through
negotiation (Horovod's behaviour). With ``all_ranks=True`` every other rank ``r`` also records
the hooks it is given (its own execution phases) into ``<stem>.rank<r><suffix>`` next to rank 0's
file (:func:`rank_path`); rank 0's file keeps its usual name. ``HOROVOD_TIMELINE=DYNAMIC``
enables the machinery without creating any file until :meth:`Timeline.start`.

Hooks must be called from one thread (the engine's) so that their order is the order of events;
:meth:`Timeline.start` / :meth:`Timeline.stop` may be called from any thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from hora._util.log import get_logger
from hora.timeline.trace_file import (
    REC_ACT_END,
    REC_ACT_START,
    REC_CYCLE,
    REC_ERROR,
    REC_FAIL_ALL,
    REC_NEG_END,
    REC_NEG_READY,
    REC_NEG_START,
    REC_OP_END,
    REC_OP_START,
    TraceFile,
    kind_text,
)

log = get_logger(__name__)

DYNAMIC = "DYNAMIC"
"""``HOROVOD_TIMELINE`` value meaning "enable, but record nothing until ``start_timeline``"."""

# Activity names (Horovod's spellings where Horovod has one).
QUEUE = "QUEUE"
WAIT_FOR_DATA = "WAIT_FOR_DATA"
WAIT_FOR_OTHER_TENSOR_DATA = "WAIT_FOR_OTHER_TENSOR_DATA"
INIT_FUSION_BUFFER = "INIT_FUSION_BUFFER"
MEMCPY_IN_FUSION_BUFFER = "MEMCPY_IN_FUSION_BUFFER"
MEMCPY_OUT_FUSION_BUFFER = "MEMCPY_OUT_FUSION_BUFFER"
ALLOCATE_OUTPUT = "ALLOCATE_OUTPUT"

DEFAULT_FLUSH_INTERVAL = 0.25
"""Seconds between writer-thread flushes: the most a crash can lose of an otherwise good file."""

DEFAULT_MAX_PENDING = 1_000_000
"""Hook records allowed to wait for the writer; beyond it records are dropped (and counted), so a
stalled disk can never grow the engine's memory without bound."""


def collective_activity(algorithm: str, kind: Any) -> str:
    """The activity name of a collective step: ``("ring", "ALLREDUCE") -> "RING_ALLREDUCE"``.

    Args:
        algorithm: the algorithm that runs (``"ring"``, ``"small"``, ``"star"``, ``"tree"``,
            ``"shm"``, ...).
        kind: the op kind (a string or a string enum such as ``OpKind.ALLREDUCE``).
    """
    return f"{algorithm.upper()}_{kind_text(kind)}"


def rank_path(path: str, rank: int) -> str:
    """Where rank ``rank`` writes with ``all_ranks``: ``t.json`` -> ``t.rank3.json``.

    Rank 0 keeps ``path`` itself (it is the Horovod-compatible, coordinator's-view file).
    """
    if rank == 0:
        return path
    stem, suffix = os.path.splitext(path)
    return f"{stem}.rank{rank}{suffix}"


def is_dynamic(value: str) -> bool:
    """True for ``HOROVOD_TIMELINE=DYNAMIC`` (any letter case): enabled, no file yet."""
    return value.strip().upper() == DYNAMIC


class Timeline:
    """Timeline recording for one rank. Hooks are cheap no-ops unless recording.

    Args:
        rank: this process's global rank. Only rank 0 writes unless ``all_ranks``.
        enabled: ``HOROVOD_TIMELINE`` was set (to a file or ``DYNAMIC``); without it
            :meth:`start` raises ``ValueError`` as Horovod's ``start_timeline`` does.
        all_ranks: ranks other than 0 also write their own file (:func:`rank_path`).
        flush_interval: seconds between writer flushes.
        max_pending: records allowed to wait for the writer before new ones are dropped.
    """

    def __init__(self, rank: int = 0, *, enabled: bool = False, all_ranks: bool = False,
                 flush_interval: float = DEFAULT_FLUSH_INTERVAL,
                 max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self.rank = rank
        self.enabled = enabled
        self.all_ranks = all_ranks
        self._flush_interval = flush_interval
        self._max_pending = max_pending
        self._session: TraceFile | None = None
        self._path: str | None = None  # what start() was last given (all ranks, for no-ops)
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Any, rank: int, *, all_ranks: bool | None = None) -> Timeline:
        """Build from a :class:`~hora.config.Config` at ``init`` and start it if a file is set.

        Reads ``config.timeline`` (a path, ``DYNAMIC`` or empty), ``config.timeline_mark_cycles``
        and, when the knob exists, ``config.timeline_all_ranks``. A file that cannot be created
        is logged at error level and the job goes on without a timeline (Horovod's behaviour).
        """
        value = str(getattr(config, "timeline", "") or "").strip()
        if all_ranks is None:
            all_ranks = bool(getattr(config, "timeline_all_ranks", False))
        timeline = cls(rank, enabled=bool(value), all_ranks=all_ranks)
        if value and not is_dynamic(value):
            try:
                timeline.start(value, bool(getattr(config, "timeline_mark_cycles", False)))
            except OSError as exc:
                log.error("%s; the job goes on without a timeline.", exc)
        return timeline

    # ---- control (any thread) --------------------------------------------------------------------
    @property
    def recording(self) -> bool:
        """True while this rank writes a file (use it to skip building costly hook arguments)."""
        return self._session is not None

    @property
    def path(self) -> str | None:
        """The file this rank writes, or None."""
        session = self._session
        return None if session is None else session.path

    def start(self, path: str, mark_cycles: bool = False) -> None:
        """Start recording to ``path`` (Horovod's ``start_timeline``); blocks until switched.

        Starting again with the current path is a no-op; another path closes the current file
        first. On ranks that do not write (not 0, no ``all_ranks``) this only remembers the path.

        Raises:
            ValueError: the timeline was not enabled (``HOROVOD_TIMELINE`` unset at ``init``), or
                ``path`` is empty or ``DYNAMIC``.
            OSError: the file cannot be created (names the path).
        """
        if not self.enabled:
            raise ValueError("Set HOROVOD_TIMELINE=DYNAMIC (or HORA_TIMELINE=DYNAMIC) before "
                             "init() to use start_timeline(); the timeline machinery is set up "
                             "only at init.")
        if not path or is_dynamic(path):
            raise ValueError(f"start_timeline needs a file path, not {path!r}")
        with self._lock:
            if path == self._path:
                session = self._session
                if session is not None:
                    session.mark_cycles = mark_cycles
                return
            self._stop_locked()
            self._path = path
            if self.rank != 0 and not self.all_ranks:
                return
            target = rank_path(path, self.rank)
            self._session = TraceFile(target, mark_cycles, self._flush_interval,
                                      self._max_pending, self._session_failed)

    def stop(self) -> None:
        """Stop recording and close the file (Horovod's ``stop_timeline``); idempotent."""
        with self._lock:
            if self._path is None and self._session is None:
                log.debug("stop_timeline: the timeline is not running")
            self._stop_locked()
            self._path = None

    def _stop_locked(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def _session_failed(self, session: TraceFile) -> None:
        if self._session is session:
            self._session = None

    # ---- hooks (engine thread; each a no-op unless recording) ------------------------------------
    def negotiate_start(self, name: str, op_kind: Any) -> None:
        """The coordinator saw ``name`` for the first time (``B NEGOTIATE_<KIND>``).

        A repeated call while ``name`` is negotiating is ignored (first call wins).
        """
        s = self._session
        if s is not None:
            s.put((REC_NEG_START, time.perf_counter_ns(), name, op_kind, None))

    def negotiate_rank_ready(self, name: str, rank: int, op_kind: Any = None) -> None:
        """``rank`` (within the op's process set) submitted ``name``: an ``X`` tick.

        With ``op_kind`` it also starts the negotiation if this is the first tick, so the
        engine may call only this hook per received request.
        """
        s = self._session
        if s is not None:
            s.put((REC_NEG_READY, time.perf_counter_ns(), name, rank, op_kind))

    def negotiate_end(self, name: str) -> None:
        """Every rank is ready (or the op failed negotiation): ``E`` of the negotiation."""
        s = self._session
        if s is not None:
            s.put((REC_NEG_END, time.perf_counter_ns(), name, None, None))

    def op_start(self, name: str, op_kind: Any) -> None:
        """Execution of ``name`` begins: ``B <KIND>`` (closes a negotiation left open)."""
        s = self._session
        if s is not None:
            s.put((REC_OP_START, time.perf_counter_ns(), name, op_kind, None))

    def activity_start(self, name: str, activity: str) -> None:
        """A phase of the op's execution begins (ends the previous activity, if one is open)."""
        s = self._session
        if s is not None:
            s.put((REC_ACT_START, time.perf_counter_ns(), name, activity, None))

    def activity_end(self, name: str) -> None:
        """The current activity of ``name`` ends."""
        s = self._session
        if s is not None:
            s.put((REC_ACT_END, time.perf_counter_ns(), name, None, None))

    def activity_start_all(self, names: Iterable[str], activity: str) -> None:
        """:meth:`activity_start` for every name of a fused response (one timestamp)."""
        s = self._session
        if s is not None:
            now = time.perf_counter_ns()
            for name in names:
                s.put((REC_ACT_START, now, name, activity, None))

    def activity_end_all(self, names: Iterable[str]) -> None:
        """:meth:`activity_end` for every name of a fused response (one timestamp)."""
        s = self._session
        if s is not None:
            now = time.perf_counter_ns()
            for name in names:
                s.put((REC_ACT_END, now, name, None, None))

    def op_end(self, name: str, dtype: str = "", shape: Sequence[int] | None = None) -> None:
        """``name`` completed: closes its activity and the op (``E`` with dtype and shape)."""
        s = self._session
        if s is not None:
            s.put((REC_OP_END, time.perf_counter_ns(), name, dtype, shape))

    def error(self, name: str, message: str) -> None:
        """``name`` failed: closes whatever is open for it and adds an ``ERROR`` instant event."""
        s = self._session
        if s is not None:
            s.put((REC_ERROR, time.perf_counter_ns(), name, message, None))

    def fail_all(self, message: str) -> None:
        """The engine is failing: :meth:`error` for every name that has an open event."""
        s = self._session
        if s is not None:
            s.put((REC_FAIL_ALL, time.perf_counter_ns(), "", message, None))

    def mark_cycle(self) -> None:
        """A new engine cycle begins (written only when cycle marking is on)."""
        s = self._session
        if s is not None and s.mark_cycles:
            s.put((REC_CYCLE, time.perf_counter_ns(), "", None, None))


__all__ = [
    "ALLOCATE_OUTPUT", "DYNAMIC", "INIT_FUSION_BUFFER", "MEMCPY_IN_FUSION_BUFFER",
    "MEMCPY_OUT_FUSION_BUFFER", "QUEUE", "WAIT_FOR_DATA", "WAIT_FOR_OTHER_TENSOR_DATA", "Timeline",
    "collective_activity", "is_dynamic", "rank_path",
]
