"""Elastic jobs whose discovery script misbehaves after its first run: it hangs, it prints
endlessly, it fails with a text that changes every time. Real `hora run` elastic drivers under a
hard timeout (tests/runner/helpers.Launcher)."""

from __future__ import annotations

import os
import shlex
import signal
import time
from pathlib import Path

import pytest
from runner.helpers import PY, Launcher, clean_env, wait_dead

from .test_elastic_jobs import WORKER, elastic_job


def discovery(tmp_path: Path, later: str, first: str = "echo localhost:2") -> Path:
    """A script whose first run does ``first`` and every later run ``later``."""
    mark = shlex.quote(str(tmp_path / "ran"))
    path = tmp_path / "discover.sh"
    path.write_text(f"#!/bin/sh\nif [ ! -e {mark} ]; then touch {mark}; {first}; exit 0; fi\n"
                    f"{later}\n")
    path.chmod(0o755)
    return path


def hang(tmp_path: Path) -> str:
    """Script lines that record the script's pid and its child's, then wait for ever."""
    child, own = (shlex.quote(str(tmp_path / name)) for name in ("child.pid", "script.pid"))
    return f"sleep 1000 &\necho $! > {child}.tmp; mv {child}.tmp {child}\necho $$ > {own}\nwait"


def script_pids(tmp_path: Path, timeout: float = 20.0) -> list[int]:
    paths = [tmp_path / "child.pid", tmp_path / "script.pid"]
    deadline = time.monotonic() + timeout
    while not all(p.exists() and p.read_text().strip() for p in paths):
        assert time.monotonic() < deadline, "the discovery script did not run"
        time.sleep(0.05)
    return [int(p.read_text()) for p in paths]


@pytest.mark.parametrize("end", ["finished", "interrupted"])
def test_a_hung_discovery_script_does_not_outlive_the_job(tmp_path: Path, end: str) -> None:
    script = discovery(tmp_path, hang(tmp_path))
    env = clean_env(EW_STEPS="60" if end == "finished" else "100000", EW_SLEEP="0.05")
    with Launcher("run", "-np", "2", "--host-discovery-script", str(script), PY, WORKER,
                  env=env) as launcher:
        pids = script_pids(tmp_path)
        if end == "interrupted":  # Ctrl-C
            os.kill(launcher.proc.pid, signal.SIGINT)
        result = launcher.wait(60)
        ended = time.monotonic()
        left = wait_dead(pids, timeout=5.0)
    assert result.rc == (0 if end == "finished" else 128 + signal.SIGINT), result.err[-3000:]
    assert not left, "the discovery script outlived hora run"
    assert time.monotonic() - ended < 2.0


def test_ctrl_c_during_the_first_discovery_run_ends_at_once(tmp_path: Path) -> None:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\n" + hang(tmp_path) + "\n")
    script.chmod(0o755)
    with Launcher("run", "-np", "2", "--host-discovery-script", str(script), PY, WORKER,
                  env=clean_env()) as launcher:
        pids = script_pids(tmp_path)
        sent = time.monotonic()
        os.kill(launcher.proc.pid, signal.SIGINT)
        result = launcher.wait(20)
        took = time.monotonic() - sent
        left = wait_dead(pids, timeout=5.0)
    assert result.rc == 128 + signal.SIGINT, result.err[-3000:]
    assert took < 3.0, took
    assert not left
    assert "received SIGINT" in result.err


def test_endless_output_later_is_reported_once_and_the_job_goes_on(tmp_path: Path) -> None:
    script = discovery(tmp_path, "yes localhost:2")
    result = elastic_job("-np", "2", "--host-discovery-script", str(script), EW_STEPS="60",
                         EW_SLEEP="0.05")
    assert result.rc == 0, result.err[-3000:]
    assert sorted(result.json_lines("wid")) == [0, 1]
    messages = [m for m in result.hora_messages() if "discovery" in m]
    assert len(messages) == 1, messages
    assert "printed more than 1048576 bytes (1 MiB) on stdout" in messages[0]


def test_an_error_with_a_changing_text_is_printed_once(tmp_path: Path) -> None:
    script = discovery(tmp_path, "echo \"no API at $(date +%s%N)\" >&2; exit 1")
    result = elastic_job("-np", "2", "--host-discovery-script", str(script), EW_STEPS="80",
                         EW_SLEEP="0.05")
    assert result.rc == 0, result.err[-3000:]
    messages = [m for m in result.hora_messages() if "discovery" in m]
    assert len(messages) == 1, messages
    assert messages[0].startswith("elastic: host discovery failed; keeping the last hosts it "
                                  "listed (localhost:2)")
    assert "failed with exit code 1; its stderr ends with:" in messages[0]
    assert result.err.count("no API at") == 1  # the stderr tail, on the next line
