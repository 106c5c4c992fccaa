"""Error cases (mismatches across ranks, misuse, bad arguments) in one real 3-rank
``hora run`` job: each raises the documented error and nothing hangs."""

from __future__ import annotations

import group_errors
import pytest
from conftest import CaseJob, run_cases

pytestmark = pytest.mark.integration

CASE_IDS = [case_id for case_id, _ in group_errors.cases()]


@pytest.fixture(scope="module")
def job() -> CaseJob:
    return run_cases(group_errors.NP, "group_errors")


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_case(job: CaseJob, case_id: str) -> None:
    job.assert_ok(case_id)


def test_job_finished_cleanly(job: CaseJob) -> None:
    assert job.returncode == 0, job.stderr[-4000:]
