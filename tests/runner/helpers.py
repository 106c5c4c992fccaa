"""Helpers for launcher tests: run ``hora`` as a real subprocess, parse its relayed output, and
make sure no process outlives a test.

Every launcher started here runs in its own session with a hard timeout; :class:`Launcher`
kills its process group and every worker pid the test learned on exit, so a failing test never
leaves processes behind.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

PY = sys.executable
FAKE_SSH = str(Path(__file__).with_name("fake_ssh.py"))


def fake_ssh_path(directory: Path) -> str:
    """A PATH whose ``ssh`` is tests/runner/fake_ssh.py (runs the remote command locally)."""
    bin_dir = directory / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "ssh"
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(PY)} {shlex.quote(FAKE_SSH)} \"$@\"\n")
    wrapper.chmod(0o755)
    return f"{bin_dir}:{clean_env()['PATH']}"
HARD_TIMEOUT = 30.0
"""No launcher in these tests may run longer than this."""

_LINE = re.compile(r"^\[(\d+)\]<(stdout|stderr)>:(.*)$")


def hora_argv(*args: str) -> list[str]:
    """The command line that runs the ``hora`` CLI with ``args`` in a fresh interpreter."""
    return [PY, "-m", "hora.runner", *args]


def worker(code: str) -> list[str]:
    """A rank command: ``python -c code``."""
    return [PY, "-c", code]


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without hora / Horovod variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HORA_", "HOROVOD_", "PYTEST_"))}
    env.update(extra)
    return env


@dataclass
class Result:
    """A finished launcher: exit status, its stdout and stderr (text), and wall time."""

    rc: int
    out: str
    err: str
    seconds: float

    def lines(self, stream: str = "stdout") -> dict[int, list[str]]:
        """Relayed lines by rank, from ``stream`` (``"stdout"`` or ``"stderr"``)."""
        text = self.out if stream == "stdout" else self.err
        return relayed(text, stream)

    def json_lines(self, key: str) -> dict[object, dict]:
        """The JSON objects the ranks printed on stdout (lines starting with ``{``), by the
        value of their field ``key`` (e.g. an elastic worker's ``"wid"``)."""
        found: dict[object, dict] = {}
        for lines in self.lines("stdout").values():
            for line in lines:
                if line.startswith("{"):
                    data = json.loads(line)
                    found[data[key]] = data
        return found

    def hora_messages(self) -> list[str]:
        """The launcher's own ``[hora]`` lines on stderr, without the prefix."""
        return [line[len("[hora] "):] for line in self.err.splitlines()
                if line.startswith("[hora] ")]


def relayed(text: str, stream: str) -> dict[int, list[str]]:
    """Parse ``[r]<stream>:line`` lines into ``{rank: [line, ...]}``."""
    found: dict[int, list[str]] = defaultdict(list)
    for line in text.split("\n"):
        match = _LINE.match(line)
        if match and match.group(2) == stream:
            found[int(match.group(1))].append(match.group(3))
    return dict(found)


def run_hora(*args: str, env: dict[str, str] | None = None, timeout: float = HARD_TIMEOUT,
             cwd: str | os.PathLike[str] | None = None) -> Result:
    """Run ``hora args...`` to completion (killed, with its group, after ``timeout``)."""
    with Launcher(*args, env=env, cwd=cwd) as launcher:
        return launcher.wait(timeout)


class Launcher:
    """A ``hora`` process started in its own session; killed with its group on exit."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None,
                 argv: Sequence[str] | None = None) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            list(argv) if argv is not None else hora_argv(*args),
            env=clean_env() if env is None else env, cwd=cwd, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
        self.worker_pids: list[int] = []

    def __enter__(self) -> Launcher:  # noqa: PYI034 (a final class in practice)
        return self

    def __exit__(self, *exc: object) -> None:
        for pid in [self.proc.pid, *self.worker_pids]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.communicate(timeout=5)
        except (subprocess.TimeoutExpired, ValueError):
            pass

    def wait(self, timeout: float = HARD_TIMEOUT) -> Result:
        """Wait for the launcher to exit; its output, decoded with replacement."""
        out, err = self.proc.communicate(timeout=timeout)
        return Result(self.proc.returncode, out.decode("utf-8", "replace"),
                      err.decode("utf-8", "replace"), time.monotonic() - self.started)

    def wait_raw(self, timeout: float = HARD_TIMEOUT) -> tuple[int, bytes, bytes]:
        """Wait for the launcher to exit; its raw output bytes."""
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def read_pids(self, paths: Iterable[Path], timeout: float = 15.0) -> list[int]:
        """Wait until every file in ``paths`` holds a pid; remember them for cleanup."""
        pending = list(paths)
        pids = []
        deadline = time.monotonic() + timeout
        for path in pending:
            while True:
                text = path.read_text().strip() if path.exists() else ""
                if text.endswith("."):
                    break
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise AssertionError(f"{path} was not written (launcher rc "
                                         f"{self.proc.poll()})")
                time.sleep(0.02)
            pids.append(int(text[:-1]))
        self.worker_pids += pids
        return pids


def write_pid(path_expr: str) -> str:
    """Worker code that writes ``<pid>.`` to the file named by the Python expression."""
    return (f"import os; _p = {path_expr}; open(_p + '.tmp', 'w').write(str(os.getpid()) + '.');"
            f" os.replace(_p + '.tmp', _p)")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def wait_dead(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for every pid to die; return those still alive."""
    deadline = time.monotonic() + timeout
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [p for p in left if alive(p)]
        if left:
            time.sleep(0.05)
    return [p for p in left if alive(p)]
