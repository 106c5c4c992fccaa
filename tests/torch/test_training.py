"""DistributedOptimizer, broadcasts and SyncBatchNorm in one real 2-rank ``hora run`` job
(one pytest test per case; tolerances are stated in group_training.py)."""

from __future__ import annotations

import group_training
import pytest
from conftest import CaseJob, run_cases

pytestmark = pytest.mark.integration

CASE_IDS = [case_id for case_id, _ in group_training.cases()]


@pytest.fixture(scope="module")
def job() -> CaseJob:
    return run_cases(group_training.NP, "group_training")


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_case(job: CaseJob, case_id: str) -> None:
    job.assert_ok(case_id)


def test_job_finished_cleanly(job: CaseJob) -> None:
    assert job.returncode == 0, job.stderr[-4000:]
