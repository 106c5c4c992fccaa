"""hora.spark's Estimators (TorchEstimator, KerasEstimator) on a real Spark in local mode.

The driver runs in its own process (estimator_cases.py: one local[2] SparkSession, 2 ranks per
fit), with a hard timeout and its process group killed afterwards, so that this pytest process
never imports Spark's JVM, torch or Keras for them; each of its cases is one test here.
Skipped without pyspark, pyarrow, torch, Keras or a Java runtime.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "estimator_cases.py"
TIMEOUT_S = 540

_MISSING = [m for m in ("pyspark", "pyarrow", "torch", "keras", "tensorflow", "sklearn")
            if importlib.util.find_spec(m) is None]
if _MISSING:
    pytest.skip(f"not installed: {', '.join(_MISSING)} (pip install hora[spark] with torch and "
                "tensorflow)", allow_module_level=True)
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("no Java runtime for Spark (install a JRE, e.g. Debian's default-jre-headless)",
                allow_module_level=True)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(TIMEOUT_S + 60)]

CASES = [node.name[len("case_"):] for node in ast.parse(DRIVER.read_text()).body
         if isinstance(node, ast.FunctionDef) and node.name.startswith("case_")]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    def status(self, case: str) -> str | None:
        for line in self.stdout.splitlines():
            if line.startswith(f"CASE {case} "):
                return line[len(f"CASE {case} "):]
        return None


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    work = tmp_path_factory.mktemp("estimators")
    env = {**os.environ, "HOROVOD_STALL_CHECK_TIME_SECONDS": "10",
           "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(DRIVER), str(work)], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[driver killed after {TIMEOUT_S} s]"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the JVM and the ranks with it
        except ProcessLookupError:
            pass
    return Run(proc.returncode, out, err)


@pytest.mark.parametrize("case", CASES)
def test_case(run: Run, case: str) -> None:
    status = run.status(case)
    if status is None or not status.startswith("OK"):
        pytest.fail(f"case {case}: {status or 'no report'} (driver exit {run.returncode})\n"
                    f"--- stdout tail\n{run.stdout[-4000:]}\n--- stderr tail\n"
                    f"{run.stderr[-6000:]}")


def test_the_driver_finished_cleanly(run: Run) -> None:
    assert run.returncode == 0, run.stderr[-4000:]


def test_this_process_never_imported_tensorflow() -> None:
    # The estimators run in their own driver process: TensorFlow and Keras stay out of pytest's
    # (tests/tensorflow asserts it too). torch may be here: other test modules import it.
    assert not {"tensorflow", "keras"} & set(sys.modules)
