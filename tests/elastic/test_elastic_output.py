"""What an elastic `hora run` prints when its workers fail alike: one traceback, then one line
per other worker that raised the same error (as hora run collapses its ranks' errors,
docs/faults.md "What `hora run` prints when a rank fails"); every worker printed its traceback in
full before."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _case_jobs import run_group

from hora.runner.elastic.spawner import SameErrorOnce
from hora.runner.output import Console
from hora.runner.rank_errors import ErrorBlock

pytestmark = pytest.mark.timeout(90)

SCRIPT = """\
import hora
hora.init()
raise ValueError("bad input shape 42")
"""


def test_workers_that_fail_alike_print_one_traceback(tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", "2", "--min-np", "2",
           "--max-np", "2", "-H", "localhost:2", sys.executable, str(script)]
    ran = run_group(cmd, timeout=60)
    if ran.timed_out:
        pytest.fail(f"the elastic job did not end in 60 s\n{ran.stdout}\n{ran.stderr}")
    out, err = ran.stdout, ran.stderr
    text = out + err
    assert ran.returncode != 0, text
    assert text.count("Traceback (most recent call last):") == 1, text
    assert text.count("ValueError: bad input shape 42") == 1, text
    assert "raised the same error as worker" in text and "traceback not shown" in text, text
    assert "elastic job failed" in text, text


class Captured(Console):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def write(self, stream: str, text: str) -> bool:
        self.lines.append(text)
        return True


def _block(rank: int, *lines: str) -> ErrorBlock:
    block = ErrorBlock(rank, "stderr")
    for line in lines:
        block.add(f"[{rank}]<stderr>:{line}\n", line)
    return block


def test_a_different_error_is_shown_in_full() -> None:
    console = Captured()
    errors = SameErrorOnce(console)
    errors.put(_block(0, "Traceback (most recent call last):", "ValueError: a"))
    errors.put(_block(1, "Traceback (most recent call last):", "ValueError: a"))
    errors.put(_block(2, "Traceback (most recent call last):", "KeyError: 'b'"))
    shown = "".join(console.lines)
    assert shown.count("Traceback") == 2 and "KeyError: 'b'" in shown, shown
    assert "worker 1 raised the same error as worker 0" in shown, shown


def test_a_bug_in_hora_is_a_root_cause_not_a_consequence() -> None:
    """hora.errors.internal_error's HoraInternalError is the failing rank's own error (hora run
    shows its traceback); the other ranks' HoraInternalError naming it stays a consequence."""
    from hora.errors import internal_error

    bug = str(internal_error("hora's engine thread", RuntimeError("x")))
    own = _block(1, "Traceback (most recent call last):", f"hora.errors.HoraInternalError: {bug}")
    echo = _block(0, "Traceback (most recent call last):",
                  f"hora.errors.HoraInternalError: rank 1 failed: {bug}")
    assert not own.is_consequence() and echo.is_consequence()
