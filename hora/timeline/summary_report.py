"""``hora timeline FILE``: a timeline :class:`~hora.timeline.summary.Summary` as a report.

:func:`format_summary` renders the human-readable tables (phases, top tensors, stragglers, errors,
what was still open), :func:`summary_dict` the ``--json`` form, and :func:`main` is the command.

Layering: runner-facing tool; imports only the base layer and :mod:`hora.timeline`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from hora.errors import TimelineFormatError
from hora.timeline.summary import Summary, summarize_path


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


__all__ = ["format_summary", "main", "summary_dict"]
