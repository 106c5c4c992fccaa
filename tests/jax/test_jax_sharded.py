"""hora.jax.ShardedOptimizer (hora-only) in one real 2-rank ``hora run`` job
(group_jax_sharded.py; one pytest test per case). This process never imports JAX."""

from __future__ import annotations

import sys

import jax_case_ids
import pytest
from jax_jobs import NP, CaseJob, needs_jax, run_cases

pytestmark = [pytest.mark.integration, needs_jax]


@pytest.fixture(scope="module")
def job() -> CaseJob:
    return run_cases("group_jax_sharded")


@pytest.mark.parametrize("case_id", jax_case_ids.SHARDED)
def test_case(job: CaseJob, case_id: str) -> None:
    job.assert_ok(case_id)


def test_job_finished_cleanly(job: CaseJob) -> None:
    assert job.returncode == 0, job.stderr[-4000:]
    assert job.stdout.count("DONE") == NP


def test_pytest_process_does_not_import_jax() -> None:
    assert "jax" not in sys.modules
