"""The external data planes (``--data-plane torch`` and ``mpi``) in real jobs: the numpy
collective suite on each, a torch training run over the torch plane whose replicas agree, a
SIGKILLed rank reported on every survivor of each, and the refusals. The mpi plane's jobs
start under Open MPI's mpirun (``hora run --data-plane mpi``) and are skipped, saying why,
without mpirun or mpi4py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import collective_suite  # tests/: framework-free
import pytest
from _case_jobs import run_job as run_case_job
from _case_jobs import spawn_ranks

from .conftest import run_job
from .numpy_suite import NumpyFactory

HERE = Path(__file__).resolve().parent
PLANE_WORKER = str(HERE / "plane_worker.py")

pytestmark = pytest.mark.integration


def _mpi_missing() -> str:
    if shutil.which("mpirun") is None:
        return "Open MPI's mpirun is not installed (apt-get install openmpi-bin)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install mpi4py)"
    return ""


MPI_MISSING = _mpi_missing()
PLANES = ["torch", pytest.param("mpi", marks=pytest.mark.skipif(bool(MPI_MISSING),
                                                                 reason=MPI_MISSING or "-"))]
# Open MPI refuses to run as root without these (CI runs as root).
ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20",
       "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("plane", PLANES)
def test_the_collective_suite_passes_on_the_plane(plane: str) -> None:
    env = {**ENV, "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    job = run_case_job(3, ["--data-plane", plane, "-x", "HORA_LOG_LEVEL=info",
                           str(HERE / "numpy_suite.py")], env, HERE, timeout=180.0)
    ids = [case_id for case_id, _ in collective_suite.cases(NumpyFactory())]
    bad = {case_id: job.status(case_id) for case_id in ids
           if job.status(case_id) != {0: "OK", 1: "OK", 2: "OK"}}
    assert not bad, f"{len(bad)} of {len(ids)} cases failed: {bad}\n{job.stderr[-4000:]}"
    assert job.returncode == 0, job.stderr[-4000:]
    # the bytes went through the plane (int16 sums, which the plane lacks, through hora's own)
    assert job.stderr.count(f"process set 0 (3 ranks) data path: {plane}") == 3, job.stderr[-3000:]
    lacking = "Sum allreduce of int16" if plane == "torch" else "Sum allreduce of float16"
    assert f"{lacking} on the {plane} data plane: runs on hora's builtin path" in job.stderr


def test_torch_training_replicas_agree() -> None:
    """hora.torch's DistributedOptimizer over the torch plane (the mpi plane runs the same
    engine path: its suite above covers it)."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    plane = "torch"
    job = run_job(2, "train", script=PLANE_WORKER, launcher_args=("--data-plane", plane),
                  env=ENV, timeout=120)
    assert job.returncode == 0, job.stdout + job.stderr
    lines = job.lines("TRAIN")
    assert len(lines) == 2, job.stdout + job.stderr
    found = [re.fullmatch(r"TRAIN rank (\d) path (\w+) gloo_enabled True mpi_enabled False "
                          r"loss ([\d.]+) -> ([\d.]+) checksum (.+)", line) for line in lines]
    assert all(found), lines
    assert {m.group(2) for m in found if m} == {plane}
    assert len({m.group(5) for m in found if m}) == 1, f"replicas differ: {lines}"
    first, last = (float(x) for x in found[0].group(3, 4))  # type: ignore[union-attr]
    assert last < 0.5 * first, lines  # it learned


@pytest.mark.parametrize("plane", PLANES)
def test_a_killed_rank_is_reported_on_every_survivor(plane: str) -> None:
    job = run_job(3, "dead", script=PLANE_WORKER, launcher_args=("--data-plane", plane),
                  env=ENV, timeout=90)
    assert job.returncode != 0
    errors = job.lines("ERR")
    assert sorted(int(line.split()[2]) for line in errors) == [0, 2], job.stdout + job.stderr
    for line in errors:
        seconds = float(re.search(r"after (-?[\d.]+)s", line).group(1))  # type: ignore[union-attr]
        assert seconds < 5, line
        assert "rank 1 (host " in line and "closed its" in line, line
    if plane == "mpi":  # mpirun's own report of the death follows hora's
        assert "exited on signal 9 (Killed)" in job.stdout + job.stderr


@pytest.mark.parametrize("plane", PLANES)
def test_one_report_per_failure_on_the_plane(plane: str) -> None:
    """As with hora's own launch (docs/faults.md, "What `hora run` prints when a rank fails"):
    the root cause's traceback once, the other rank's consequence in one line, the summary.
    Under mpirun every rank's traceback used to be printed in full."""
    job = run_job(2, "raises", script=PLANE_WORKER, launcher_args=("--data-plane", plane),
                  env=ENV, timeout=90)
    assert job.returncode != 0
    out = job.stdout + job.stderr
    assert out.count("Traceback (most recent call last):") == 1, out
    assert "[1]<stderr>:ValueError: bad input shape 42" in out, out
    assert "[hora] also failed after rank 1: rank 0 raised ShutdownError" in out, out
    assert re.search(r"\[hora\] .*rank 1's error \(its traceback is above\):\n"
                     r"\[hora\]   ValueError: bad input shape 42", out), out


def test_the_mpi_plane_needs_mpirun() -> None:
    """Ranks started by another launcher (here torchrun's variables) fail init() alike."""
    from hora._util.net import free_port

    port = free_port()
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "HORA_DATA_PLANE": "mpi",
             "HORA_START_TIMEOUT": "20"} for r in range(2)]
    code = "import hora; hora.init()"
    for returncode, out in spawn_ranks([sys.executable, "-c", code], envs, timeout=60):
        assert returncode != 0
        assert ("HORA_DATA_PLANE=mpi needs ranks started by mpirun, but this job was started "
                "by torchrun: run `hora run --data-plane mpi") in out, out


def test_an_unknown_plane_is_refused_before_anything_starts() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    for how, extra in (("flag", ["--data-plane", "nccl"]), ("env", [])):
        proc = subprocess.run(
            [sys.executable, "-m", "hora.runner.cli", "run", "-np", "2", *extra, "true"],
            capture_output=True, text=True, timeout=60,
            env={**env, **({"HORA_DATA_PLANE": "nccl"} if how == "env" else {})})
        assert proc.returncode == 2, (how, proc.stderr)
        assert "expected one of builtin, torch, mpi" in proc.stderr, (how, proc.stderr)
