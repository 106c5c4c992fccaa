"""Keras 2 through tf-keras (``TF_USE_LEGACY_KERAS=1``: ``tf.keras`` is tf-keras) with
``hora.tensorflow.keras`` / ``hora.keras``, in one real 2-rank ``hora run`` job (one pytest
test per case; skipped without tf-keras). This process never imports TensorFlow or Keras."""

from __future__ import annotations

import pytest
from tf_jobs import LEGACY_KERAS_ENV, NP, CaseJob, case_ids, needs_tf_keras, run_cases

pytestmark = [pytest.mark.integration, needs_tf_keras]


@pytest.fixture(scope="module")
def job() -> CaseJob:
    return run_cases("group_tf_keras2", env=LEGACY_KERAS_ENV, timeout=300.0)


@pytest.mark.parametrize("case_id", case_ids("group_tf_keras2"))
def test_case(job: CaseJob, case_id: str) -> None:
    job.assert_ok(case_id)


def test_job_finished_cleanly(job: CaseJob) -> None:
    assert job.returncode == 0, job.stderr[-4000:]
    assert job.stdout.count("DONE") == NP


def test_pytest_process_never_imports_tensorflow() -> None:
    import sys

    assert "tensorflow" not in sys.modules and "keras" not in sys.modules
    assert "tf_keras" not in sys.modules
