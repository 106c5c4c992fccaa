"""examples/torch_elastic.py as a real elastic job: 3 workers, one SIGKILLs itself, training
goes on with 2, the replacement joins, the job ends with 3 and a reasonable accuracy.

    .venv/bin/pytest tests/examples/test_torch_elastic.py -q

The job runs in its own session under a hard timeout, in ``tmp_path``; its whole process group
is killed afterwards whatever happens. ``--step-delay`` stretches the run so that the
replacement, which needs a few seconds to import torch, joins before training ends.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from test_examples import run  # the same bounded runner as the other examples' tests

pytest.importorskip("torch")
pytest.importorskip("sklearn")

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "torch_elastic.py"
def worker_lines(out: str, wid: int) -> list[str]:
    """Worker ``wid``'s stdout lines, prefix removed."""
    prefix = f"[{wid}]<stdout>:"
    return [line[len(prefix):] for line in out.splitlines() if line.startswith(prefix)]


def test_a_killed_worker_is_replaced_and_training_finishes(tmp_path: Path) -> None:
    done = run([sys.executable, "-m", "hora.runner.cli", "run", "-np", "3", "--min-np", "2",
                "--max-np", "3", "--verbose", sys.executable, str(SCRIPT), "--epochs", "6",
                "--kill-worker-at-epoch", "1", "--step-delay", "0.15"],
               tmp_path, timeout=90, env={"HOROVOD_ELASTIC_TIMEOUT": "30"})
    rc, out, err = done.rc, done.out, done.err
    explain = f"exit {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-4000:]}"
    assert rc == 0, explain
    launcher = [line for line in err.splitlines() if line.startswith("[hora] elastic: ")]
    text = "\n".join(launcher)
    assert "[hora] elastic: worker 1 on localhost was killed by SIGKILL" in launcher, explain
    assert re.search(r"^\[hora\] elastic: generation 2: 2 worker\(s\) \(left: worker 1 on "
                     r"localhost; joined: none\), \d+\.\d\d s after the failure$", text, re.M), text
    assert re.search(r"^\[hora\] elastic: generation 3: 3 worker\(s\) \(left: none; joined: "
                     r"worker 3 on localhost\)", text, re.M), text

    lines = worker_lines(out, 0)  # worker 0 stays rank 0: it is the oldest survivor
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert len(epochs) == 6, explain
    assert " 2 worker(s) " in "".join(epochs) and " 3 worker(s) " in epochs[-1], epochs
    assert lines[-1].startswith("final validation accuracy"), explain
    match = re.fullmatch(r"final validation accuracy (\d+\.\d)% \(3 worker\(s\)\)", lines[-1])
    assert match and float(match.group(1)) > 85.0, lines[-1]
    for wid in (1, 2, 3):
        assert not any("final validation" in line for line in worker_lines(out, wid)), \
            "only rank 0 reports"


def test_help(tmp_path: Path) -> None:
    done = run([sys.executable, str(SCRIPT), "--help"], tmp_path, timeout=60)
    assert done.rc == 0, done.err
    assert done.out.startswith("usage: ") and "--kill-worker-at-epoch" in done.out
