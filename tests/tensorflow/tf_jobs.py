"""Real multi-process jobs for the TensorFlow adapter tests (the pattern of tests/torch/conftest.py:
one `hora run` job per test module runs many cases and prints ``CASE <id> OK`` per rank; every
case id is one pytest test; hard timeout; only the job's own process group is killed).

No ``__init__.py`` in this directory (a package named ``tensorflow`` would shadow the real one)
and no ``conftest.py`` (tests/torch has one; two top-level ``conftest`` modules would collide in
``from conftest import``). The pytest process never imports TensorFlow: only the ranks do.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "tf_worker.py")
NP = 2

HAVE_TF = importlib.util.find_spec("tensorflow") is not None
needs_tf = pytest.mark.skipif(not HAVE_TF, reason="tensorflow is not installed "
                              "(pip install hora[tensorflow])")

# Fail fast instead of hanging: stalled ops error out after 20 s, warnings after 5 s. The
# framework-neutral collective suite lives in tests/torch (it imports no framework).
JOB_ENV = {
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20",
    "OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow",
    "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent / "torch"),
                                   os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
}


@dataclass
class CaseJob:
    """Outcome of one job: per case id, the status line of each rank."""

    np: int
    returncode: int
    stdout: str
    stderr: str

    def status(self, case_id: str) -> dict[int, str]:
        found: dict[int, str] = {}
        for line in self.stdout.splitlines():
            prefix, _, payload = line.partition(">:")
            if not payload.startswith(f"CASE {case_id} "):
                continue
            rank = int(prefix.lstrip("[").split("]")[0])
            found[rank] = payload[len(f"CASE {case_id} "):]
        return found

    def assert_ok(self, case_id: str) -> None:
        found = self.status(case_id)
        bad = {r: s for r, s in found.items() if s != "OK"}
        missing = [r for r in range(self.np) if r not in found]
        if bad or missing:
            pytest.fail(f"case {case_id}: failed on {bad}, no report from ranks {missing} "
                        f"(job exit {self.returncode})\n--- stdout tail\n{self.stdout[-3000:]}"
                        f"\n--- stderr tail\n{self.stderr[-6000:]}")


def run_cases(group: str, np_: int = NP, timeout: float = 240.0) -> CaseJob:
    """`hora run -np N python tf_worker.py GROUP`, its process group killed on timeout."""
    return run_command(["-np", str(np_), WORKER, group], np_=np_, timeout=timeout)


def run_command(args: list[str], np_: int = NP, timeout: float = 240.0,
                cwd: Path = HERE) -> CaseJob:
    """`hora run <args>` (the script runs under this Python), its process group killed on
    timeout."""
    script = next(i for i, a in enumerate(args) if a.endswith(".py"))
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", *args[:script], sys.executable,
           *args[script:]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **JOB_ENV}, start_new_session=True, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[job killed after {timeout} s]"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return CaseJob(np_, proc.returncode, out, err)
