"""Run real multi-process jobs through `hora run`, with a hard timeout and full cleanup."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from _case_jobs import run_group

WORKER = str(Path(__file__).with_name("worker.py"))


@dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str

    def lines(self, prefix: str) -> list[str]:
        """Payloads of stdout lines (rank prefix stripped) that start with ``prefix``."""
        out = []
        for line in self.stdout.splitlines():
            _, _, payload = line.partition(">:")
            if payload.startswith(prefix):
                out.append(payload)
        return out


def run_job(np_: int, *args: str, timeout: float = 60, env: dict[str, str] | None = None,
            launcher_args: tuple[str, ...] = (), script: str = WORKER) -> Job:
    """`hora run -np N python worker.py ARGS`, killed (whole process group) after ``timeout``."""
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(np_), *launcher_args,
           sys.executable, script, *args]
    ran = run_group(cmd, timeout=timeout, env={**os.environ, **(env or {})})
    if ran.timed_out:
        pytest.fail(f"job did not finish in {timeout} s\nstdout:\n{ran.stdout}\n"
                    f"stderr:\n{ran.stderr}")
    return Job(ran.returncode, ran.stdout, ran.stderr)
