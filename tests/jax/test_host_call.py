"""hora.jax.host_call in one child process (host_call_cases.py, one pytest test per case):
the FFI handler's operand and result views, in-place aliasing, pieces, ``into``, errors.
This process never imports JAX."""

from __future__ import annotations

import os
import sys

import pytest
from _case_jobs import Ran, run_group
from jax_jobs import HERE, JOB_ENV, needs_jax

pytestmark = [needs_jax]

IDS = ["operands-read-only", "aliased-in-place", "pieces-from-new-buffer", "into-outputs",
       "errors-reach-jax"]
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def job() -> Ran:
    return run_group([sys.executable, str(HERE / "host_call_cases.py")], timeout=TIMEOUT,
                     env={**os.environ, **JOB_ENV, "JAX_ENABLE_X64": "0"}, cwd=HERE)


@pytest.mark.parametrize("case_id", IDS)
def test_case(job: Ran, case_id: str) -> None:
    status = [line.split(" ", 2)[2] for line in job.stdout.splitlines()
              if line.startswith(f"CASE {case_id} ")]
    if status != ["OK"]:
        pytest.fail(f"case {case_id}: {status or 'no report'} (exit {job.returncode}, timed "
                    f"out: {job.timed_out})\n--- stdout\n{job.stdout[-3000:]}\n--- stderr\n"
                    f"{job.stderr[-6000:]}")


def test_all_cases_ran(job: Ran) -> None:
    assert job.returncode == 0, job.stderr[-4000:]
    assert job.stdout.count("CASE ") == len(IDS)


def test_pytest_process_does_not_import_jax() -> None:
    assert "jax" not in sys.modules
