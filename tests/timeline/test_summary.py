"""`hora timeline FILE`: phases, top tensors, stragglers, errors, truncated and odd files."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hora.errors import TimelineFormatError
from hora.runner import cli
from hora.timeline.summary import summarize, summarize_path
from hora.timeline.summary_report import format_summary
from hora.timeline.trace_reader import ParseState, iter_events
from hora.timeline.writer import QUEUE, Timeline


def _meta(pid: int, name: str) -> list[dict[str, Any]]:
    return [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]


def _negotiation(pid: int, t0: int, ticks: list[tuple[int, int]], end: int,
                 kind: str = "ALLREDUCE") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"ph": "B", "name": f"NEGOTIATE_{kind}", "ts": t0, "pid": pid}]
    out += [{"ph": "X", "name": str(r), "ts": t, "pid": pid, "dur": 0} for r, t in ticks]
    out.append({"ph": "E", "ts": end, "pid": pid})
    return out


def _op(pid: int, t0: int, phases: list[tuple[str, int]], end: int,
        kind: str = "ALLREDUCE", shape: str = "[4]") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"ph": "B", "name": kind, "ts": t0, "pid": pid}]
    t = t0
    for name, dur in phases:
        out += [{"ph": "B", "name": name, "ts": t, "pid": pid},
                {"ph": "E", "ts": t + dur, "pid": pid}]
        t += dur
    out.append({"ph": "E", "ts": end, "pid": pid, "args": {"dtype": "float32", "shape": shape}})
    return out


def _trace() -> list[dict[str, Any]]:
    ev: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0,
         "args": {"start_time_since_epoch_in_micros": 1_700_000_000_000_000}}]
    ev += _meta(1, "allreduce.a") + _meta(2, "allreduce.b")
    # step 1: rank 2 is last for a (waited 3000 us), rank 1 last for b (500 us)
    ev += _negotiation(1, 0, [(0, 0), (1, 1000), (2, 3000)], 3000)
    ev += _op(1, 3000, [("QUEUE", 100), ("RING_ALLREDUCE", 800)], 4000)
    ev += _negotiation(2, 100, [(2, 100), (0, 200), (1, 600)], 600)
    ev += _op(2, 4000, [("SMALL_ALLREDUCE", 50)], 4100, shape="[2, 2]")
    # step 2: rank 2 last for both
    ev += _negotiation(1, 10_000, [(0, 10_000), (1, 10_100), (2, 12_000)], 12_000)
    ev += _op(1, 12_000, [("RING_ALLREDUCE", 900)], 13_000)
    ev += _negotiation(2, 10_000, [(1, 10_000), (0, 10_000), (2, 10_200)], 10_200)
    ev.append({"ph": "i", "name": "CYCLE_START", "ts": 10_000, "s": "g"})
    ev.append({"ph": "i", "name": "ERROR", "ts": 10_300, "pid": 2, "s": "p",
               "args": {"error": "Mismatched ALLREDUCE tensor shapes"}})
    # still open at the end: a negotiation that rank 1 never joined
    ev += _meta(3, "allreduce.hung")
    ev += [{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 14_000, "pid": 3},
           {"ph": "X", "name": "0", "ts": 14_000, "pid": 3, "dur": 0},
           {"ph": "X", "name": "2", "ts": 14_500, "pid": 3, "dur": 0}]
    return ev


def _file(tmp_path: Path, events: list[dict[str, Any]], name: str = "t.json") -> Path:
    path = tmp_path / name
    path.write_text("[\n" + ",\n".join(json.dumps(e) for e in events) + "\n]\n")
    return path


def test_phases_tensors_and_stragglers(tmp_path: Path) -> None:
    s = summarize_path(str(_file(tmp_path, _trace())))
    assert not s.parse.truncated
    assert s.start_epoch_us == 1_700_000_000_000_000
    assert s.phases["NEGOTIATE_ALLREDUCE"].count == 4
    assert s.phases["NEGOTIATE_ALLREDUCE"].total == 3000 + 500 + 2000 + 200
    assert s.phases["RING_ALLREDUCE"].total == 1700 and s.phases["RING_ALLREDUCE"].max == 900
    assert s.phases["ALLREDUCE"].count == 3
    a, b = s.tensors["allreduce.a"], s.tensors["allreduce.b"]
    assert (a.ops, a.negotiate, a.execute) == (2, 5000, 2000)
    assert (b.ops, b.dtype, b.shape) == (1, "float32", "[2, 2]")
    assert s.negotiations == 4
    assert s.last_counts == {"2": 3, "1": 1}
    assert s.wait_caused == {"2": 3000 + 2000 + 200, "1": 500}
    assert [(w.tensor, w.rank, w.wait_us) for w in s.worst][:2] == [
        ("allreduce.a", "2", 3000), ("allreduce.a", "2", 2000)]
    assert a.last_counts == {"2": 2} and a.waited == 5000
    assert s.cycles == 1 and s.error_count == 1
    assert s.errors[0][1:] == ("allreduce.b", "Mismatched ALLREDUCE tensor shapes")
    (hung,) = s.in_flight
    assert (hung.tensor, hung.phase, hung.ready) == ("allreduce.hung", "NEGOTIATE_ALLREDUCE",
                                                     ("0", "2"))
    text = format_summary(s, top=5)
    assert "time per phase" in text and "RING_ALLREDUCE" in text
    assert "the job crashed, hung or was killed?" in text and not s.stopped_cleanly
    assert "rank 2" in text and "75.0%" in text  # rank 2 was last in 3 of 4 negotiations
    assert "allreduce.hung: NEGOTIATE_ALLREDUCE since 14.000 ms; ready: 0, 2; not ready: 1" \
        in text
    assert "Mismatched ALLREDUCE tensor shapes" in text


def test_single_rank_has_no_stragglers(tmp_path: Path) -> None:
    ev = _meta(1, "t") + _negotiation(1, 0, [(0, 5)], 5) + _op(1, 5, [], 10)
    s = summarize_path(str(_file(tmp_path, ev)))
    assert s.negotiations == 0 and s.tensors["t"].ops == 1
    assert "no negotiation with two or more ranks" in format_summary(s)


def test_truncated_file_is_read_up_to_the_cut(tmp_path: Path) -> None:
    full = _file(tmp_path, _trace()).read_text()
    cut = full[: full.index('"RING_ALLREDUCE", "ts": 12000') + 10]
    s = summarize(io.StringIO(cut), "cut.json")
    assert s.parse.truncated and s.parse.stopped_at > 0
    assert s.tensors["allreduce.a"].ops == 1
    text = format_summary(s)
    assert "truncated" in text and "still open when the trace ends" in text


def test_writer_output_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    tl = Timeline(0, enabled=True)
    tl.start(str(path), mark_cycles=True)
    for step in range(3):
        tl.mark_cycle()
        for name in ("grad.a", "grad.b"):
            for r in (0, 2, 1):
                tl.negotiate_rank_ready(name, r, "ALLREDUCE")
            tl.negotiate_end(name)
            tl.op_start(name, "ALLREDUCE")
            tl.activity_start(name, QUEUE)
            tl.activity_start(name, "RING_ALLREDUCE")
            tl.op_end(name, "float32", [step + 1])
    tl.stop()
    s = summarize_path(str(path))
    assert s.cycles == 3 and s.tensors["grad.a"].ops == 3 and s.negotiations == 6
    assert s.last_counts == {"1": 6} and s.tensors["grad.b"].shape == "[3]"
    assert s.phases["QUEUE"].count == 6 and not s.in_flight and not s.parse.truncated
    assert s.stopped_cleanly


def test_ops_open_at_a_clean_stop_are_not_called_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    tl = Timeline(0, enabled=True)
    tl.start(str(path))
    tl.negotiate_rank_ready("late", 1, "ALLREDUCE")  # another rank's next step, then stop
    tl.stop()
    s = summarize_path(str(path))
    assert s.stopped_cleanly and [f.tensor for f in s.in_flight] == ["late"]
    assert "still open when recording stopped" in format_summary(s)


def test_horovod_spacing_and_object_form(tmp_path: Path) -> None:
    horovod = ('[\n{"name": "process_name", "ph": "M", "pid": 0, "args": '
               '{"start_time_since_epoch_in_micros":5}},\n'
               '{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "x"}},\n'
               '{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 1, "pid": 1},'
               '{"ph": "X", "name": "0", "ts": 1, "pid": 1, "dur": 0},'
               '{"ph": "X", "name": "1", "ts": 9, "pid": 1, "dur": 0},'
               '{"ph": "E", "ts": 9, "pid": 1}]')
    s = summarize(io.StringIO(horovod))
    assert s.start_epoch_us == 5 and s.last_counts == {"1": 1} and s.worst[0].wait_us == 8
    obj = json.dumps({"traceEvents": _trace(), "displayTimeUnit": "ms"})
    assert summarize(io.StringIO(obj)).negotiations == 4


@pytest.mark.parametrize("text,match", [
    ("", "empty"), ("   \n", "empty"), ("hello", "expected a JSON array"),
    ('{"a": 1}', "traceEvents"), ("{not json", "not valid JSON")])
def test_not_a_timeline(text: str, match: str) -> None:
    with pytest.raises(TimelineFormatError, match=match):
        summarize(io.StringIO(text))


def test_odd_events_are_skipped() -> None:
    text = json.dumps([1, "x", None, {"ph": "B"}, {"ph": "E", "ts": 3, "pid": [1]},
                       {"ph": "E", "ts": 3, "pid": 7}, {"ph": "X", "ts": "soon"},
                       {"ph": "B", "name": 5, "ts": 1, "pid": 2}, {"ph": "E", "ts": 2, "pid": 2}])
    s = summarize(io.StringIO(text))
    assert s.unmatched_ends == 1 and s.phases[""].count == 1


def test_streams_across_chunk_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    from hora.timeline import trace_reader

    monkeypatch.setattr(trace_reader, "_CHUNK", 7)
    events = list(iter_events(io.StringIO("  \n\n  " + json.dumps(_trace()))))
    assert events == _trace()


@settings(max_examples=150, deadline=2000)
@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=1, max_value=64))
def test_any_cut_of_a_file_is_summarized(cut: int, chunk: int) -> None:
    from hora.timeline import trace_reader

    text = "[\n" + ",\n".join(json.dumps(e) for e in _trace()) + "\n]\n"
    part = text[: cut % (len(text) + 1)]
    old = trace_reader._CHUNK
    trace_reader._CHUNK = chunk
    try:
        state = ParseState()
        try:
            n = sum(1 for _ in iter_events(io.StringIO(part), state))
        except TimelineFormatError:
            assert part.strip() == ""
            return
        s = summarize(io.StringIO(part))
    finally:
        trace_reader._CHUNK = old
    assert n == state.events == s.parse.events <= len(_trace())
    assert state.truncated == (len(part) < len(text.rstrip()))
    format_summary(s)


def test_cli_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _file(tmp_path, _trace())
    assert cli.main(["timeline", str(path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"timeline {path}:") and "stragglers" in out
    assert cli.main(["timeline", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["last_counts"] == {"2": 3, "1": 1} and data["in_flight"][0]["ready"] == ["0", "2"]
    assert cli.main(["timeline", str(tmp_path / "nope.json")]) == 1
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("nonsense")
    assert cli.main(["timeline", str(tmp_path / "bad.json"), str(path)]) == 1
    captured = capsys.readouterr()
    assert "not a timeline" in captured.err and "stragglers" in captured.out
    assert cli.main(["timeline"]) == 2
    assert "timeline" in cli._TOP_HELP
