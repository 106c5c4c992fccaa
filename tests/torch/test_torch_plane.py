"""hora.torch on the torch data plane (``--data-plane torch``), where the core gets the tensors
themselves on their device (:mod:`hora.core.op.device`): the framework-neutral collective suite
and the gradient rules, the training equivalences, and the device cases (what the plane is
handed, what is staged through host memory), each in one real job. The same device cases run
on CUDA tensors through NCCL where the machine has two GPUs (skipped here otherwise)."""

from __future__ import annotations

import group_collectives
import group_device
import group_training
import pytest
from conftest import CaseJob, run_cases

pytestmark = pytest.mark.integration

PLANE = ("--data-plane", "torch")


def _ids(module: object) -> list[str]:
    return [case_id for case_id, _ in module.cases()]  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def suite_job() -> CaseJob:
    return run_cases(group_collectives.NP, "group_collectives", launcher_args=PLANE)


@pytest.fixture(scope="module")
def training_job() -> CaseJob:
    return run_cases(group_training.NP, "group_training", launcher_args=PLANE)


@pytest.fixture(scope="module")
def device_job() -> CaseJob:
    return run_cases(group_device.NP, "group_device", launcher_args=PLANE)


@pytest.mark.parametrize("case_id", _ids(group_collectives))
def test_suite_case(suite_job: CaseJob, case_id: str) -> None:
    suite_job.assert_ok(case_id)


@pytest.mark.parametrize("case_id", _ids(group_training))
def test_training_case(training_job: CaseJob, case_id: str) -> None:
    training_job.assert_ok(case_id)


@pytest.mark.parametrize("case_id", _ids(group_device))
def test_device_case(device_job: CaseJob, case_id: str) -> None:
    device_job.assert_ok(case_id)


def test_jobs_finished_cleanly(suite_job: CaseJob, training_job: CaseJob,
                               device_job: CaseJob) -> None:
    for job, np_ in ((suite_job, group_collectives.NP), (training_job, group_training.NP),
                     (device_job, group_device.NP)):
        assert job.returncode == 0, job.stderr[-4000:]
        assert job.stdout.count("DONE") == np_


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_gpus() < 2, reason="NCCL needs a GPU per rank: this machine has fewer "
                                        "than 2 CUDA devices")
def test_cuda_tensors_go_through_nccl_without_a_host_copy() -> None:
    job = run_cases(group_device.NP, "group_device", launcher_args=PLANE, timeout=180.0,
                    env={"HORA_TEST_DEVICE": "cuda"})
    for case_id in _ids(group_device):
        job.assert_ok(case_id)
    assert job.returncode == 0, job.stderr[-4000:]
