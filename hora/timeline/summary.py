"""``hora timeline FILE``: where a timeline's time went, and which rank kept the others waiting.

Reads a Chrome-trace timeline written by :mod:`hora.timeline.writer` (or by Horovod's
``HOROVOD_TIMELINE``) as a stream, in bounded memory (per-tensor aggregates only), and reports:

* total, mean and max time per phase (``NEGOTIATE_ALLREDUCE``, ``ALLREDUCE``, ``QUEUE``,
  ``MEMCPY_IN_FUSION_BUFFER``, ``RING_ALLREDUCE``, ...);
* the tensors that took the most time (negotiation + execution), with dtype and shape;
* stragglers: for each negotiation, the rank whose "ready" tick came last and how long the first
  rank waited for it; how often each rank was last; the worst single waits;
* errors recorded in the trace, and what was still in flight when the trace ends (a crashed or
  hung job): for a negotiation, which ranks had reported ready and which had not.

A file cut off mid-write (the job crashed) is read up to the last complete event and flagged.

Layering: runner-facing tool; imports only the base layer (never :mod:`hora.core`).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from hora.errors import TimelineFormatError

_CHUNK = 1 << 20
_DECODER = json.JSONDecoder()
_WS = " \t\r\n"


@dataclass
class ParseState:
    """How reading the file went."""

    events: int = 0
    truncated: bool = False
    stopped_at: int = -1  # character offset where reading stopped early (truncated files)
    reason: str = ""


def iter_events(fh: IO[str], state: ParseState | None = None) -> Iterator[dict[str, Any]]:
    """Yield the event objects of a timeline file one by one, reading it in chunks.

    Stops quietly at the first incomplete or corrupt event (a file truncated by a crash) and
    records that in ``state``. Non-object array elements are skipped.

    Raises:
        TimelineFormatError: the file does not start like a trace (``[`` or ``{``).
    """
    state = state if state is not None else ParseState()
    buf = fh.read(_CHUNK)
    base = 0  # file offset of buf[0]
    pos = 0
    eof = not buf
    while True:  # skip leading whitespace (reading more if the first chunk was all blank)
        while pos < len(buf) and buf[pos] in _WS:
            pos += 1
        if pos < len(buf) or eof:
            break
        more = fh.read(_CHUNK)
        eof = not more
        buf, base, pos = more, base + len(buf), 0
    if pos >= len(buf):
        raise TimelineFormatError("the file is empty")
    if buf[pos] == "{":  # {"traceEvents": [...]}: the object form; small files only
        try:
            whole = json.loads(buf[pos:] + fh.read())
        except ValueError as exc:
            raise TimelineFormatError(f"not valid JSON: {exc}") from None
        events = whole.get("traceEvents") if isinstance(whole, dict) else None
        if not isinstance(events, list):
            raise TimelineFormatError("a JSON object without a 'traceEvents' list")
        for ev in events:
            if isinstance(ev, dict):
                state.events += 1
                yield ev
        return
    if buf[pos] != "[":
        raise TimelineFormatError(f"expected a JSON array of trace events, found {buf[pos]!r} "
                                  "at the start")
    pos += 1
    while True:
        while pos < len(buf) and (buf[pos] in _WS or buf[pos] == ","):
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        if pos >= len(buf) and eof:
            state.truncated, state.stopped_at = True, base + pos
            state.reason = "the file ends before the closing ']'"
            return
        try:
            if pos >= len(buf):
                raise ValueError("need more data")
            ev, end = _DECODER.raw_decode(buf, pos)
        except ValueError as exc:
            if eof:
                state.truncated, state.stopped_at = True, base + pos
                state.reason = f"incomplete or corrupt event ({exc})"
                return
            more = fh.read(_CHUNK)
            eof = not more
            buf, base, pos = buf[pos:] + more, base + pos, 0
            continue
        pos = end
        if isinstance(ev, dict):
            state.events += 1
            yield ev


@dataclass
class PhaseStats:
    """Durations of one phase (event name) across the trace, in microseconds."""

    count: int = 0
    total: float = 0.0
    max: float = 0.0

    def add(self, dur: float) -> None:
        self.count += 1
        self.total += dur
        self.max = max(self.max, dur)


@dataclass
class TensorStats:
    """One tensor's totals, in microseconds."""

    ops: int = 0
    negotiate: float = 0.0
    execute: float = 0.0
    dtype: str = ""
    shape: str = ""
    last_counts: dict[str, int] = field(default_factory=dict)
    waited: float = 0.0  # total time the first-ready rank waited for the last one

    @property
    def total(self) -> float:
        return self.negotiate + self.execute


@dataclass(frozen=True)
class Straggle:
    """One negotiation in which ``rank`` came last, ``wait_us`` after the first rank."""

    wait_us: float
    tensor: str
    rank: str
    ts: float
    ranks_ready: int


@dataclass(frozen=True)
class InFlight:
    """An event still open when the trace ends."""

    tensor: str
    phase: str
    since: float
    ready: tuple[str, ...]  # negotiation ticks seen (rank labels), in arrival order


@dataclass
class Summary:
    """Everything ``hora timeline`` reports about one file."""

    path: str
    parse: ParseState
    start_epoch_us: int | None = None
    first_ts: float | None = None
    last_ts: float | None = None
    phases: dict[str, PhaseStats] = field(default_factory=dict)
    tensors: dict[str, TensorStats] = field(default_factory=dict)
    last_counts: dict[str, int] = field(default_factory=dict)
    wait_caused: dict[str, float] = field(default_factory=dict)
    negotiations: int = 0
    worst: list[Straggle] = field(default_factory=list)
    errors: list[tuple[float, str, str]] = field(default_factory=list)
    error_count: int = 0
    cycles: int = 0
    in_flight: list[InFlight] = field(default_factory=list)
    stopped_cleanly: bool = False  # the writer marked a clean stop (not a crash)
    ranks_seen: set[str] = field(default_factory=set)
    unmatched_ends: int = 0

    @property
    def span_us(self) -> float:
        if self.first_ts is None or self.last_ts is None:
            return 0.0
        return self.last_ts - self.first_ts


@dataclass
class _Open:
    name: str
    ts: float
    ticks: list[tuple[float, str]] = field(default_factory=list)


def summarize(fh: IO[str], path: str = "<timeline>", *, worst: int = 10,
              max_errors: int = 20) -> Summary:
    """Read a timeline from ``fh`` and aggregate it (see the module docstring).

    Args:
        fh: the file, opened as text.
        path: shown in the report.
        worst: how many of the longest straggler waits to keep.
        max_errors: how many ERROR events to keep (all are counted).

    Raises:
        TimelineFormatError: not a trace file.
    """
    summary = Summary(path=path, parse=ParseState())
    names: dict[Any, str] = {}
    stacks: dict[Any, list[_Open]] = {}
    heap: list[tuple[float, int, Straggle]] = []
    seq = 0
    for ev in iter_events(fh, summary.parse):
        ph = ev.get("ph")
        pid = ev.get("pid", 0)
        if not isinstance(pid, (int, str)):
            continue
        if ph == "M":
            raw = ev.get("args")
            meta: dict[str, Any] = raw if isinstance(raw, dict) else {}
            if ev.get("name") == "process_name":
                if "start_time_since_epoch_in_micros" in meta:
                    try:
                        summary.start_epoch_us = int(meta["start_time_since_epoch_in_micros"])
                    except (TypeError, ValueError):
                        pass
                if pid != 0 and isinstance(meta.get("name"), str):
                    names[pid] = meta["name"]
            continue
        ts_raw = ev.get("ts")
        if not isinstance(ts_raw, (int, float)) or isinstance(ts_raw, bool):
            continue
        ts = float(ts_raw)
        if summary.first_ts is None or ts < summary.first_ts:
            summary.first_ts = ts
        if summary.last_ts is None or ts > summary.last_ts:
            summary.last_ts = ts
        tensor = names.get(pid, f"pid {pid}")
        stack = stacks.setdefault(pid, [])
        label = ev.get("name")
        label = label if isinstance(label, str) else ""
        if ph == "B":
            stack.append(_Open(label, ts))
        elif ph == "X":
            if stack and stack[-1].name.startswith("NEGOTIATE"):
                stack[-1].ticks.append((ts, label))
                summary.ranks_seen.add(label)
        elif ph == "E":
            if not stack:
                summary.unmatched_ends += 1
                continue
            top = stack.pop()
            dur = max(0.0, ts - top.ts)
            summary.phases.setdefault(top.name, PhaseStats()).add(dur)
            if stack:
                continue  # nested activity: counted in phases only
            stats = summary.tensors.setdefault(tensor, TensorStats())
            if top.name.startswith("NEGOTIATE"):
                stats.negotiate += dur
                straggle = _straggler(top, tensor)
                if straggle is not None:
                    summary.negotiations += 1
                    summary.last_counts[straggle.rank] = summary.last_counts.get(
                        straggle.rank, 0) + 1
                    summary.wait_caused[straggle.rank] = summary.wait_caused.get(
                        straggle.rank, 0.0) + straggle.wait_us
                    stats.last_counts[straggle.rank] = stats.last_counts.get(straggle.rank, 0) + 1
                    stats.waited += straggle.wait_us
                    seq += 1
                    item = (straggle.wait_us, seq, straggle)
                    if len(heap) < worst:
                        heapq.heappush(heap, item)
                    elif worst > 0 and item[0] > heap[0][0]:
                        heapq.heapreplace(heap, item)
            else:
                stats.ops += 1
                stats.execute += dur
                args = ev.get("args")
                if isinstance(args, dict):
                    stats.dtype = str(args.get("dtype", stats.dtype))
                    stats.shape = str(args.get("shape", stats.shape))
        elif ph == "i":
            if label == "CYCLE_START":
                summary.cycles += 1
            elif label == "TIMELINE_STOPPED":
                summary.stopped_cleanly = True
            elif label == "ERROR":
                summary.error_count += 1
                if len(summary.errors) < max_errors:
                    args = ev.get("args")
                    text = str(args.get("error", "")) if isinstance(args, dict) else ""
                    summary.errors.append((ts, tensor, text))
    summary.worst = [item[2] for item in sorted(heap, reverse=True)]
    for pid, stack in stacks.items():
        for opened in stack:
            summary.in_flight.append(InFlight(
                tensor=names.get(pid, f"pid {pid}"), phase=opened.name, since=opened.ts,
                ready=tuple(dict.fromkeys(label for _, label in opened.ticks))))
    summary.in_flight.sort(key=lambda f: f.since)
    return summary


def _straggler(negotiation: _Open, tensor: str) -> Straggle | None:
    first_tick: dict[str, float] = {}
    for ts, rank in negotiation.ticks:
        first_tick.setdefault(rank, ts)
    if len(first_tick) < 2:
        return None
    order = sorted(first_tick.items(), key=lambda kv: kv[1])
    rank, last = order[-1]
    return Straggle(wait_us=last - order[0][1], tensor=tensor, rank=rank, ts=last,
                    ranks_ready=len(order))


def summarize_path(path: str, **kw: Any) -> Summary:
    """:func:`summarize` on a file path.

    Raises:
        OSError: the file cannot be read.
        TimelineFormatError: not a trace file.
    """
    with open(path, encoding="utf-8", errors="replace") as fh:
        return summarize(fh, path, **kw)


# ---- report -------------------------------------------------------------------------------------

def _ms(us: float) -> str:
    return f"{us / 1000:.3f}"


def _rank_key(label: str) -> tuple[int, str]:
    return (int(label), "") if label.isdigit() else (1 << 30, label)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    out = []
    for row in [list(header)] + [list(r) for r in rows]:
        cells = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in
                 enumerate(zip(row, widths))]
        out.append("  " + "  ".join(cells).rstrip())
    return out


def format_summary(s: Summary, top: int = 10) -> str:
    """The human-readable report of one :class:`Summary`."""
    lines = [f"timeline {s.path}: {s.parse.events} events, {len(s.tensors)} tensors, "
             f"span {_ms(s.span_us)} ms" + (f", {s.cycles} cycles" if s.cycles else "")]
    if s.parse.truncated:
        lines.append(f"  WARNING: the file is truncated ({s.parse.reason}, at character "
                     f"{s.parse.stopped_at}); a crashed job? Everything before that is used.")
    if s.unmatched_ends:
        lines.append(f"  note: {s.unmatched_ends} end events without a begin (recording "
                     "started mid-op?) were ignored")

    lines += ["", "time per phase (ms):"]
    if s.phases:
        span = s.span_us or 1.0
        rows = [[name, str(p.count), _ms(p.total), _ms(p.total / p.count), _ms(p.max),
                 f"{100 * p.total / span:.1f}%"]
                for name, p in sorted(s.phases.items(), key=lambda kv: -kv[1].total)]
        lines += _table(["phase", "count", "total", "mean", "max", "of span"], rows)
        lines.append("  (phases of different tensors overlap, so shares can add up to more "
                     "than 100%)")
    else:
        lines.append("  (no completed phases)")

    lines += ["", f"top {top} tensors by time (ms):"]
    ranked = sorted(s.tensors.items(), key=lambda kv: -kv[1].total)[:top]
    if ranked:
        rows = [[name, str(t.ops), _ms(t.negotiate), _ms(t.execute), _ms(t.total),
                 t.dtype, t.shape] for name, t in ranked]
        lines += _table(["tensor", "ops", "negotiate", "execute", "total", "dtype", "shape"],
                        rows)
    else:
        lines.append("  (no tensors)")

    lines += ["", "stragglers (the last rank to submit each op; the first rank waited for it):"]
    if s.negotiations:
        rows = [[f"rank {rank}", str(n), f"{100 * n / s.negotiations:.1f}%",
                 _ms(s.wait_caused.get(rank, 0.0))]
                for rank, n in sorted(s.last_counts.items(), key=lambda kv: _rank_key(kv[0]))]
        lines += _table(["last to arrive", "times", "share", "others waited (ms)"], rows)
        lines += ["", "  per tensor (most frequent straggler):"]
        per = sorted(((name, t) for name, t in s.tensors.items() if t.last_counts),
                     key=lambda kv: -kv[1].waited)[:top]
        rows = []
        for name, t in per:
            rank, n = max(t.last_counts.items(), key=lambda kv: kv[1])
            total = sum(t.last_counts.values())
            rows.append([name, f"rank {rank}", f"{n}/{total}", _ms(t.waited),
                         _ms(t.waited / total)])
        lines += _table(["tensor", "straggler", "times last", "waited (ms)", "mean wait"], rows)
        lines += ["", f"  longest {len(s.worst)} waits:"]
        rows = [[w.tensor, f"rank {w.rank}", _ms(w.wait_us), _ms(w.ts)] for w in s.worst]
        lines += _table(["tensor", "last rank", "waited (ms)", "at (ms)"], rows)
    else:
        lines.append("  (no negotiation with two or more ranks in this trace)")

    if s.error_count:
        lines += ["", f"errors: {s.error_count}"]
        for ts, tensor, text in s.errors:
            lines.append(f"  at {_ms(ts)} ms, {tensor}: {text}")
        if s.error_count > len(s.errors):
            lines.append(f"  ... and {s.error_count - len(s.errors)} more")

    if s.in_flight:
        when = ("when recording stopped (stop_timeline or shutdown: ops in flight then)"
                if s.stopped_cleanly and not s.parse.truncated else
                "when the trace ends (the job crashed, hung or was killed?)")
        lines += ["", f"still open {when} ({len(s.in_flight)}):"]
        known = sorted(s.ranks_seen, key=_rank_key)
        for f in s.in_flight[:max(top, 20)]:
            text = f"  {f.tensor}: {f.phase} since {_ms(f.since)} ms"
            if f.phase.startswith("NEGOTIATE"):
                missing = [r for r in known if r not in f.ready]
                text += (f"; ready: {', '.join(f.ready) or 'none'}"
                         f"; not ready: {', '.join(missing) or 'none seen'}")
            lines.append(text)
        if len(s.in_flight) > max(top, 20):
            lines.append(f"  ... and {len(s.in_flight) - max(top, 20)} more")
    return "\n".join(lines) + "\n"


def summary_dict(s: Summary, top: int = 10) -> dict[str, Any]:
    """A JSON-friendly form of a :class:`Summary` (``hora timeline --json``); times in ms."""
    return {
        "path": s.path, "events": s.parse.events, "truncated": s.parse.truncated,
        "span_ms": s.span_us / 1000, "cycles": s.cycles,
        "start_time_since_epoch_in_micros": s.start_epoch_us,
        "phases": {k: {"count": p.count, "total_ms": p.total / 1000, "max_ms": p.max / 1000}
                   for k, p in s.phases.items()},
        "tensors": [{"name": n, "ops": t.ops, "negotiate_ms": t.negotiate / 1000,
                     "execute_ms": t.execute / 1000, "dtype": t.dtype, "shape": t.shape,
                     "last_counts": t.last_counts, "waited_ms": t.waited / 1000}
                    for n, t in sorted(s.tensors.items(), key=lambda kv: -kv[1].total)[:top]],
        "last_counts": s.last_counts,
        "wait_caused_ms": {k: v / 1000 for k, v in s.wait_caused.items()},
        "worst": [{"tensor": w.tensor, "rank": w.rank, "wait_ms": w.wait_us / 1000,
                   "at_ms": w.ts / 1000} for w in s.worst],
        "errors": s.error_count, "stopped_cleanly": s.stopped_cleanly,
        "error_samples": [{"at_ms": ts / 1000, "tensor": t, "error": e}
                          for ts, t, e in s.errors],
        "in_flight": [{"tensor": f.tensor, "phase": f.phase, "since_ms": f.since / 1000,
                       "ready": list(f.ready)} for f in s.in_flight],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``hora timeline FILE [FILE ...] [--top N] [--json]``. Returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="hora timeline",
        description="Summarize a timeline written with HOROVOD_TIMELINE / HORA_TIMELINE (or "
                    "hora run --timeline-filename): time per phase, the slowest tensors, and the "
                    "ranks that kept the others waiting in negotiation (stragglers). Files cut "
                    "off by a crash are read up to the last complete event.")
    parser.add_argument("files", nargs="+", metavar="FILE", help="timeline JSON file(s)")
    parser.add_argument("--top", type=int, default=10, metavar="N",
                        help="rows per table [default: 10]")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    status = 0
    results: list[dict[str, Any]] = []
    for i, path in enumerate(ns.files):
        try:
            summary = summarize_path(path, worst=max(ns.top, 0))
        except OSError as exc:
            sys.stderr.write(f"hora timeline: cannot read {path}: {exc.strerror or exc}\n")
            status = 1
            continue
        except TimelineFormatError as exc:
            sys.stderr.write(f"hora timeline: {path} is not a timeline: {exc}\n")
            status = 1
            continue
        if ns.json:
            results.append(summary_dict(summary, ns.top))
        else:
            if i:
                sys.stdout.write("\n")
            sys.stdout.write(format_summary(summary, ns.top))
    if ns.json:
        sys.stdout.write(json.dumps(results if len(ns.files) > 1 else
                                    (results[0] if results else None), indent=2) + "\n")
    return status


__all__ = ["ParseState", "Summary", "TimelineFormatError", "format_summary", "iter_events",
           "main", "summarize", "summarize_path", "summary_dict"]
