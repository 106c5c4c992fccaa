"""Certain deadlocks fail fast on every rank, naming each rank's op (one real 3-rank job).

A deadlock is every rank blocked in a wait while none of their ops can complete; hora fails
those ops with DeadlockError instead of hanging, and the job can go on (automatic names still
match afterwards). The elapsed times are measured, not asserted: see
benchmarks/failure_detection.py and docs/faults.md for the figures.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import Job, run_job

pytestmark = pytest.mark.integration

SCRIPT = str(Path(__file__).with_name("deadlock_worker.py"))
NP = 3


@pytest.fixture(scope="module")
def job() -> Job:
    # A short deadlock time keeps the job quick; the default (1 s) is measured by the benchmark.
    return run_job(NP, timeout=90, script=SCRIPT,
                   env={"HORA_DEADLOCK_TIME_SECONDS": "0.3",
                        "HOROVOD_STALL_CHECK_TIME_SECONDS": "30"})


def outcomes(job: Job, case: str) -> dict[int, str]:
    found: dict[int, str] = {}
    for line in job.stdout.splitlines():
        prefix, _, payload = line.partition(">:")
        if payload.startswith(f"CASE {case} "):
            found[int(prefix.lstrip("[").split("]")[0])] = payload.split(" ", 3)[3]
    assert sorted(found) == list(range(NP)), f"{case}: reports from {sorted(found)}\n" \
        f"{job.stdout[-3000:]}\n{job.stderr[-3000:]}"
    return found


def assert_deadlock(job: Job, case: str, *fragments: str) -> None:
    for rank, outcome in outcomes(job, case).items():
        assert outcome.startswith("DeadlockError Deadlock:"), f"rank {rank}: {outcome}"
        for fragment in fragments:
            assert fragment in outcome, f"rank {rank} lacks {fragment!r}: {outcome}"
    assert job.lines(f"AFTER {case} ok").__len__() == NP, job.stdout[-3000:]


def test_mismatched_names(job: Job) -> None:
    assert_deadlock(job, "names", "rank 0 waits in allreduce.grad.0, which ranks [1, 2] never "
                                  "submitted", "rank 2 waits in allreduce.grad.2")


def test_reducescatter_vs_barrier(job: Job) -> None:
    assert_deadlock(job, "reducescatter_vs_barrier",
                    "rank 0 waits in reducescatter.noname.1, which ranks [1, 2] never submitted",
                    "rank 1 waits in barrier.noname.1, which rank 0 never submitted",
                    "HINT: every rank must run the same collectives in the same order")


def test_allreduce_in_the_fast_lane_vs_barrier(job: Job) -> None:
    assert_deadlock(job, "lane_vs_barrier", "rank 0 waits in allreduce.cached, which ranks "
                                            "[1, 2] never submitted")


def test_join_vs_allgather_object(job: Job) -> None:
    assert_deadlock(job, "join_vs_allgather_object",
                    "rank 0 waits in join, which ranks [1, 2] never joined",
                    "rank 1 waits in allgather.allgather_object.noname.1.size of process set 1, "
                    "which rank 2 never submitted")


def test_subset_that_never_submits(job: Job) -> None:
    assert_deadlock(job, "subset_never_submits",
                    "rank 0 waits in allreduce.step, which rank 2 never submitted",
                    "rank 2 waits in broadcast.noname.1 of process set 1, which rank 1 never "
                    "submitted")


def test_grouped_op_vs_allreduce(job: Job) -> None:
    assert_deadlock(job, "grouped_vs_allreduce",
                    "rank 0 waits in grouped_allreduce.noname.1_1of3, which ranks [1, 2] never "
                    "submitted", "rank 1 waits in allreduce.solo")


def test_a_rank_still_computing_is_not_a_deadlock(job: Job) -> None:
    assert set(outcomes(job, "slow_rank").values()) == {"ok"}


def test_uncaught_deadlock_fails_the_job(job: Job) -> None:
    assert len(job.lines("UNCAUGHT")) == NP
    assert not job.lines("NOT REACHED")
    assert job.returncode != 0
    assert "DeadlockError" in job.stderr and "allreduce.last" in job.stderr
