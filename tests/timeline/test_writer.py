"""The timeline writer: Horovod's trace layout, valid JSON after every flush, cheap hooks."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hora.config import Config
from hora.timeline import trace_file
from hora.timeline.writer import (
    MEMCPY_IN_FUSION_BUFFER,
    MEMCPY_OUT_FUSION_BUFFER,
    QUEUE,
    Timeline,
    collective_activity,
    rank_path,
)


def _load(path: Path) -> list[dict[str, Any]]:
    """The file's events. A read that overlaps one of the writer's writes can be torn (the old
    closing bracket from before the write, the new events after it); the file itself is valid
    after every write, so a torn read is read again."""
    for attempt in range(3):
        try:
            data = json.loads(path.read_text())
            break
        except json.JSONDecodeError:
            if attempt == 2:
                raise
            time.sleep(0.005)
    assert isinstance(data, list)
    return data


def _wait_for(path: Path, pred: Any, timeout: float = 5.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        events = _load(path)  # must parse at every moment, not only at the end
        if pred(events):
            return events
        assert time.monotonic() < deadline, events
        time.sleep(0.01)


def _one_op(tl: Timeline, name: str = "allreduce.w", ranks: int = 3) -> None:
    tl.negotiate_start(name, "ALLREDUCE")
    for r in (2, 0, 1)[:ranks]:
        tl.negotiate_rank_ready(name, r)
    tl.negotiate_end(name)
    tl.op_start(name, "ALLREDUCE")
    tl.activity_start(name, QUEUE)
    tl.activity_end(name)
    tl.activity_start(name, MEMCPY_IN_FUSION_BUFFER)
    tl.activity_start(name, collective_activity("ring", "ALLREDUCE"))  # ends the previous one
    tl.activity_start(name, MEMCPY_OUT_FUSION_BUFFER)
    tl.op_end(name, "float32", (2, 3))


def _per_pid(events: list[dict[str, Any]], pid: int) -> list[tuple[str, str]]:
    return [(e["ph"], e.get("name", "")) for e in events if e.get("pid") == pid
            and e["ph"] != "M"]


def test_disabled_hooks_are_no_ops_and_start_needs_enabling(tmp_path: Path) -> None:
    tl = Timeline(0)
    _one_op(tl)
    tl.mark_cycle()
    tl.error("x", "boom")
    tl.fail_all("boom")
    assert not tl.recording and tl.path is None
    with pytest.raises(ValueError, match="HOROVOD_TIMELINE=DYNAMIC"):
        tl.start(str(tmp_path / "t.json"))
    assert list(tmp_path.iterdir()) == []


def test_horovod_layout(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(0, enabled=True)
    before = time.time_ns() // 1000
    tl.start(str(path))
    _one_op(tl)
    _one_op(tl, "broadcast.b", ranks=2)
    tl.stop()
    events = _load(path)
    meta0 = events[0]
    assert meta0["ph"] == "M" and meta0["pid"] == 0 and meta0["name"] == "process_name"
    assert before <= meta0["args"]["start_time_since_epoch_in_micros"] <= before + 10_000_000
    assert events[1] == {"name": "process_sort_index", "ph": "M", "pid": 0, "tid": 0,
                         "args": {"sort_index": 0}}
    names = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name" and e["pid"]}
    assert names == {1: "allreduce.w", 2: "broadcast.b"}
    sort = {e["pid"]: e["args"]["sort_index"] for e in events
            if e["ph"] == "M" and e["name"] == "process_sort_index"}
    assert sort == {0: 0, 1: 1, 2: 2}
    assert _per_pid(events, 1) == [
        ("B", "NEGOTIATE_ALLREDUCE"), ("X", "2"), ("X", "0"), ("X", "1"), ("E", ""),
        ("B", "ALLREDUCE"), ("B", "QUEUE"), ("E", ""), ("B", "MEMCPY_IN_FUSION_BUFFER"),
        ("E", ""), ("B", "RING_ALLREDUCE"), ("E", ""), ("B", "MEMCPY_OUT_FUSION_BUFFER"),
        ("E", ""), ("E", "")]
    ends = [e for e in events if e["ph"] == "E"]
    assert all("name" not in e for e in ends)
    assert ends[-1]["args"] == {"dtype": "float32", "shape": "[2, 3]"}
    ticks = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] == 0 for e in ticks)
    stamps = [e["ts"] for e in events if e["ph"] != "M"]
    assert all(isinstance(t, int) and t >= 0 for t in stamps)
    assert stamps == sorted(stamps)
    assert events[-1] == {"ph": "i", "name": "TIMELINE_STOPPED", "ts": stamps[-1], "pid": 0,
                          "tid": 0, "s": "g"}


def test_ready_tick_starts_the_negotiation_itself(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(0, enabled=True)
    tl.start(str(path))
    tl.negotiate_rank_ready("t", 1, "ALLGATHER")
    tl.negotiate_rank_ready("t", 0, "ALLGATHER")
    tl.negotiate_start("t", "ALLGATHER")  # repeated start while negotiating: ignored
    tl.negotiate_end("t")
    tl.stop()
    assert _per_pid(_load(path), 1) == [("B", "NEGOTIATE_ALLGATHER"), ("X", "1"), ("X", "0"),
                                        ("E", "")]


def test_file_is_valid_json_after_every_flush(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(0, enabled=True, flush_interval=0.01)
    tl.start(str(path))
    assert _load(path)[0]["pid"] == 0  # valid right after start, before any event
    for i in range(5):
        _one_op(tl, f"t{i}")
        _wait_for(path, lambda ev, i=i: sum(e["ph"] == "E" and "args" in e for e in ev) == i + 1)
    tl.stop()
    assert sum(e["ph"] == "B" for e in _load(path)) == 5 * 6


def test_events_reach_the_file_at_once_not_at_the_next_interval(tmp_path: Path) -> None:
    """Tools (and Horovod's test_timeline) read the file while the job runs: an op's events are
    on disk within milliseconds even with a long flush interval, and then again for later ops
    after an idle spell."""
    path = tmp_path / "t.json"
    tl = Timeline(0, enabled=True, flush_interval=30.0)
    tl.start(str(path))
    try:
        for i in range(3):
            _one_op(tl, f"allreduce.prompt{i}")
            _wait_for(path, lambda ev, i=i: any(e.get("args", {}).get("name") ==
                                                f"allreduce.prompt{i}" for e in ev), timeout=2.0)
            time.sleep(0.05)  # idle: the writer sleeps until the next event wakes it
    finally:
        tl.stop()


def test_start_same_path_is_a_no_op_and_new_path_switches(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    tl = Timeline(0, enabled=True)
    tl.start(str(a))
    _one_op(tl, "first")
    tl.start(str(a), mark_cycles=True)  # same file: keeps writing, only the flag changes
    tl.mark_cycle()
    tl.start(str(b))
    assert tl.path == str(b)
    _one_op(tl, "second")
    tl.stop()
    tl.stop()  # idempotent
    first, second = _load(a), _load(b)
    assert any(e.get("name") == "CYCLE_START" for e in first)
    assert {e["args"]["name"] for e in first if e.get("name") == "process_name" and e["pid"]} \
        == {"first"}
    assert {e["args"]["name"] for e in second if e.get("name") == "process_name" and e["pid"]} \
        == {"second"}
    _one_op(tl, "after-stop")
    assert "after-stop" not in a.read_text() + b.read_text()


def test_cycle_markers_only_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(0, enabled=True)
    tl.start(str(path))
    tl.mark_cycle()
    tl.stop()
    assert not any(e.get("name") == "CYCLE_START" for e in _load(path))
    tl.start(str(path), mark_cycles=True)
    tl.mark_cycle()
    tl.mark_cycle()
    tl.stop()
    marks = [e for e in _load(path) if e.get("name") == "CYCLE_START"]
    assert len(marks) == 2 and all(m["ph"] == "i" and m["s"] == "g" for m in marks)


def test_dynamic_creates_no_file_until_started(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for value in ("DYNAMIC", "dynamic"):
        tl = Timeline.from_config(Config(timeline=value), 0)
        assert tl.enabled and not tl.recording
        _one_op(tl)
        assert list(tmp_path.iterdir()) == []
        with pytest.raises(ValueError, match="file path"):
            tl.start("DYNAMIC")
    tl.start("later.json", mark_cycles=False)
    tl.stop()
    assert [p.name for p in tmp_path.iterdir()] == ["later.json"]


def test_from_config_starts_on_rank_zero_only(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    cfg = Config(timeline=str(path), timeline_mark_cycles=True)
    worker = Timeline.from_config(cfg, 1)
    assert worker.enabled and not worker.recording
    coordinator = Timeline.from_config(cfg, 0)
    assert coordinator.recording and coordinator.path == str(path)
    coordinator.mark_cycle()
    coordinator.stop()
    worker.stop()
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]
    assert any(e.get("name") == "CYCLE_START" for e in _load(path))
    disabled = Timeline.from_config(Config(), 0)
    assert not disabled.enabled and not disabled.recording


def test_all_ranks_writes_one_file_per_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "t.json")
    assert rank_path(path, 0) == path
    assert rank_path(path, 3) == str(tmp_path / "t.rank3.json")
    assert rank_path("trace", 2) == "trace.rank2"
    timelines = [Timeline(r, enabled=True, all_ranks=True) for r in range(3)]
    for tl in timelines:
        tl.start(path)
        tl.op_start("x", "ALLREDUCE")
        tl.op_end("x", "int8", [1])
        tl.stop()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.rank1.json",
                                                          "t.rank2.json"]
    for p in tmp_path.iterdir():
        assert [(e["ph"], e.get("name")) for e in _load(p) if e["ph"] != "M"] == [
            ("B", "ALLREDUCE"), ("E", None), ("i", "TIMELINE_STOPPED")]


def test_unwritable_path(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bad = str(tmp_path / "missing-dir" / "t.json")
    with pytest.raises(OSError, match="missing-dir.*HINT"):
        Timeline(0, enabled=True).start(bad)
    with caplog.at_level(logging.ERROR, logger="hora.timeline"):
        tl = Timeline.from_config(Config(timeline=bad), 0)
    assert tl.enabled and not tl.recording
    assert "without a timeline" in caplog.text


def test_out_of_order_hooks_never_break_nesting(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(0, enabled=True)
    tl.start(str(path))
    tl.op_end("a", "float32", [1])          # end without start (recording began mid-op)
    tl.activity_start("a", QUEUE)           # activity without an op
    tl.activity_end("a")
    tl.negotiate_end("a")
    tl.negotiate_start("b", "ALLREDUCE")
    tl.op_start("b", "ALLREDUCE")            # closes the negotiation left open
    tl.activity_start("b", QUEUE)
    tl.negotiate_start("b", "ALLREDUCE")     # a new negotiation closes the open op
    tl.negotiate_rank_ready("c", 0, "BROADCAST")
    tl.negotiate_end("c")
    tl.error("c", "Mismatched BROADCAST root ranks \"quoted\"")
    tl.op_start("d", "ALLREDUCE")
    tl.activity_start("d", "RING_ALLREDUCE")
    tl.fail_all("rank 2 (host h) was lost")
    tl.stop()
    events = _load(path)
    depth: dict[int, int] = {}
    for e in events:
        if e["ph"] == "B":
            depth[e["pid"]] = depth.get(e["pid"], 0) + 1
        elif e["ph"] == "E":
            depth[e["pid"]] = depth.get(e["pid"], 0) - 1
            assert depth[e["pid"]] >= 0, e
    pid = {e["args"]["name"]: e["pid"] for e in events
           if e.get("name") == "process_name" and e["pid"]}
    assert set(depth.values()) == {0}  # fail_all closed b (negotiating) and d (mid-activity)
    errors = [e for e in events if e.get("name") == "ERROR"]
    assert [(e["pid"], e["args"]["error"]) for e in errors] == [
        (pid["c"], 'Mismatched BROADCAST root ranks "quoted"'),
        (pid["b"], "rank 2 (host h) was lost"), (pid["d"], "rank 2 (host h) was lost")]


def test_names_are_escaped(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(0, enabled=True)
    tl.start(str(path))
    weird = 'grad "w"\\n\n\u00e9\u2603\x00'
    _one_op(tl, weird)
    tl.stop()
    assert weird in {e["args"]["name"] for e in _load(path) if e.get("name") == "process_name"}


def test_hooks_never_wait_for_the_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer stuck on a slow disk must not slow the engine thread down."""
    gate = threading.Event()
    real_write = trace_file.TraceFile._write

    def slow_write(self: Any, lines: list[str]) -> None:
        gate.wait(10)
        real_write(self, lines)

    monkeypatch.setattr(trace_file.TraceFile, "_write", slow_write)
    path = tmp_path / "t.json"
    tl = Timeline(0, enabled=True, flush_interval=0.001)
    tl.start(str(path))
    start = time.perf_counter()
    for i in range(2000):
        _one_op(tl, f"t{i % 50}")
    elapsed = time.perf_counter() - start
    gate.set()
    tl.stop()
    assert elapsed < 2.0  # ~22k hook calls: microseconds each, never a disk wait
    assert sum(e["ph"] == "X" for e in _load(path)) == 2000 * 3


def test_backlog_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            caplog: pytest.LogCaptureFixture) -> None:
    gate = threading.Event()
    real_write = trace_file.TraceFile._write

    def stuck_write(self: Any, lines: list[str]) -> None:
        gate.wait(10)
        real_write(self, lines)

    monkeypatch.setattr(trace_file.TraceFile, "_write", stuck_write)
    path = tmp_path / "t.json"
    tl = Timeline(0, enabled=True, flush_interval=0.001, max_pending=100)
    tl.start(str(path))
    time.sleep(0.05)  # the writer is now stuck in its first (empty) write
    for i in range(1000):
        tl.negotiate_rank_ready(f"t{i}", 0, "ALLREDUCE")
    gate.set()
    with caplog.at_level(logging.WARNING, logger="hora.timeline"):
        tl.stop()
    assert "were dropped" in caplog.text
    assert 0 < sum(e["ph"] == "X" for e in _load(path)) <= 200


def test_disabled_hook_cost_is_negligible() -> None:
    tl = Timeline(0)
    start = time.perf_counter()
    for _ in range(100_000):
        tl.negotiate_rank_ready("t", 0, "ALLREDUCE")
    per_call = (time.perf_counter() - start) / 100_000
    assert per_call < 5e-6  # ~0.1 us on this machine; generous for a shared, noisy host


def test_write_error_stops_recording_and_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    def failing_write(self: Any, lines: list[str]) -> None:
        if lines:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(trace_file.TraceFile, "_write", failing_write)
    tl = Timeline(0, enabled=True, flush_interval=0.005)
    with caplog.at_level(logging.ERROR, logger="hora.timeline"):
        tl.start(str(tmp_path / "t.json"))
        _one_op(tl)
        deadline = time.monotonic() + 5
        while tl.recording and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not tl.recording
    assert "No space left" in caplog.text
    _one_op(tl)  # still a harmless no-op
    tl.stop()
    assert os.path.exists(tmp_path / "t.json")
