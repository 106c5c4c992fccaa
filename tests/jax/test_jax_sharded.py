"""hora.jax.ShardedOptimizer (hora-only) in real ``hora run`` jobs: 2 ranks
(group_jax_sharded.py) and 4 ranks (group_jax_sharded4.py); one pytest test per case. This
process never imports JAX."""

from __future__ import annotations

import sys

import jax_case_ids
import pytest
from jax_jobs import NP, CaseJob, needs_jax, run_cases

pytestmark = [pytest.mark.integration, needs_jax]


@pytest.fixture(scope="module")
def job() -> CaseJob:
    return run_cases("group_jax_sharded")


@pytest.fixture(scope="module")
def job4() -> CaseJob:
    return run_cases("group_jax_sharded4", np_=4)


@pytest.mark.parametrize("case_id", jax_case_ids.SHARDED)
def test_case(job: CaseJob, case_id: str) -> None:
    job.assert_ok(case_id)


@pytest.mark.parametrize("case_id", jax_case_ids.SHARDED4)
def test_four_ranks(job4: CaseJob, case_id: str) -> None:
    job4.assert_ok(case_id)


def test_job_finished_cleanly(job: CaseJob) -> None:
    assert job.returncode == 0, job.stderr[-4000:]
    assert job.stdout.count("DONE") == NP


def test_four_rank_job_finished_cleanly(job4: CaseJob) -> None:
    assert job4.returncode == 0, job4.stderr[-4000:]
    assert job4.stdout.count("DONE") == 4


def test_pytest_process_does_not_import_jax() -> None:
    assert "jax" not in sys.modules
