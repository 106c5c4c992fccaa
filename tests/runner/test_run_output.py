"""How ``hora run`` relays the ranks' output: prefixes, partial lines, bytes, files."""

from __future__ import annotations

import re
import signal
from pathlib import Path

from hora.runner.local import rank_output_dir

from .helpers import Launcher, run_hora, worker

CHATTY = (
    "import os, sys\n"
    "r = os.environ['HORA_RANK']\n"
    "print('out', r)\n"
    "print('err', r, file=sys.stderr)\n"
    "sys.stdout.flush(); sys.stderr.flush()\n"
    "sys.stdout.buffer.write(b'bad \\xff bytes\\nwindows\\r\\n'); sys.stdout.flush()\n"
    "sys.stdout.write('no newline at the end ' + r)\n"
)


def test_stdout_and_stderr_lines_are_prefixed_by_rank() -> None:
    result = run_hora("run", "-np", "2", *worker(CHATTY))
    assert result.rc == 0, result.err
    for rank in (0, 1):
        # Invalid UTF-8 is replaced, a CRLF line keeps its own line ending, and the unfinished
        # last line is flushed with a newline.
        assert result.lines("stdout")[rank] == [
            f"out {rank}", "bad \ufffd bytes", "windows\r", f"no newline at the end {rank}"]
        assert result.lines("stderr")[rank] == [f"err {rank}"]
    # Nothing but relayed lines on stdout: every line carries a prefix.
    assert all(re.match(r"\[\d\]<stdout>:", line) for line in result.out.splitlines())


def test_carriage_return_progress_bars_keep_their_prefix() -> None:
    code = "import sys; sys.stderr.write('\\r10%\\r50%\\r100%\\n')"
    with Launcher("run", "-np", "1", *worker(code)) as launcher:
        rc, _, err = launcher.wait_raw()
    assert rc == 0
    assert b"[0]<stderr>:\r[0]<stderr>:10%\r[0]<stderr>:50%\r[0]<stderr>:100%\n" in err


def test_prefix_output_with_timestamp() -> None:
    result = run_hora("run", "-np", "1", "--prefix-output-with-timestamp",
                      *worker("print('hello')"))
    assert result.rc == 0, result.err
    # time.asctime() then Horovod's prefix, e.g. "Sat Nov 21 20:49:22 2026[0]<stdout>:hello"
    assert re.search(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\[0\]<stdout>:hello$",
                     result.out, re.MULTILINE), result.out
    short = run_hora("run", "-np", "1", "-prefix-timestamp", *worker("print('hi')"))
    assert re.search(r"\d{4}\[0\]<stdout>:hi$", short.out, re.MULTILINE)


def test_closing_the_launchers_stdout_ends_the_job_like_a_pipe_would() -> None:
    # `hora run -np 2 yes | head -1`: the ranks get EPIPE / SIGPIPE as they would without hora.
    with Launcher("run", "-np", "2", "yes") as launcher:
        assert launcher.proc.stdout is not None
        assert launcher.proc.stdout.read(1) == b"["
        launcher.proc.stdout.close()
        rc = launcher.proc.wait(15)
        err = launcher.proc.stderr.read().decode() if launcher.proc.stderr else ""
    assert rc == 128 + signal.SIGPIPE
    assert "killed by signal SIGPIPE" in err


def test_output_filename_writes_raw_per_rank_files(tmp_path: Path) -> None:
    out = tmp_path / "logs"
    result = run_hora("run", "-np", "2", "--output-filename", str(out), *worker(CHATTY))
    assert result.rc == 0, result.err
    for rank in (0, 1):
        stdout = (out / f"rank.{rank}" / "stdout").read_bytes()
        assert stdout == (f"out {rank}\n".encode() + b"bad \xff bytes\nwindows\r\n"
                          + f"no newline at the end {rank}".encode())
        assert (out / f"rank.{rank}" / "stderr").read_text() == f"err {rank}\n"
    assert result.lines()[0][0] == "out 0"  # still relayed to the terminal


def test_output_filename_with_one_rank(tmp_path: Path) -> None:
    result = run_hora("run", "-np", "1", "--output-filename", str(tmp_path),
                      *worker("print('solo')"))
    assert result.rc == 0, result.err
    assert (tmp_path / "rank.0" / "stdout").read_text() == "solo\n"


def test_rank_directories_are_zero_padded_to_at_least_one_digit() -> None:
    assert rank_output_dir("d", 0, 1) == Path("d/rank.0")
    assert rank_output_dir("d", 7, 10) == Path("d/rank.7")
    assert rank_output_dir("d", 3, 11) == Path("d/rank.03")
    assert rank_output_dir("d", 10, 11) == Path("d/rank.10")
    assert rank_output_dir("d", 5, 101) == Path("d/rank.005")
