"""The rest of hora.tensorflow's Horovod API (graph topology ops, SyncBatchNormalization, the
tf.compat.v1 DistributedOptimizer, broadcast_global_variables and its session hook) in one real
2-rank ``hora run`` job (one pytest test per case). This process never imports TensorFlow."""

from __future__ import annotations

import ast

import pytest
from tf_jobs import HERE, NP, CaseJob, needs_tf, run_cases

pytestmark = [pytest.mark.integration, needs_tf]


def _case_ids() -> list[str]:
    """``CASE_IDS`` of group_tf_api.py, read without importing it (it imports TensorFlow)."""
    tree = ast.parse((HERE / "group_tf_api.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CASE_IDS":
            return list(ast.literal_eval(node.value))
    raise AssertionError("group_tf_api.py has no CASE_IDS")


@pytest.fixture(scope="module")
def job() -> CaseJob:
    return run_cases("group_tf_api")


@pytest.mark.parametrize("case_id", _case_ids())
def test_case(job: CaseJob, case_id: str) -> None:
    job.assert_ok(case_id)


def test_job_finished_cleanly(job: CaseJob) -> None:
    assert job.returncode == 0, job.stderr[-4000:]
    assert job.stdout.count("DONE") == NP


def test_pytest_process_never_imports_tensorflow() -> None:
    import sys

    assert "tensorflow" not in sys.modules and "keras" not in sys.modules
