"""The collective suite, tf.function, gradients, the tape and mismatch errors through
``hora.tensorflow`` in one real 2-rank ``hora run`` job (one pytest test per case). This
process never imports TensorFlow: the case ids come from :mod:`tf_case_ids`."""

from __future__ import annotations

import pytest
import tf_case_ids  # noqa: E402 - needs the path above
from tf_jobs import NP, CaseJob, needs_tf, run_cases

pytestmark = [pytest.mark.integration, needs_tf]


@pytest.fixture(scope="module")
def job() -> CaseJob:
    return run_cases("group_tf_collectives")


@pytest.mark.parametrize("case_id", tf_case_ids.all_ids())
def test_case(job: CaseJob, case_id: str) -> None:
    job.assert_ok(case_id)


def test_job_finished_cleanly(job: CaseJob) -> None:
    assert job.returncode == 0, job.stderr[-4000:]
    assert job.stdout.count("DONE") == NP
