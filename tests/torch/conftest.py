"""Real multi-process jobs for the torch adapter tests (`hora run`, hard timeout, cleanup).

No ``__init__.py`` here on purpose: a package named ``torch`` under ``tests/`` would shadow the
real torch. Each test module runs ONE job (module-scoped fixture) that executes many cases and
reports ``CASE <id> OK`` per rank; every case id is then one pytest test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "torch_worker.py")

# Fail fast instead of hanging: stalled ops error out after 20 s, warnings after 5 s.
JOB_ENV = {
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20",
    "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
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


def run_cases(np_: int, group: str, timeout: float = 80.0) -> CaseJob:
    """`hora run -np N python torch_worker.py GROUP`, whole process group killed on timeout."""
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(np_), sys.executable,
           WORKER, group]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **JOB_ENV}, start_new_session=True, cwd=HERE)
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
