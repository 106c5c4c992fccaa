"""Real multi-process jobs for the TensorFlow adapter tests (the pattern of tests/torch/conftest.py:
one `hora run` job per test module runs many cases and prints ``CASE <id> OK`` per rank; every
case id is one pytest test; hard timeout; only the job's own process group is killed).

No ``__init__.py`` in this directory (a package named ``tensorflow`` would shadow the real one)
and no ``conftest.py`` (tests/torch has one; two top-level ``conftest`` modules would collide in
``from conftest import``). The pytest process never imports TensorFlow: only the ranks do.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import pytest
from _case_jobs import CaseJob, run_job

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "tf_worker.py")
NP = 2

HAVE_TF = importlib.util.find_spec("tensorflow") is not None
needs_tf = pytest.mark.skipif(not HAVE_TF, reason="tensorflow is not installed "
                              "(pip install hora[tensorflow])")
HAVE_TF_KERAS = HAVE_TF and importlib.util.find_spec("tf_keras") is not None
needs_tf_keras = pytest.mark.skipif(not HAVE_TF_KERAS, reason="tf-keras is not installed "
                                    "(pip install tf-keras, matching tensorflow's version)")
LEGACY_KERAS_ENV = {"TF_USE_LEGACY_KERAS": "1"}
"""Makes ``tf.keras`` tf-keras (Keras 2) in the ranks (read when TensorFlow is imported)."""

# Fail fast instead of hanging: stalled ops error out after 20 s, warnings after 5 s. The
# framework-neutral collective suite lives in tests/torch (it imports no framework).
JOB_ENV = {
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20",
    "OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow",
    "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent),
                                   os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
}


def case_ids(group: str) -> list[str]:
    """``CASE_IDS`` of ``<group>.py`` in this directory, read without importing it (it imports
    TensorFlow or Keras)."""
    tree = ast.parse((HERE / f"{group}.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CASE_IDS":
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{group}.py has no CASE_IDS")


def run_cases(group: str, np_: int = NP, timeout: float = 240.0,
              env: dict[str, str] | None = None) -> CaseJob:
    """`hora run -np N python tf_worker.py GROUP` (``env`` added to the job's environment),
    its process group killed on timeout."""
    return run_job(np_, [WORKER, group], {**JOB_ENV, **(env or {})}, HERE, timeout)


def run_command(args: list[str], np_: int = NP, timeout: float = 240.0,
                cwd: Path = HERE) -> CaseJob:
    """`hora run -np N <args>` (the script runs under this Python), its process group killed
    on timeout."""
    return run_job(np_, args, JOB_ENV, cwd, timeout)
