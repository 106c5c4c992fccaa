"""hora.torch.ShardedOptimizer (hora-only) in two real jobs: 4 ranks (process sets, resize,
writes a full-state checkpoint), then 2 ranks (loads it). One pytest test per case and job;
tolerances and cases are in sharded_cases.py."""

from __future__ import annotations

from pathlib import Path

import group_sharded
import group_sharded4
import pytest
from conftest import CaseJob, run_cases

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sharded_ckpt")


@pytest.fixture(scope="module")
def job4(ckpt_dir: Path) -> CaseJob:
    return run_cases(group_sharded4.NP, "group_sharded4", timeout=150.0,
                     env={"SHARDED_CKPT_DIR": str(ckpt_dir)})


@pytest.fixture(scope="module")
def job2(job4: CaseJob, ckpt_dir: Path) -> CaseJob:
    return run_cases(group_sharded.NP, "group_sharded", timeout=100.0,
                     env={"SHARDED_CKPT_DIR": str(ckpt_dir)})


@pytest.mark.parametrize("case_id", [c for c, _ in group_sharded4.cases()])
def test_four_ranks(job4: CaseJob, case_id: str) -> None:
    job4.assert_ok(case_id)


@pytest.mark.parametrize("case_id", [c for c, _ in group_sharded.cases()])
def test_two_ranks(job2: CaseJob, case_id: str) -> None:
    job2.assert_ok(case_id)


def test_jobs_finished_cleanly(job4: CaseJob, job2: CaseJob) -> None:
    assert job4.returncode == 0, job4.stderr[-4000:]
    assert job2.returncode == 0, job2.stderr[-4000:]
