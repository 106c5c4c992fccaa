"""Real multi-process jobs for the torch adapter tests (`hora run`, hard timeout, cleanup).

No ``__init__.py`` here on purpose: a package named ``torch`` under ``tests/`` would shadow the
real torch. Each test module runs ONE job (module-scoped fixture) that executes many cases and
reports ``CASE <id> OK`` per rank; every case id is then one pytest test.
"""

from __future__ import annotations

import os
from pathlib import Path

from _case_jobs import CaseJob, run_job

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "torch_worker.py")

# Fail fast instead of hanging: stalled ops error out after 20 s, warnings after 5 s.
JOB_ENV = {
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20",
    "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
}


def run_cases(np_: int, group: str, timeout: float = 80.0,
              launcher_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> CaseJob:
    """`hora run -np N [launcher_args] python torch_worker.py GROUP`, whole process group killed
    on timeout."""
    return run_job(np_, [*launcher_args, WORKER, group], {**JOB_ENV, **(env or {})}, HERE,
                   timeout)
