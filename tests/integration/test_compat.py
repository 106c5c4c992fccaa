"""Horovod's way of running tests: many tests in one process per rank, in one job, in a random
order shared by the ranks (tests/integration/compat_cases.py). The state one test leaves (shut
down, other process sets, a failed op, a deadlock, a join, a timeline) must not break the next.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from .conftest import run_job

pytestmark = pytest.mark.integration

SCRIPT = str(Path(__file__).with_name("compat_worker.py"))


def test_many_tests_in_one_process_per_rank_in_a_random_order() -> None:
    seed = random.randrange(1 << 30)
    job = run_job(2, str(seed), timeout=120, script=SCRIPT,
                  env={"HORA_DEADLOCK_TIME_SECONDS": "0.3"})
    summaries = [line for line in job.stdout.splitlines() if re.search(r"\d+ passed", line)]
    detail = f"seed {seed}\n{job.stdout[-6000:]}\n{job.stderr[-3000:]}"
    assert job.returncode == 0, detail
    assert len(summaries) == 2, detail
    for line in summaries:
        assert "failed" not in line and "error" not in line, detail
        assert int(re.search(r"(\d+) passed", line).group(1)) >= 14, detail
    orders = {line.split(">:", 1)[1] for line in job.stdout.splitlines() if ">:ORDER " in line}
    assert len(orders) == 1, f"ranks ran different orders: {orders}"
