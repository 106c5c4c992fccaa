"""Nothing left in /dev/shm: ranks SIGKILLed outside `hora run` (torchrun-style env, a real
mpirun, every rank at once) leave no segment (names are unlinked once a group exists); segments
of processes that died before that (or of older versions) are swept by the next job on the host
and by `hora clean`.

Each job gets its own HORA_JOB_ID, so only its segments are looked at (other jobs may run)."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _case_jobs import spawn_ranks

from hora._util import shm_owners
from hora._util.net import free_port
from hora._util.shm_names import job_segments

pytestmark = pytest.mark.timeout(120)

WORKER = str(Path(__file__).with_name("shm_cleanup_worker.py"))
_ids = itertools.count()


def _job_id() -> str:
    return f"cleanup{os.getpid()}_{next(_ids)}"


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    return {**env, "HORA_START_TIMEOUT": "30", "OMP_NUM_THREADS": "1", **extra}


def _torchrun_envs(n: int, job_id: str) -> list[dict[str, str]]:
    port, store_port = str(free_port()), str(free_port())
    return [_clean_env({"RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r),
                        "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                        "HORA_RENDEZVOUS_PORT": store_port, "HORA_JOB_ID": job_id})
            for r in range(n)]


def _spawn(envs: list[dict[str, str]], scenario: str, timeout: float = 60
           ) -> list[tuple[int, str]]:
    """One worker per env, as an external launcher would start them; (returncode, output)."""
    return spawn_ranks([sys.executable, WORKER, scenario], envs, timeout)


def test_survivors_remove_a_sigkilled_peers_segments_under_torchrun_env() -> None:
    job = _job_id()
    results = _spawn(_torchrun_envs(3, job), "kill_one")
    assert results[2][0] == -signal.SIGKILL, results[2][1]
    for code, out in results[:2]:
        assert code == 3 and "RAISED" in out, out
    assert job_segments(job) == []


@pytest.mark.skipif(shutil.which("mpirun") is None,
                    reason="Open MPI's mpirun is not installed (apt-get install openmpi-bin)")
def test_survivors_remove_a_sigkilled_peers_segments_under_real_mpirun() -> None:
    job = _job_id()
    env = _clean_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                      "HORA_JOB_ID": job})
    proc = subprocess.Popen(["mpirun", "--oversubscribe", "-np", "3", sys.executable, WORKER,
                             "kill_one"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert out.count("RAISED") == 2, out
    assert job_segments(job) == []


def test_a_job_whose_every_rank_was_sigkilled_leaves_nothing() -> None:
    job = _job_id()
    results = _spawn(_torchrun_envs(2, job), "kill_all")
    assert all(code == -signal.SIGKILL for code, _ in results), results
    assert all("READY" in out for _, out in results), results
    assert job_segments(job) == []


def _dead_process_segments(job: str) -> list[str]:
    """Segments as a rank SIGKILLed before it unlinked them leaves them (a header naming a
    process that has exited, and its data segments), in the real /dev/shm."""
    import struct

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    start = shm_owners.process_start_time(proc.pid) or 0
    proc.kill()
    proc.wait()
    words = [0] * 16
    words[shm_owners.W_MAGIC], words[shm_owners.W_PID] = shm_owners.MAGIC, proc.pid
    words[shm_owners.W_START_LO], words[shm_owners.W_START_HI] = start & 0xFFFFFFFF, start >> 32
    words[shm_owners.W_PIDNS] = shm_owners.pid_namespace()
    paths = []
    for kind, data in (("h", struct.pack("<16I", *words)), ("d0", b"\0" * 4096),
                       ("d1", b"\0" * 4096)):
        path = f"/dev/shm/hora-{job}-feedbeef-0-{kind}"
        with open(path, "wb") as f:
            f.write(data)
        paths.append(path)
    return sorted(paths)


def test_next_job_sweeps_segments_of_dead_processes() -> None:
    dead_job = _job_id()
    left = _dead_process_segments(dead_job)
    assert job_segments(dead_job) == left
    assert set(left) <= set(shm_owners.stale_segments())
    results = _spawn(_torchrun_envs(2, _job_id()), "simple")
    assert all(code == 0 for code, _ in results), results
    assert job_segments(dead_job) == []


def test_hora_clean_removes_what_dead_processes_left(capfd: pytest.CaptureFixture[str]) -> None:
    from hora.runner.cli import main

    job = _job_id()
    left = _dead_process_segments(job)
    assert main(["clean", "--dry-run"]) == 0
    out = capfd.readouterr().out
    assert all(f"would remove {p}" in out for p in left), out
    assert job_segments(job) == left
    assert main(["clean"]) == 0
    out = capfd.readouterr().out
    assert all(f"removed {p}" in out for p in left), out
    assert job_segments(job) == []


def test_sweep_leaves_live_and_unjudgeable_owners_alone(tmp_path: Path) -> None:
    import struct

    def header(name: str, pid: int, start: int, pidns: int) -> None:
        words = [0] * 16
        words[shm_owners.W_MAGIC] = shm_owners.MAGIC
        words[shm_owners.W_PID], words[shm_owners.W_PIDNS] = pid, pidns
        words[shm_owners.W_START_LO] = start
        (tmp_path / f"hora-j-{name}-h").write_bytes(struct.pack("<16I", *words))
        (tmp_path / f"hora-j-{name}-d0").write_bytes(b"\0" * 64)

    me, ns = os.getpid(), shm_owners.pid_namespace()
    start = shm_owners.process_start_time(me) or 0
    header("g-0", me, start, ns)  # alive: kept
    header("g-1", me, start + 1, ns)  # a reused pid (other start time): swept
    header("g-2", me, start + 1, ns ^ 1)  # another pid namespace: cannot judge, kept
    (tmp_path / "hora-j-g-3-d1").write_bytes(b"")  # orphan data segment: only `hora clean`
    (tmp_path / "hora-j.live.0").write_bytes(b"")  # a live marker, not a segment
    stale = [os.path.basename(p) for p in shm_owners.stale_segments(str(tmp_path))]
    assert stale == ["hora-j-g-1-d0", "hora-j-g-1-h"]
    with_orphans = shm_owners.stale_segments(str(tmp_path), orphans=True)
    assert [os.path.basename(p) for p in with_orphans] == [
        "hora-j-g-1-d0", "hora-j-g-1-h", "hora-j-g-3-d1"]
    shm_owners.sweep(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["hora-j-g-0-d0", "hora-j-g-0-h", "hora-j-g-2-d0",
                                            "hora-j-g-2-h", "hora-j-g-3-d1", "hora-j.live.0"]
