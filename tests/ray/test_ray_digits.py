"""The demo's training on Ray: examples/ray_digits.py (2 Ray workers running
examples/torch_digits.py's ``main``) reaches the same losses and accuracy, epoch by epoch, as
``hora run -np 2 python examples/torch_digits.py`` with the same arguments and seed.

Both run as real subprocesses in their own sessions with a hard timeout; each whole process
group (the Ray driver starts its local Ray inside it) is killed afterwards whatever happens.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from ray_fixtures import ROOT, WORKER_ENV, needs_ray

pytestmark = [needs_ray, pytest.mark.timeout(240)]

EPOCH = re.compile(r"epoch\s+(\d+)/\d+\s+lr [\d.]+\s+train loss ([\d.]+) acc\s+([\d.]+)%\s+"
                   r"val loss ([\d.]+) acc\s+([\d.]+)%")
FINAL = re.compile(r"final validation accuracy ([\d.]+)% \(2 ranks")


def _run(argv: list[str], timeout: float) -> str:
    env = {**os.environ, **WORKER_ENV}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def _curve(out: str) -> tuple[list[tuple[str, ...]], float]:
    epochs = sorted({m.groups() for m in EPOCH.finditer(out)}, key=lambda g: int(g[0]))
    finals = [float(m.group(1)) for m in FINAL.finditer(out)]
    assert epochs and finals, out[-4000:]
    return epochs, finals[-1]


def test_ray_training_matches_hora_run(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    common = ["--epochs", "3", "--seed", "42", "--no-progress"]
    ray_out = _run([sys.executable, "examples/ray_digits.py", "--num-workers", "2", "--",
                    *common, "--checkpoint", str(tmp_path / "ray.pt")], timeout=150)
    hora_out = _run([sys.executable, "-m", "hora.runner", "run", "-np", "2", sys.executable,
                     "examples/torch_digits.py", *common, "--checkpoint",
                     str(tmp_path / "hora.pt")], timeout=150)
    ray_epochs, ray_acc = _curve(ray_out)
    hora_epochs, hora_acc = _curve(hora_out)
    assert len(ray_epochs) == 3
    assert ray_epochs == hora_epochs  # same seed, same data split: the same training
    assert ray_acc == hora_acc
    assert ray_acc > 85.0
    assert "accuracy per rank: " in ray_out  # every rank returned its accuracy
