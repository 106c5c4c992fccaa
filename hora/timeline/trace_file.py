"""One timeline file: Horovod's Chrome-trace format, written by a thread off the engine's.

:class:`TraceFile` receives the hook records of :class:`hora.timeline.writer.Timeline` through a
bounded queue (``put`` only appends), and its writer thread turns them into JSON, keeping per-name
state as Horovod's TimelineState does, and writes them.

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
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from hora._util.log import get_logger

log = get_logger(__name__)

CYCLE_START = "CYCLE_START"
ERROR = "ERROR"
TIMELINE_STOPPED = "TIMELINE_STOPPED"
"""Global instant event written when recording stops cleanly (``stop_timeline``, shutdown): what
is still open then was in flight, not cut off by a crash."""

MAX_ERROR_CHARS = 2000
"""Longest error text copied into an ``ERROR`` event."""

# Hook record codes: (code, perf_counter_ns, name, a, b)
REC_NEG_START, REC_NEG_READY, REC_NEG_END, REC_OP_START, REC_ACT_START, REC_ACT_END, REC_OP_END, \
    REC_ERROR, REC_CYCLE, REC_FAIL_ALL = range(10)

# Per-name state in the writer (Horovod's TimelineState).
_UNKNOWN, _NEGOTIATING, _TOP_LEVEL, _ACTIVITY = range(4)


def kind_text(kind: Any) -> str:
    """An op kind's name in the trace (a string, or a string enum's value)."""
    value = getattr(kind, "value", kind)
    return str(value)


class TraceFile:
    """One open timeline file and the writer thread that feeds it.

    Args:
        path: the file to create (truncated if it exists).
        mark_cycles: write ``CYCLE_START`` markers (changeable while recording).
        flush_interval: seconds between writer flushes at the latest.
        max_pending: records allowed to wait for the writer before new ones are dropped.
        on_failure: called (from the writer thread) with this file when writing fails and
            recording stops.

    Raises:
        OSError: the file cannot be created (names the path).
    """

    def __init__(self, path: str, mark_cycles: bool, flush_interval: float, max_pending: int,
                 on_failure: Callable[[TraceFile], None]) -> None:
        self._on_failure = on_failure
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
            self._on_failure(self)
        except Exception:  # noqa: BLE001 - a writer bug must not go unnoticed, nor kill training
            log.exception("timeline writer for %s failed; timeline recording stops.", self.path)
            self._on_failure(self)
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
        if code == REC_CYCLE:
            out.append(f'{{"ph":"i","name":"{CYCLE_START}","ts":{ts},"pid":0,"tid":0,"s":"g"}}')
            return
        if code == REC_FAIL_ALL:
            for open_name in list(self._states):
                self._format((REC_ERROR, ns, open_name, a, None), out)
            return
        state = self._states.get(name, _UNKNOWN)
        if code == REC_NEG_READY:
            if state != _NEGOTIATING:
                self._format((REC_NEG_START, ns, name, b, None), out)
            pid = self._pid(name, out)
            out.append(f'{{"ph":"X","name":"{int(a)}","ts":{ts},"pid":{pid},"tid":0,"dur":0}}')
            return
        pid = self._pid(name, out)
        if code == REC_NEG_START:
            if state == _NEGOTIATING:
                return
            self._close_open(out, name, pid, ts)
            kind = "" if a is None else kind_text(a)
            self._begin(out, pid, f"NEGOTIATE_{kind}" if kind else "NEGOTIATE", ts)
            self._states[name] = _NEGOTIATING
        elif code == REC_NEG_END:
            if state == _NEGOTIATING:
                self._end(out, pid, ts)
                del self._states[name]
        elif code == REC_OP_START:
            self._close_open(out, name, pid, ts)
            self._begin(out, pid, kind_text(a), ts)
            self._states[name] = _TOP_LEVEL
        elif code == REC_ACT_START:
            if state == _ACTIVITY:
                self._end(out, pid, ts)
            elif state != _TOP_LEVEL:
                return  # no op open (e.g. recording started mid-op): nothing to nest it in
            self._begin(out, pid, str(a), ts)
            self._states[name] = _ACTIVITY
        elif code == REC_ACT_END:
            if state == _ACTIVITY:
                self._end(out, pid, ts)
                self._states[name] = _TOP_LEVEL
        elif code == REC_OP_END:
            if state in (_TOP_LEVEL, _ACTIVITY):
                args = json.dumps({"dtype": str(a or ""),
                                   "shape": "[" + ", ".join(str(int(d)) for d in b or ()) + "]"},
                                  separators=(",", ":"))
                self._close_open(out, name, pid, ts, args)
        elif code == REC_ERROR:
            text = str(a)[:MAX_ERROR_CHARS]
            self._close_open(out, name, pid, ts)
            args = json.dumps({"error": text}, separators=(",", ":"))
            out.append(f'{{"ph":"i","name":"{ERROR}","ts":{ts},"pid":{pid},"tid":0,"s":"p",'
                       f'"args":{args}}}')



__all__ = [
    "CYCLE_START", "ERROR", "MAX_ERROR_CHARS", "REC_ACT_END", "REC_ACT_START", "REC_CYCLE",
    "REC_ERROR", "REC_FAIL_ALL", "REC_NEG_END", "REC_NEG_READY", "REC_NEG_START", "REC_OP_END",
    "REC_OP_START", "TIMELINE_STOPPED", "TraceFile", "kind_text",
]
