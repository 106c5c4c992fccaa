"""The TensorFlow examples, run briefly as real 2-rank jobs (``hora run -np 2``, own session,
hard timeout, process group killed afterwards; checkpoints in ``tmp_path``)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from tf_jobs import HERE, needs_tf, run_command

pytestmark = [pytest.mark.integration, needs_tf,
              pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                                 reason="the digits example needs scikit-learn")]

EXAMPLES = HERE.parents[1] / "examples"


def test_keras_digits_two_ranks(tmp_path: Path) -> None:
    checkpoint = tmp_path / "digits.keras"
    run = run_command([str(EXAMPLES / "keras_digits.py"), "--epochs", "3",
                       "--checkpoint", str(checkpoint)], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    final = re.findall(r"^\[0\]<stdout>:final validation accuracy (\d+\.\d)% \(2 ranks\)$",
                       run.stdout, re.M)
    assert len(final) == 1, run.stdout[-3000:]
    assert float(final[0]) > 90.0, final
    assert "finished gradual learning rate warmup" in run.stdout
    assert checkpoint.exists()
    assert "[1]<stdout>:final" not in run.stdout  # only rank 0 reports


def test_tensorflow_synthetic_benchmark_output_format(tmp_path: Path) -> None:
    run = run_command([str(EXAMPLES / "tensorflow_synthetic_benchmark.py"),
                       "--batch-size", "4", "--image-size", "32", "--num-warmup-batches", "1",
                       "--num-batches-per-iter", "1", "--num-iters", "2", "--fp16-allreduce",
                       "--eager"],  # tracing MobileNetV2 costs ~7 s more (graph: tf_cases)
                      cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line.split(">:", 1)[1] for line in run.stdout.splitlines()
             if line.startswith("[0]<stdout>:")]
    assert lines[:5] == ["Model: MobileNetV2", "Batch size: 4", "Number of CPUs: 2",
                         "Running warmup...", "Running benchmark..."], lines
    assert re.fullmatch(r"Iter #1: \d+\.\d img/sec per CPU", lines[6]), lines
    assert re.fullmatch(r"Total img/sec on 2 CPU\(s\): \d+\.\d \+-\d+\.\d", lines[-1]), lines
