"""Failure handling of ``hora run``: the first failure decides, nothing is left running."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from .helpers import PY, Launcher, clean_env, run_hora, wait_dead, worker, write_pid

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc to check pids")


def pid_file(tmp_path: Path) -> str:
    return f"{str(tmp_path)!r} + '/pid.' + os.environ['HORA_RANK']"


def test_first_failing_rank_decides_and_the_others_are_stopped(tmp_path: Path) -> None:
    code = (write_pid(pid_file(tmp_path)) + "\n"
            "import sys, time\n"
            "if os.environ['HORA_RANK'] == '1':\n"
            f"    while not all(os.path.exists({str(tmp_path)!r} + f'/pid.{{r}}') for r in (0, 2)):"
            "\n        time.sleep(0.01)\n"
            "    print('about to fail', file=sys.stderr)\n"
            "    raise SystemExit(3)\n"
            "time.sleep(60)\n")
    with Launcher("run", "-np", "3", *worker(code)) as launcher:
        pids = launcher.read_pids(tmp_path / f"pid.{r}" for r in range(3))
        result = launcher.wait(20)
    assert result.rc == 3
    assert result.seconds < 10  # the sleeping ranks were stopped, not waited for
    assert wait_dead(pids, 2.0) == []
    messages = "\n".join(result.hora_messages())
    assert "rank 1 of 3 on localhost exited with code 3" in messages
    assert "stopping the other 2 rank(s)" in messages
    # Root cause repeated at the end, with the failed rank's last stderr lines.
    assert result.hora_messages()[-1] == "  about to fail"


def test_rank_killed_by_a_signal_gives_128_plus_n() -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    result = run_hora("run", "-np", "2", *worker(code))
    assert result.rc == 128 + signal.SIGKILL
    assert "was killed by signal SIGKILL (9)" in result.err
    assert "out-of-memory" in result.err  # the hint for SIGKILL


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_launcher_stops_every_rank(tmp_path: Path, signum: int) -> None:
    code = write_pid(pid_file(tmp_path)) + "; import time; time.sleep(60)"
    with Launcher("run", "-np", "2", *worker(code)) as launcher:
        pids = launcher.read_pids(tmp_path / f"pid.{r}" for r in range(2))
        launcher.proc.send_signal(signum)
        result = launcher.wait(15)
    assert result.rc == 128 + signum  # 130 for Ctrl-C, 143 for SIGTERM
    assert result.seconds < 10
    assert wait_dead(pids, 2.0) == []
    assert f"received {signal.Signals(signum).name}; stopping 2 rank(s)" in result.err


def test_rank_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    # The launcher's grace period is a module constant; shorten it for this test.
    shortened = ("import sys, hora.runner.processes as processes; processes.GRACE_PERIOD_S = 1.0; "
                 "from hora.runner.cli import main; sys.exit(main(sys.argv[1:]))")
    argv = [PY, "-c", shortened]
    code = (write_pid(pid_file(tmp_path)) + "\n"
            "import signal, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "if os.environ['HORA_RANK'] == '1':\n"
            f"    while not os.path.exists({str(tmp_path)!r} + '/pid.0'): time.sleep(0.01)\n"
            "    raise SystemExit(1)\n"
            "time.sleep(60)\n")
    with Launcher(argv=[*argv, "run", "-np", "2", *worker(code)]) as launcher:
        pids = launcher.read_pids([tmp_path / "pid.0"])
        result = launcher.wait(20)
    assert result.rc == 1
    assert 1.0 <= result.seconds < 8
    assert wait_dead(pids, 2.0) == []


def test_processes_left_behind_by_a_successful_rank_are_stopped(tmp_path: Path) -> None:
    # The grandchild keeps the rank's stdout open: the launcher must neither hang on it nor
    # leave it running.
    child = tmp_path / "child"
    code = ("import subprocess, sys; "
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(child)!r}, 'w').write(str(p.pid)); print('started')")
    result = run_hora("run", "-np", "1", *worker(code), timeout=20)
    assert result.rc == 0, result.err
    assert result.lines() == {0: ["started"]}
    assert result.seconds < 10
    assert "left processes running" in result.err
    assert wait_dead([int(child.read_text())], 2.0) == []


def test_ranks_die_with_a_launcher_killed_by_sigkill(tmp_path: Path) -> None:
    code = write_pid(pid_file(tmp_path)) + "; import time; time.sleep(60)"
    with Launcher("run", "-np", "2", *worker(code)) as launcher:
        pids = launcher.read_pids(tmp_path / f"pid.{r}" for r in range(2))
        launcher.proc.kill()
        launcher.proc.wait(5)
        assert wait_dead(pids, 5.0) == []


def test_command_not_found_exits_127() -> None:
    result = run_hora("run", "-np", "2", "no-such-program-hora-test")
    assert result.rc == 127
    assert "cannot start rank 0: 'no-such-program-hora-test'" in result.err


def test_all_ranks_succeed_exit_0() -> None:
    result = run_hora("run", "-np", "4", *worker("pass"))
    assert (result.rc, result.err) == (0, "")


def test_a_script_started_without_its_interpreter_gets_a_hint(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")  # not executable: exec fails with EACCES
    result = run_hora("run", "-np", "2", str(script))
    assert result.rc == 126
    assert f"cannot start rank 0: '{script}': Permission denied" in result.err
    assert (f"HINT: {script} is a Python script: put the interpreter in front, e.g. "
            f"`hora run -np 2 python {script}`") in result.err


def test_a_rank_in_another_interpreter_without_hora_is_told_which_to_use(
        tmp_path: Path) -> None:
    """`python` on the ranks' PATH is not the interpreter hora runs in (an environment that is
    not activated): the summary names both and the fix."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    other = bin_dir / "python"  # stands for a system python without hora
    other.write_text("#!/bin/sh\necho \"Traceback (most recent call last):\" >&2\n"
                     "echo \"ModuleNotFoundError: No module named 'hora'\" >&2\nexit 1\n")
    other.chmod(0o755)
    env = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}")
    result = run_hora("run", "-np", "2", "python", "train.py", env=env)
    assert result.rc == 1
    assert (f"ran {other}, but hora runs in {os.path.abspath(sys.executable)}: activate that "
            f"environment, or pass its python: `hora run -np 2 "
            f"{os.path.abspath(sys.executable)} script.py`") in result.err


def test_the_summary_shows_a_python_error_once_not_its_traceback_again() -> None:
    result = run_hora("run", "-np", "2", *worker(
        "import os\nif os.environ['HORA_RANK'] == '1':\n    raise ValueError('boom')\n"
        "import time; time.sleep(30)"))
    assert result.rc == 1
    summary = [ln for ln in result.err.splitlines() if ln.startswith("[hora]")]
    relayed = [ln for ln in result.err.splitlines() if ln.startswith("[1]<stderr>:")]
    assert any('File "' in ln for ln in relayed)  # the traceback, as the rank wrote it
    assert not any('File "' in ln for ln in summary), summary  # not repeated
    assert sum("ValueError: boom" in ln for ln in summary) == 1, summary
    assert any("rank 1's error (its traceback is above):" in ln for ln in summary), summary
