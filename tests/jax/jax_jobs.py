"""Real multi-process jobs for the JAX adapter tests (the pattern of tests/torch/conftest.py:
one `hora run` job per test module runs many cases and prints ``CASE <id> OK`` per rank; every
case id is one pytest test; hard timeout; only the job's own process group is killed).

No ``__init__.py`` in this directory (a package named ``jax`` would shadow the real one) and no
``conftest.py`` (two top-level ``conftest`` modules would collide). The pytest process never
imports JAX: only the ranks do, and the case ids come from :mod:`jax_case_ids`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from _case_jobs import CaseJob, run_job

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "jax_worker.py")
NP = 2

HAVE_JAX = all(importlib.util.find_spec(m) is not None for m in ("jax", "optax"))
needs_jax = pytest.mark.skipif(not HAVE_JAX, reason="jax/optax are not installed "
                               "(pip install hora[jax])")

# Fail fast instead of hanging; x64 on so int64/float64 are exercised; one thread per rank.
JOB_ENV = {
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20",
    "OMP_NUM_THREADS": "1", "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent),
                                   os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
}


def run_cases(group: str, np_: int = NP, timeout: float = 150.0) -> CaseJob:
    """`hora run -np N python jax_worker.py GROUP`, its process group killed on timeout."""
    return run_job(np_, [WORKER, group], JOB_ENV, HERE, timeout)
