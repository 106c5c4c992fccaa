"""The framework-neutral collective suite (tests/collective_suite.py, also run through
hora.torch, hora.tensorflow and hora.jax) through hora's numpy API, in one real 3-rank job."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _case_jobs import CaseJob, run_job

HERE = Path(__file__).resolve().parent
import collective_suite  # noqa: E402  (tests/: framework-free)

from .numpy_suite import NumpyFactory  # noqa: E402

pytestmark = pytest.mark.integration
NP = 3
CASE_IDS = [case_id for case_id, _ in collective_suite.cases(NumpyFactory())]
JOB_ENV = {
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20",
    "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
}


@pytest.fixture(scope="module")
def job() -> CaseJob:
    return run_job(NP, [str(HERE / "numpy_suite.py")], JOB_ENV, HERE, timeout=120.0)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_case(job: CaseJob, case_id: str) -> None:
    job.assert_ok(case_id)


def test_job_finished_cleanly(job: CaseJob) -> None:
    assert job.returncode == 0, job.stderr[-4000:]
    assert job.stdout.count("DONE") == NP
