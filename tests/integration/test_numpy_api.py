"""The numpy API end to end: real ranks started by `hora run`, talking over TCP on 127.0.0.1."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

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


def test_stopped_rank_is_detected_by_heartbeat() -> None:
    job = run_job(3, "stopped_rank", timeout=60, env={"HORA_HEARTBEAT_TIMEOUT_SECONDS": "2"})
    errors = job.lines("ERR")
    assert len(errors) == 2, job.stdout + job.stderr
    for line in errors:
        seconds = float(re.search(r"after ([\d.]+)s", line).group(1))  # type: ignore[union-attr]
        assert seconds < 10, line
        assert "rank 2" in line and "heartbeat" in line


def test_stalled_tensor_warns_then_fails_on_the_ranks_that_submitted_it() -> None:
    job = run_job(3, "stall", timeout=60, env={"HORA_STALL_CHECK_TIME_SECONDS": "1",
                                               "HORA_STALL_SHUTDOWN_TIME_SECONDS": "3"})
    assert job.returncode == 0, job.stdout + job.stderr
    assert "Missing ranks:\n" in job.stderr.replace("[0]<stderr>:", "")
    assert "[0]<stderr>:2: [allreduce.forgotten]" in job.stderr
    errors = job.lines("ERR")
    assert len(errors) == 2, job.stdout + job.stderr
    for line in errors:
        seconds = float(re.search(r"after ([\d.]+)s", line).group(1))  # type: ignore[union-attr]
        assert 2 < seconds < 20, line
        assert "never by ranks [2]" in line
    assert len(job.lines("OK stall")) == 3


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


def test_a_process_set_beyond_the_job_fails_init_on_every_rank() -> None:
    job = run_job(2, "sets_beyond_the_job")
    sets = job.lines("SETS")
    assert len(sets) == 2, job.stdout + job.stderr
    assert all(re.search(r"process_sets\[1\] has ranks \[0, 2\], and this job has 2 rank\(s\) "
                         r"\(0\.\.1\): \[2\] is not a rank of it", s) for s in sets), sets


def test_join_uneven_data() -> None:
    job = run_job(3, "join")
    assert job.returncode == 0, job.stdout + job.stderr
    assert sorted(job.lines("OK join")) == [f"OK join rank {r} last 2" for r in range(3)]


def _spawn_all(envs: list[dict[str, str]], scenario: str, timeout: float = 60) -> list[str]:
    """Start one worker per env dict ourselves (no hora run), as an external launcher would."""
    import sys

    from _case_jobs import spawn_ranks

    from .conftest import WORKER

    outs = []
    for code, out in spawn_ranks([sys.executable, WORKER, scenario], envs, timeout):
        assert code == 0, out
        outs.append(out)
    return outs


def test_torchrun_environment_without_hora_run() -> None:
    from hora._util.net import free_port

    port, store_port = str(free_port()), str(free_port())
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
             "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
             "HORA_RENDEZVOUS_PORT": store_port, "HORA_START_TIMEOUT": "20"} for r in range(2)]
    outs = _spawn_all(envs, "simple")
    for r, out in enumerate(outs):
        assert f"OK simple rank {r} size 2 local {r} sum [1.0, 1.0, 1.0]" in out


def test_mpirun_environment_without_hora_run() -> None:
    from hora._util.net import free_port

    # (the store port is otherwise derived from the job id: a free one keeps the test from
    # colliding with whatever holds that port on a busy machine)
    port = str(free_port())
    envs = [{"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "3",
             "OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
             "OMPI_MCA_orte_ess_jobid": f"{os.getpid()}", "HORA_START_TIMEOUT": "20",
             "HORA_RENDEZVOUS_PORT": port}
            for r in range(3)]
    outs = _spawn_all(envs, "simple")
    for r, out in enumerate(outs):
        assert f"OK simple rank {r} size 3 local {r} sum [3.0, 3.0, 3.0]" in out


@pytest.mark.skipif(shutil.which("mpirun") is None,
                    reason="Open MPI's mpirun is not installed (apt-get install openmpi-bin)")
def test_real_mpirun_launch() -> None:
    import subprocess
    import sys

    from .conftest import WORKER

    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))},
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "HORA_START_TIMEOUT": "20"}
    import signal

    proc = subprocess.Popen(["mpirun", "--oversubscribe", "-np", "2", sys.executable, WORKER,
                             "simple"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out
    for r in range(2):
        assert f"OK simple rank {r} size 2 local {r} sum [1.0, 1.0, 1.0]" in out


def test_timeline_records_phases_and_names_the_straggler(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    path = tmp_path / "timeline.json"
    job = run_job(3, "timeline", env={"HOROVOD_TIMELINE": str(path),
                                      "HORA_TIMELINE_MARK_CYCLES": "1"})
    assert job.returncode == 0, job.stdout + job.stderr
    events = json.loads(path.read_text())
    names = {e.get("name") for e in events}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "NEGOTIATE_BROADCAST", "BROADCAST",
            "CYCLE_START"} <= names
    tensors = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {"allreduce.grad0", "allreduce.grad2", "broadcast.bcast"} <= tensors
    summary = subprocess.run([sys.executable, "-m", "hora.runner.cli", "timeline", str(path)],
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    assert "allreduce.grad0" in summary.stdout and "1" in summary.stdout


def test_a_horovod_knob_typo_is_warned_once_by_rank_0() -> None:
    job = run_job(2, "simple", env={"HOROVOD_FUSION_THRESHOLDD": "1"})
    assert job.returncode == 0, job.stdout + job.stderr
    warnings = [line for line in job.stderr.splitlines() if "HOROVOD_FUSION_THRESHOLDD" in line]
    assert len(warnings) == 1, job.stderr
    assert "[0]" in warnings[0] and "did you mean HOROVOD_FUSION_THRESHOLD?" in warnings[0]


@pytest.mark.parametrize("np_", [2, 4])
def test_adasum_allreduce_end_to_end(np_: int) -> None:
    job = run_job(np_, "adasum")
    assert job.returncode == 0, job.stdout + job.stderr
    results = {line.split("rank ")[1].split(" ", 1)[1] for line in job.stdout.splitlines()
               if "OK adasum rank" in line}
    assert job.stdout.count("OK adasum rank") == np_ and len(results) == 1, job.stdout
