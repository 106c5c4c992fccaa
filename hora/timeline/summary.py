"""Where a timeline's time went, and which rank kept the others waiting (``hora timeline``).

Reads a Chrome-trace timeline (:func:`hora.timeline.trace_reader.iter_events`, written by
:mod:`hora.timeline.writer` or by Horovod's ``HOROVOD_TIMELINE``) as a stream, in bounded memory
(per-tensor aggregates only), into a :class:`Summary`:

* total, mean and max time per phase (``NEGOTIATE_ALLREDUCE``, ``ALLREDUCE``, ``QUEUE``,
  ``MEMCPY_IN_FUSION_BUFFER``, ``RING_ALLREDUCE``, ...);
* the tensors that took the most time (negotiation + execution), with dtype and shape;
* stragglers: for each negotiation, the rank whose "ready" tick came last and how long the first
  rank waited for it; how often each rank was last; the worst single waits;
* errors recorded in the trace, and what was still in flight when the trace ends (a crashed or
  hung job): for a negotiation, which ranks had reported ready and which had not.

A file cut off mid-write (the job crashed) is read up to the last complete event and flagged.
:mod:`hora.timeline.summary_report` prints a :class:`Summary` and is the command itself.

Layering: runner-facing tool; imports only the base layer (never :mod:`hora.core`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import IO, Any

from hora.timeline.trace_reader import ParseState, iter_events


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


__all__ = ["InFlight", "PhaseStats", "Straggle", "Summary", "TensorStats", "summarize",
           "summarize_path"]
