"""The numpy API end to end: real ranks started by `hora run`, talking over TCP on 127.0.0.1."""

from __future__ import annotations

import re

import pytest

from .conftest import run_job

pytestmark = pytest.mark.integration


def test_issue_acceptance_command() -> None:
    job = run_job(4, "simple")
    assert job.returncode == 0, job.stderr
    lines = sorted(ln for ln in job.stdout.splitlines() if "OK simple" in ln)
    assert len(lines) == 4
    for r, line in enumerate(lines):
        assert line.startswith(f"[{r}]<stdout>:OK simple rank {r} size 4 local {r}")
        assert line.endswith("sum [6.0, 6.0, 6.0]")


@pytest.mark.parametrize("np_", [1, 2, 3])
def test_every_collective(np_: int) -> None:
    job = run_job(np_, "api", timeout=90)
    assert job.returncode == 0, job.stdout + job.stderr
    assert len(job.lines("OK api")) == np_


def test_shape_mismatch_is_an_error_on_every_rank_with_one_text() -> None:
    job = run_job(3, "mismatch")
    assert job.returncode == 0, job.stderr
    errors = job.lines("ERR")
    assert len(errors) == 3 and len(set(errors)) == 1, errors
    assert "Mismatched ALLREDUCE tensor shapes" in errors[0]
    assert "allreduce.bad" in errors[0] and "ranks [1] had [4]" in errors[0]
    assert len(job.lines("OK mismatch")) == 3


def test_vanished_rank_fails_the_others_fast() -> None:
    job = run_job(3, "dead_rank", timeout=60)
    errors = job.lines("ERR")
    assert len(errors) == 2, job.stdout + job.stderr
    for line in errors:
        seconds = float(re.search(r"after ([\d.]+)s", line).group(1))  # type: ignore[union-attr]
        assert seconds < 10, line
        assert "rank 2" in line
    assert len(job.lines("NEXT")) == 2


def test_init_shutdown_init() -> None:
    job = run_job(2, "reinit")
    assert job.returncode == 0, job.stderr
    assert len(job.lines("OK reinit")) == 2


def test_bad_input_messages() -> None:
    job = run_job(2, "bad_input")
    assert job.returncode == 0, job.stderr
    assert all("hvd.init()" in ln for ln in job.lines("NOTINIT")) and job.lines("NOTINIT")
    dtype = job.lines("DTYPE")[0]
    assert "complex64" in dtype and "float32" in dtype and "bfloat16" in dtype
    assert "same name as another tensor" in job.lines("DUP")[0]


def test_process_sets_static_and_dynamic() -> None:
    job = run_job(3, "process_sets")
    assert job.returncode == 0, job.stdout + job.stderr
    assert len(job.lines("OK process_sets")) == 3
    assert "Rank 1 is not a member" in job.lines("NOTMEMBER")[0]
    job = run_job(3, "dynamic_sets")
    assert job.returncode == 0, job.stdout + job.stderr
    assert len(job.lines("OK dynamic")) == 3


def test_mismatched_process_sets_fail_init_on_every_rank() -> None:
    job = run_job(3, "mismatched_sets")
    sets = job.lines("SETS")
    assert len(sets) == 3, job.stdout + job.stderr
    assert all("mismatching process sets" in s for s in sets)


def test_join_uneven_data() -> None:
    job = run_job(3, "join")
    assert job.returncode == 0, job.stdout + job.stderr
    assert sorted(job.lines("OK join")) == [f"OK join rank {r} last 2" for r in range(3)]
