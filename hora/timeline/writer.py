"""The timeline writer: Horovod's Chrome-trace timeline (``HOROVOD_TIMELINE``), written off-thread.

Observability layer under the engine: the engine's background thread calls the hooks of
:class:`Timeline` (``negotiate_*``, ``op_start``, ``activity_*``, ``op_end``, ``mark_cycle``);
each hook only appends a small tuple to a queue (a no-op returning at once when nothing is being
recorded), and a writer thread turns the queue into JSON and writes it: woken when the queue
stops being empty (so an event is on disk within milliseconds: tools and tests tail the file
while the job runs), and at least every ``flush_interval`` seconds. While events arrive faster
than it writes, the writer batches them without further wake-ups. The engine thread never
formats, never touches the file and never waits for the disk.

File format (Horovod's, opens in Perfetto / ``chrome://tracing``): a JSON array that is valid
after every flush (the closing ``]`` is rewritten each time), so a job that crashes leaves at
worst a file whose last flush is missing its end (``hora timeline`` reads those too).

* ``pid 0`` carries ``process_name`` metadata whose args hold ``start_time_since_epoch_in_micros``;
* every tensor name is a trace "process" with its own ``pid`` (1, 2, ... in order of first
  use), introduced by ``process_name`` / ``process_sort_index`` metadata;
* per op: ``B NEGOTIATE_<KIND>`` when the coordinator first sees the name, an ``X`` event with
  ``dur 0`` named by the rank (within the process set) each time a rank reports ready, ``E``
  when negotiation ends; then ``B <KIND>`` when execution starts, nested activity ``B``/``E``
  pairs (one at a time: ``QUEUE``, ``MEMCPY_IN_FUSION_BUFFER``, ``RING_ALLREDUCE``, ...), and a
  final ``E`` whose args are ``{"dtype": ..., "shape": "[d0, d1]"}``;
* ``ts`` is integer microseconds since the timeline started; ``E`` events carry no name;
* cycle markers: global instant events ``{"ph": "i", "name": "CYCLE_START", "s": "g"}``;
* hora additions: an ``ERROR`` instant event (args ``error``) on an op that failed, a global
  ``TIMELINE_STOPPED`` instant event when recording stops cleanly, and ``"tid": 0`` on every
  event (some viewers want it).

Which rank writes: only the coordinator (rank 0), which sees every rank's readiness through
negotiation (Horovod's behaviour). With ``all_ranks=True`` every other rank ``r`` also records
the hooks it is given (its own execution phases) into ``<stem>.rank<r><suffix>`` next to rank 0's
file (:func:`rank_path`); rank 0's file keeps its usual name. ``HOROVOD_TIMELINE=DYNAMIC``
enables the machinery without creating any file until :meth:`Timeline.start`.

Hooks must be called from one thread (the engine's) so that their order is the order of events;
:meth:`Timeline.start` / :meth:`Timeline.stop` may be called from any thread.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from hora._util.log import get_logger

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
CYCLE_START = "CYCLE_START"
ERROR = "ERROR"
TIMELINE_STOPPED = "TIMELINE_STOPPED"
"""Global instant event written when recording stops cleanly (``stop_timeline``, shutdown): what
is still open then was in flight, not cut off by a crash."""

DEFAULT_FLUSH_INTERVAL = 0.25
"""Seconds between writer-thread flushes: the most a crash can lose of an otherwise good file."""

DEFAULT_MAX_PENDING = 1_000_000
"""Hook records allowed to wait for the writer; beyond it records are dropped (and counted), so a
stalled disk can never grow the engine's memory without bound."""

MAX_ERROR_CHARS = 2000
"""Longest error text copied into an ``ERROR`` event."""

# Hook record codes: (code, perf_counter_ns, name, a, b)
_NEG_START, _NEG_READY, _NEG_END, _OP_START, _ACT_START, _ACT_END, _OP_END, _ERROR, _CYCLE, \
    _FAIL_ALL = range(10)

# Per-name state in the writer (Horovod's TimelineState).
_UNKNOWN, _NEGOTIATING, _TOP_LEVEL, _ACTIVITY = range(4)


def collective_activity(algorithm: str, kind: Any) -> str:
    """The activity name of a collective step: ``("ring", "ALLREDUCE") -> "RING_ALLREDUCE"``.

    Args:
        algorithm: the algorithm that runs (``"ring"``, ``"small"``, ``"star"``, ``"tree"``,
            ``"shm"``, ...).
        kind: the op kind (a string or a string enum such as ``OpKind.ALLREDUCE``).
    """
    return f"{algorithm.upper()}_{_kind_text(kind)}"


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


def _kind_text(kind: Any) -> str:
    value = getattr(kind, "value", kind)
    return str(value)


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
        self._session: _Session | None = None
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
            self._session = _Session(self, target, mark_cycles, self._flush_interval,
                                     self._max_pending)

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

    def _session_failed(self, session: _Session) -> None:
        if self._session is session:
            self._session = None

    # ---- hooks (engine thread; each a no-op unless recording) ------------------------------------
    def negotiate_start(self, name: str, op_kind: Any) -> None:
        """The coordinator saw ``name`` for the first time (``B NEGOTIATE_<KIND>``).

        A repeated call while ``name`` is negotiating is ignored (first call wins).
        """
        s = self._session
        if s is not None:
            s.put((_NEG_START, time.perf_counter_ns(), name, op_kind, None))

    def negotiate_rank_ready(self, name: str, rank: int, op_kind: Any = None) -> None:
        """``rank`` (within the op's process set) submitted ``name``: an ``X`` tick.

        With ``op_kind`` it also starts the negotiation if this is the first tick, so the
        engine may call only this hook per received request.
        """
        s = self._session
        if s is not None:
            s.put((_NEG_READY, time.perf_counter_ns(), name, rank, op_kind))

    def negotiate_end(self, name: str) -> None:
        """Every rank is ready (or the op failed negotiation): ``E`` of the negotiation."""
        s = self._session
        if s is not None:
            s.put((_NEG_END, time.perf_counter_ns(), name, None, None))

    def op_start(self, name: str, op_kind: Any) -> None:
        """Execution of ``name`` begins: ``B <KIND>`` (closes a negotiation left open)."""
        s = self._session
        if s is not None:
            s.put((_OP_START, time.perf_counter_ns(), name, op_kind, None))

    def activity_start(self, name: str, activity: str) -> None:
        """A phase of the op's execution begins (ends the previous activity, if one is open)."""
        s = self._session
        if s is not None:
            s.put((_ACT_START, time.perf_counter_ns(), name, activity, None))

    def activity_end(self, name: str) -> None:
        """The current activity of ``name`` ends."""
        s = self._session
        if s is not None:
            s.put((_ACT_END, time.perf_counter_ns(), name, None, None))

    def activity_start_all(self, names: Iterable[str], activity: str) -> None:
        """:meth:`activity_start` for every name of a fused response (one timestamp)."""
        s = self._session
        if s is not None:
            now = time.perf_counter_ns()
            for name in names:
                s.put((_ACT_START, now, name, activity, None))

    def activity_end_all(self, names: Iterable[str]) -> None:
        """:meth:`activity_end` for every name of a fused response (one timestamp)."""
        s = self._session
        if s is not None:
            now = time.perf_counter_ns()
            for name in names:
                s.put((_ACT_END, now, name, None, None))

    def op_end(self, name: str, dtype: str = "", shape: Sequence[int] | None = None) -> None:
        """``name`` completed: closes its activity and the op (``E`` with dtype and shape)."""
        s = self._session
        if s is not None:
            s.put((_OP_END, time.perf_counter_ns(), name, dtype, shape))

    def error(self, name: str, message: str) -> None:
        """``name`` failed: closes whatever is open for it and adds an ``ERROR`` instant event."""
        s = self._session
        if s is not None:
            s.put((_ERROR, time.perf_counter_ns(), name, message, None))

    def fail_all(self, message: str) -> None:
        """The engine is failing: :meth:`error` for every name that has an open event."""
        s = self._session
        if s is not None:
            s.put((_FAIL_ALL, time.perf_counter_ns(), "", message, None))

    def mark_cycle(self) -> None:
        """A new engine cycle begins (written only when cycle marking is on)."""
        s = self._session
        if s is not None and s.mark_cycles:
            s.put((_CYCLE, time.perf_counter_ns(), "", None, None))


class _Session:
    """One open timeline file and the writer thread that feeds it."""

    def __init__(self, owner: Timeline, path: str, mark_cycles: bool, flush_interval: float,
                 max_pending: int) -> None:
        self.owner = owner
        self.path = path
        self.mark_cycles = mark_cycles
        self.dropped = 0
        self._max_pending = max_pending
        self._interval = flush_interval
        self._queue: collections.deque[tuple[int, int, str, Any, Any]] = collections.deque()
        self._wake = threading.Event()
        self._closing = False
        self._start_ns = time.perf_counter_ns()
        epoch_us = time.time_ns() // 1000
        self._pids: dict[str, int] = {}
        self._states: dict[str, int] = {}
        try:
            self._file = open(path, "wb")  # noqa: SIM115 - closed by the writer thread
        except OSError as exc:
            raise OSError(exc.errno, f"cannot write the timeline to {path!r}: "
                          f"{exc.strerror or exc}. HINT: check that the directory exists and is "
                          "writable (HOROVOD_TIMELINE / hora run --timeline-filename)") from None
        header = (
            '[\n{"name":"process_name","ph":"M","pid":0,"tid":0,'
            f'"args":{{"name":"hora","start_time_since_epoch_in_micros":{epoch_us}}}}},\n'
            '{"name":"process_sort_index","ph":"M","pid":0,"tid":0,"args":{"sort_index":0}}'
        ).encode()
        self._file.write(header)
        self._tail_at = self._file.tell()
        self._file.write(b"\n]\n")
        self._file.flush()
        self._thread = threading.Thread(target=self._run, name="hora-timeline", daemon=True)
        self._thread.start()

    # engine thread
    def put(self, record: tuple[int, int, str, Any, Any]) -> None:
        queue = self._queue
        if len(queue) >= self._max_pending:
            self.dropped += 1
            return
        idle = not queue
        queue.append(record)
        if idle:  # the writer writes it now: events reach the file within milliseconds (a
            self._wake.set()  # busy queue batches by itself while the writer works)

    # any thread
    def close(self) -> None:
        self._closing = True
        self._wake.set()
        self._thread.join(timeout=30.0)
        if self._thread.is_alive():
            log.error("timeline writer for %s did not finish within 30 s", self.path)
        if self.dropped:
            log.warning("timeline %s: %d events were dropped because the writer fell behind",
                        self.path, self.dropped)

    # writer thread
    def _run(self) -> None:
        try:
            while True:
                self._wake.wait(self._interval)
                self._wake.clear()
                closing = self._closing
                lines = self._drain()
                if closing:
                    ts = self._ts(time.perf_counter_ns())
                    lines.append(f'{{"ph":"i","name":"{TIMELINE_STOPPED}","ts":{ts},"pid":0,'
                                 '"tid":0,"s":"g"}')
                self._write(lines)
                if closing:
                    break
        except OSError as exc:
            log.error("error writing the timeline %s (%s); timeline recording stops.",
                      self.path, exc)
            self.owner._session_failed(self)
        except Exception:  # noqa: BLE001 - a writer bug must not go unnoticed, nor kill training
            log.exception("timeline writer for %s failed; timeline recording stops.", self.path)
            self.owner._session_failed(self)
        finally:
            try:
                self._file.close()
            except OSError:
                pass

    def _drain(self) -> list[str]:
        out: list[str] = []
        queue = self._queue
        for _ in range(len(queue)):
            try:
                record = queue.popleft()
            except IndexError:
                break
            self._format(record, out)
        return out

    def _write(self, lines: list[str]) -> None:
        if not lines:
            return
        data = (",\n" + ",\n".join(lines)).encode()
        self._file.seek(self._tail_at)
        self._file.write(data)
        self._tail_at = self._file.tell()
        self._file.write(b"\n]\n")
        self._file.flush()

    # ---- record -> JSON lines (writer thread) ----------------------------------------------
    def _ts(self, ns: int) -> int:
        return (ns - self._start_ns) // 1000

    def _pid(self, name: str, out: list[str]) -> int:
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            out.append(f'{{"name":"process_name","ph":"M","pid":{pid},"tid":0,'
                       f'"args":{{"name":{json.dumps(name)}}}}}')
            out.append(f'{{"name":"process_sort_index","ph":"M","pid":{pid},"tid":0,'
                       f'"args":{{"sort_index":{pid}}}}}')
        return pid

    def _begin(self, out: list[str], pid: int, label: str, ts: int) -> None:
        out.append(f'{{"ph":"B","name":{json.dumps(label)},"ts":{ts},"pid":{pid},"tid":0}}')

    def _end(self, out: list[str], pid: int, ts: int, args: str = "") -> None:
        extra = f',"args":{args}' if args else ""
        out.append(f'{{"ph":"E","ts":{ts},"pid":{pid},"tid":0{extra}}}')

    def _close_open(self, out: list[str], name: str, pid: int, ts: int, args: str = "") -> None:
        """Emit the ``E`` events that close everything open for ``name``."""
        state = self._states.pop(name, _UNKNOWN)
        if state == _ACTIVITY:
            self._end(out, pid, ts)
            state = _TOP_LEVEL
        if state in (_TOP_LEVEL, _NEGOTIATING):
            self._end(out, pid, ts, args)

    def _format(self, record: tuple[int, int, str, Any, Any], out: list[str]) -> None:
        code, ns, name, a, b = record
        ts = self._ts(ns)
        if code == _CYCLE:
            out.append(f'{{"ph":"i","name":"{CYCLE_START}","ts":{ts},"pid":0,"tid":0,"s":"g"}}')
            return
        if code == _FAIL_ALL:
            for open_name in list(self._states):
                self._format((_ERROR, ns, open_name, a, None), out)
            return
        state = self._states.get(name, _UNKNOWN)
        if code == _NEG_READY:
            if state != _NEGOTIATING:
                self._format((_NEG_START, ns, name, b, None), out)
            pid = self._pid(name, out)
            out.append(f'{{"ph":"X","name":"{int(a)}","ts":{ts},"pid":{pid},"tid":0,"dur":0}}')
            return
        pid = self._pid(name, out)
        if code == _NEG_START:
            if state == _NEGOTIATING:
                return
            self._close_open(out, name, pid, ts)
            kind = "" if a is None else _kind_text(a)
            self._begin(out, pid, f"NEGOTIATE_{kind}" if kind else "NEGOTIATE", ts)
            self._states[name] = _NEGOTIATING
        elif code == _NEG_END:
            if state == _NEGOTIATING:
                self._end(out, pid, ts)
                del self._states[name]
        elif code == _OP_START:
            self._close_open(out, name, pid, ts)
            self._begin(out, pid, _kind_text(a), ts)
            self._states[name] = _TOP_LEVEL
        elif code == _ACT_START:
            if state == _ACTIVITY:
                self._end(out, pid, ts)
            elif state != _TOP_LEVEL:
                return  # no op open (e.g. recording started mid-op): nothing to nest it in
            self._begin(out, pid, str(a), ts)
            self._states[name] = _ACTIVITY
        elif code == _ACT_END:
            if state == _ACTIVITY:
                self._end(out, pid, ts)
                self._states[name] = _TOP_LEVEL
        elif code == _OP_END:
            if state in (_TOP_LEVEL, _ACTIVITY):
                args = json.dumps({"dtype": str(a or ""),
                                   "shape": "[" + ", ".join(str(int(d)) for d in b or ()) + "]"},
                                  separators=(",", ":"))
                self._close_open(out, name, pid, ts, args)
        elif code == _ERROR:
            text = str(a)[:MAX_ERROR_CHARS]
            self._close_open(out, name, pid, ts)
            args = json.dumps({"error": text}, separators=(",", ":"))
            out.append(f'{{"ph":"i","name":"{ERROR}","ts":{ts},"pid":{pid},"tid":0,"s":"p",'
                       f'"args":{args}}}')


__all__ = [
    "ALLOCATE_OUTPUT", "CYCLE_START", "DYNAMIC", "ERROR", "INIT_FUSION_BUFFER",
    "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER", "QUEUE", "TIMELINE_STOPPED",
    "WAIT_FOR_DATA",
    "WAIT_FOR_OTHER_TENSOR_DATA", "Timeline", "collective_activity", "is_dynamic", "rank_path",
]
