"""The rest of hora.tensorflow's Horovod API (graph topology ops, SyncBatchNormalization, the
tf.compat.v1 DistributedOptimizer, broadcast_global_variables and its session hook) in one real
2-rank ``hora run`` job (one pytest test per case). This process never imports TensorFlow."""

from __future__ import annotations

import pytest
from tf_jobs import NP, CaseJob, case_ids, needs_tf, run_cases

pytestmark = [pytest.mark.integration, needs_tf]




@pytest.fixture(scope="module")
def job() -> CaseJob:
    return run_cases("group_tf_api")


@pytest.mark.parametrize("case_id", case_ids("group_tf_api"))
def test_case(job: CaseJob, case_id: str) -> None:
    job.assert_ok(case_id)


def test_job_finished_cleanly(job: CaseJob) -> None:
    assert job.returncode == 0, job.stderr[-4000:]
    assert job.stdout.count("DONE") == NP


def test_pytest_process_never_imports_tensorflow() -> None:
    import sys

    assert "tensorflow" not in sys.modules and "keras" not in sys.modules
