"""examples/jax_digits.py as a real 2-rank job (hard timeout, its process group killed after).
The pytest process does not import JAX; skipped when jax/optax/flax are not installed."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
from _case_jobs import run_group

pytestmark = [pytest.mark.integration, pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("jax", "optax", "flax", "sklearn")),
    reason="needs jax, optax, flax and scikit-learn (pip install hora[jax])")]

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "jax_digits.py"


def test_jax_digits_two_ranks(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(HOROVOD_STALL_CHECK_TIME_SECONDS="5", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="20",
               OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu")
    ran = run_group([sys.executable, "-m", "hora.runner.cli", "run", "-np", "2",
                     sys.executable, str(SCRIPT), "--epochs", "6"], timeout=90, env=env,
                    cwd=tmp_path)
    out, err = ran.stdout, ran.stderr
    explain = f"exit {ran.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    assert ran.returncode == 0, explain
    assert "[0]<stdout>:parameters identical on all 2 ranks: True" in out, explain
    match = re.search(r"\[0\]<stdout>:final validation accuracy (\d+\.\d)% \(2 ranks\)", out)
    assert match and float(match.group(1)) >= 90.0, explain
    assert "[1]<stdout>:final validation" not in out, "only rank 0 reports"
    # each epoch line shows that epoch's own time: together they fit in the total, not grow to it
    epochs = [float(s) for s in re.findall(r"\[0\]<stdout>:epoch +\d+ .*\((\d+\.\d+) s\)", out)]
    total = re.search(r"\[0\]<stdout>:trained 6 epochs in (\d+\.\d+) s", out)
    assert len(epochs) == 6 and total, explain
    assert sum(epochs) <= float(total.group(1)) + 0.01 * len(epochs), explain
