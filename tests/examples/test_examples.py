"""The examples and the train-step benchmark, run briefly as real 2-rank jobs.

    .venv/bin/pytest tests/examples -q

Each job runs through ``hora run -np 2`` (the benchmark launches itself) in its own session with a
hard timeout; its whole process group is killed afterwards whatever happens, and it runs in
``tmp_path`` with the checkpoint there, so nothing is left in the repository. No
``__init__.py`` here: a package named ``examples`` would shadow the repository's examples/.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from _case_jobs import run_group

pytest.importorskip("torch")
pytest.importorskip("sklearn")

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "torch_digits.py"
SYNTHETIC = ROOT / "examples" / "torch_synthetic_benchmark.py"
TRAIN_STEP = ROOT / "benchmarks" / "train_step.py"

# Fail fast instead of hanging: stalled ops error out after 20 s.
ENV = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20",
       "OMP_NUM_THREADS": "1"}
_RELAYED = re.compile(r"^\[(\d+)\]<stdout>:(.*)$")


@dataclass
class Run:
    """A finished command: exit status, stdout, stderr."""

    rc: int
    out: str
    err: str

    def rank_lines(self, rank: int) -> list[str]:
        """Rank ``rank``'s stdout lines, prefix removed (progress-bar redraws split on \\r)."""
        lines = []
        for line in re.split(r"\r\n|\n|\r", self.out):
            match = _RELAYED.match(line)
            if match and int(match.group(1)) == rank:
                lines.append(match.group(2))
        return lines

    def explain(self) -> str:
        return (f"exit {self.rc}\n--- stdout tail\n{self.out[-3000:]}\n--- stderr tail\n"
                f"{self.err[-3000:]}")


def run(args: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> Run:
    """Run ``args`` in a new session (the test environment, :data:`ENV`, then ``env``); kill its
    whole process group when done or timed out."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    ran = run_group(args, timeout=timeout, env={**base, **ENV, **(env or {})}, cwd=cwd)
    err = ran.stderr + (f"\n[killed after {timeout} s]" if ran.timed_out else "")
    return Run(ran.returncode, ran.stdout, err)


def hora_run(np_: int, script: Path, *args: str, cwd: Path, timeout: float) -> Run:
    return run([sys.executable, "-m", "hora.runner.cli", "run", "-np", str(np_), sys.executable,
                str(script), *args], cwd, timeout)


def test_digits_two_ranks(tmp_path: Path) -> None:
    import torch

    checkpoint = tmp_path / "ckpt" / "digits.pt"
    result = hora_run(2, DIGITS, "--epochs", "2", "--lr", "0.05", "--checkpoint",
                      str(checkpoint), cwd=tmp_path, timeout=60)
    assert result.rc == 0, result.explain()
    lines = result.rank_lines(0)
    final = [line for line in lines if line.startswith("final validation accuracy")]
    assert len(final) == 1, result.explain()
    match = re.fullmatch(r"final validation accuracy (\d+\.\d)% \(2 ranks\)", final[0])
    assert match, final[0]
    assert float(match.group(1)) > 80.0, result.explain()
    assert final[0] == lines[-1]
    assert sum(line.startswith("epoch  ") and "val loss" in line for line in lines) == 2
    assert not any("final validation" in line for line in result.rank_lines(1)), \
        "only rank 0 reports"
    state = torch.load(checkpoint, weights_only=True)
    assert {"model", "optimizer", "epochs", "val_accuracy"} <= set(state)
    assert abs(100 * state["val_accuracy"] - float(match.group(1))) < 0.051
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["digits.pt"]  # no .tmp left


def test_synthetic_benchmark_output_format(tmp_path: Path) -> None:
    result = hora_run(2, SYNTHETIC, "--batch-size", "4", "--num-warmup-batches", "1",
                      "--num-batches-per-iter", "1", "--num-iters", "2", "--image-size", "32",
                      cwd=tmp_path, timeout=60)
    assert result.rc == 0, result.explain()
    number = r"\d+\.\d"
    expected = [r"Model: tiny_resnet", r"Batch size: 4", r"Number of CPUs: 2",
                r"Running warmup\.\.\.", r"Running benchmark\.\.\.",
                rf"Iter #0: {number} img/sec per CPU", rf"Iter #1: {number} img/sec per CPU",
                rf"Img/sec per CPU: {number} \+-{number}",
                rf"Total img/sec on 2 CPU\(s\): {number} \+-{number}"]
    lines = result.rank_lines(0)
    assert len(lines) == len(expected), result.explain()
    for pattern, line in zip(expected, lines):
        assert re.fullmatch(pattern, line), (pattern, line)
    assert result.rank_lines(1) == [], "only rank 0 prints"
    per_cpu = float(lines[-2].split()[3])
    total = float(lines[-1].split()[5])
    assert total == pytest.approx(2 * per_cpu, abs=0.11)


def test_synthetic_benchmark_with_adasum(tmp_path: Path) -> None:
    result = hora_run(2, SYNTHETIC, "--use-adasum", "--batch-size", "4", "--num-warmup-batches",
                      "1", "--num-batches-per-iter", "1", "--num-iters", "1", "--image-size",
                      "32", cwd=tmp_path, timeout=60)
    assert result.rc == 0, result.explain()
    assert any(line.startswith("Total img/sec on 2 CPU(s)") for line in result.rank_lines(0))


def test_train_step_benchmark_table(tmp_path: Path) -> None:
    result = run([sys.executable, str(TRAIN_STEP), "--steps", "2", "--rounds", "1", "--warmup",
                  "1", "--hidden", "128"], tmp_path, timeout=60)
    assert result.rc == 0, result.explain()
    lines = result.rank_lines(0)
    text = "\n".join(lines)
    assert any(line.startswith("command: python benchmarks/train_step.py --steps 2 --rounds 1")
               for line in lines), text
    for variant in ("hora", "ddp", "nosync"):
        assert re.search(rf"^ *{variant} \| +\d+\.\d ", text, re.M), text
    assert re.search(r"^hora/ddp samples/s: \d+\.\d\dx", text, re.M), text
    assert re.search(r"^peak RSS per rank .*rank 0 \d+ .*rank 1 \d+", text, re.M), text
    assert "replicas identical across ranks: yes" in lines, text


@pytest.mark.parametrize("script", [DIGITS, SYNTHETIC, TRAIN_STEP], ids=lambda p: p.name)
def test_help(script: Path, tmp_path: Path) -> None:
    result = run([sys.executable, str(script), "--help"], tmp_path, timeout=60)
    assert result.rc == 0, result.explain()
    assert result.out.startswith("usage: ")
    assert "--batch-size" in result.out
