"""Real multi-process case jobs, shared by the adapter tests (torch, tensorflow, jax).

One `hora run` job runs many cases and each rank prints ``CASE <id> OK`` (or the failure) per
case; every case id is then one pytest test (:meth:`CaseJob.assert_ok`). Every job has a hard
timeout and only its own process group is killed. Importable from any test module (pytest puts
``tests/`` on ``sys.path`` for ``tests/conftest.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class CaseJob:
    """Outcome of one job: per case id, the status line of each rank."""

    np: int
    returncode: int
    stdout: str
    stderr: str

    def status(self, case_id: str) -> dict[int, str]:
        found: dict[int, str] = {}
        for line in self.stdout.splitlines():
            prefix, _, payload = line.partition(">:")
            if not payload.startswith(f"CASE {case_id} "):
                continue
            rank = int(prefix.lstrip("[").split("]")[0])
            found[rank] = payload[len(f"CASE {case_id} "):]
        return found

    def assert_ok(self, case_id: str) -> None:
        found = self.status(case_id)
        bad = {r: s for r, s in found.items() if s != "OK"}
        missing = [r for r in range(self.np) if r not in found]
        if bad or missing:
            pytest.fail(f"case {case_id}: failed on {bad}, no report from ranks {missing} "
                        f"(job exit {self.returncode})\n--- stdout tail\n{self.stdout[-3000:]}"
                        f"\n--- stderr tail\n{self.stderr[-6000:]}")


@dataclass
class Ran:
    """Outcome of :func:`run_group`."""

    returncode: int
    stdout: str
    stderr: str  # ("" with ``merge_stderr``)
    timed_out: bool


def run_group(cmd: list[str], *, timeout: float, env: Mapping[str, str] | None = None,
              cwd: str | Path | None = None, merge_stderr: bool = False) -> Ran:
    """Run ``cmd`` in a new session and kill its whole process group when it ends or after
    ``timeout`` seconds (then ``timed_out``, with what it printed so far): only the processes
    this test started, none left behind. ``env``: the whole environment (None: this one's)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            text=True, env=None if env is None else dict(env), cwd=cwd,
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return Ran(proc.returncode, out, err or "", timed_out)


def run_job(np_: int, args: list[str], env: Mapping[str, str], cwd: Path,
            timeout: float) -> CaseJob:
    """`hora run -np N <args>` (the first ``.py`` argument runs under this Python), its
    process group killed after ``timeout`` seconds."""
    script = next(i for i, a in enumerate(args) if a.endswith(".py"))
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(np_), *args[:script],
           sys.executable, *args[script:]]
    ran = run_group(cmd, timeout=timeout, env={**os.environ, **env}, cwd=cwd)
    err = ran.stderr + (f"\n[job killed after {timeout} s]" if ran.timed_out else "")
    return CaseJob(np_, ran.returncode, ran.stdout, err)


def spawn_ranks(argv: list[str], envs: list[dict[str, str]], timeout: float = 60.0
                ) -> list[tuple[int, str]]:
    """Start one process per env (``os.environ`` without HORA_* / HOROVOD_*, plus the env), as
    an external launcher (torchrun, mpirun) would; their (returncode, output), in order. Every
    process group is killed at the end."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, env={**base, **e}) for e in envs]
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            results.append((p.returncode, out))
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return results

