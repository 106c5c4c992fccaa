"""The Keras ShardedOptimizer (hora-only) with ``model.fit``: Keras 3 and tf-keras (Keras 2,
``TF_USE_LEGACY_KERAS=1``), one real 2-rank ``hora run`` job each, and a 4-rank Keras 3 job
(one pytest test per case; tf-keras skipped without it). This process never imports
TensorFlow or Keras."""

from __future__ import annotations

import pytest
from tf_jobs import (
    LEGACY_KERAS_ENV,
    NP,
    CaseJob,
    case_ids,
    needs_tf,
    needs_tf_keras,
    run_cases,
)

pytestmark = [pytest.mark.integration, needs_tf]


@pytest.fixture(scope="module")
def job() -> CaseJob:
    return run_cases("group_tf_keras_sharded", timeout=200.0)


@pytest.fixture(scope="module")
def job4() -> CaseJob:
    return run_cases("group_tf_keras_sharded4", np_=4, timeout=300.0)


@pytest.fixture(scope="module")
def job2() -> CaseJob:
    return run_cases("group_tf_keras2_sharded", env=LEGACY_KERAS_ENV, timeout=200.0)


@pytest.mark.parametrize("case_id", case_ids("group_tf_keras_sharded"))
def test_keras3(job: CaseJob, case_id: str) -> None:
    job.assert_ok(case_id)


@pytest.mark.parametrize("case_id", case_ids("group_tf_keras_sharded4"))
def test_keras3_four_ranks(job4: CaseJob, case_id: str) -> None:
    job4.assert_ok(case_id)


@needs_tf_keras
@pytest.mark.parametrize("case_id", case_ids("group_tf_keras2_sharded"))
def test_tf_keras(job2: CaseJob, case_id: str) -> None:
    job2.assert_ok(case_id)


def test_jobs_finished_cleanly(job: CaseJob) -> None:
    assert job.returncode == 0, job.stderr[-4000:]
    assert job.stdout.count("DONE") == NP


def test_pytest_process_never_imports_tensorflow() -> None:
    import sys

    assert "tensorflow" not in sys.modules and "keras" not in sys.modules
