"""The framework-neutral collective suite and the gradient rules, through ``hora.torch``, in one
real 3-rank ``hora run`` job (one pytest test per case)."""

from __future__ import annotations

import group_collectives
import pytest
from conftest import CaseJob, run_cases

pytestmark = pytest.mark.integration

CASE_IDS = [case_id for case_id, _ in group_collectives.cases()]


@pytest.fixture(scope="module")
def job() -> CaseJob:
    return run_cases(group_collectives.NP, "group_collectives")


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_case(job: CaseJob, case_id: str) -> None:
    job.assert_ok(case_id)


def test_job_finished_cleanly(job: CaseJob) -> None:
    assert job.returncode == 0, job.stderr[-4000:]
    assert job.stdout.count("DONE") == group_collectives.NP
