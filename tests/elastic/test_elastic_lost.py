"""The survivors' reports of lost peers and the driver's rule for dropping a hung member
(the real-process cases are in test_elastic_faults.py)."""

from __future__ import annotations

from hora.rendezvous.elastic_report import LostReport, decode_report, encode_report, named_ranks
from hora.runner.elastic import lost
from hora.runner.elastic.members import Member

SILENT = ("rank 1 (host a) sent nothing for 30 s, not even a heartbeat "
          "(HORA_HEARTBEAT_TIMEOUT_SECONDS=30): it is hung")


def test_named_ranks_are_the_peers_an_error_names() -> None:
    assert named_ranks(SILENT) == (1,)
    assert named_ranks(f"rank 0 failed: {SILENT}", own_rank=2) == (1,)
    assert named_ranks("rank 2 (host b) closed its control connection to rank 0", 0) == (2,)
    assert named_ranks("rank 0 (host a) x; other ranks report: rank 3 (host c) y", 3) == (0,)
    assert named_ranks("Deadlock: rank 0 waits in allreduce.x, which rank 1 never submitted") == ()


def test_reports_round_trip_and_garbage_is_ignored() -> None:
    report = LostReport(4, (1, 2), SILENT)
    assert decode_report(encode_report(report)) == report
    assert decode_report(b"not json") is None and decode_report(b'{"ranks": 1}') is None


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def members() -> list[Member]:
    return [Member(wid=w, host="a", started=0.0, rank=w, current=3) for w in range(3)]


def test_a_named_member_is_dropped_after_the_grace_period() -> None:
    clock = Clock()
    reports = lost.LostReports(clock)
    reports._reports = {0: LostReport(3, (1,), SILENT), 2: LostReport(3, (1,), SILENT)}
    ms = members()
    assert reports.to_drop(3, ms, [ms[1]]) == []  # the grace period starts
    clock.now += lost.GRACE_S - 0.01
    assert reports.to_drop(3, ms, [ms[1]]) == []
    clock.now += 0.01
    assert reports.to_drop(3, ms, [ms[1]]) == [(ms[1], f"worker 0, worker 2: {SILENT}")]


def test_an_unnamed_or_stale_report_drops_nobody() -> None:
    clock = Clock()
    reports = lost.LostReports(clock)
    ms = members()
    reports._reports = {0: LostReport(2, (1,), SILENT)}  # of an older generation
    assert reports.to_drop(3, ms, [ms[1]]) is None
    reports._reports = {0: LostReport(3, (1,), SILENT)}
    assert reports.to_drop(3, ms, [ms[1], ms[2]]) is None  # worker 2 is behind, unnamed
    reports._reports = {1: LostReport(3, (1,), SILENT)}  # naming itself does not count
    assert reports.to_drop(3, ms, [ms[1]]) is None
