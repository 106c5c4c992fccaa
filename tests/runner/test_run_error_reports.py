"""One report per failure (real ``hora run`` jobs, hard timeouts): the root cause's traceback
once, the other ranks' consequential errors as one line naming them, then the summary; a rank's
traceback is never interleaved with another rank's lines."""

from __future__ import annotations

import os
import re
import select
import time

from .helpers import Launcher, Result, run_hora, worker

FAILS_THEN_PEER = (
    "import numpy as np, hora\n"
    "hora.init()\n"
    "if hora.rank() == 1:\n"
    "    raise ValueError('bad input shape 42')\n"
    "for _ in range(3):\n"
    "    hora.allreduce(np.ones(3, np.float32), name='x')\n")


def tracebacks(result: Result) -> dict[int, int]:
    """How many tracebacks each rank's relayed stderr holds."""
    return {rank: sum(line == "Traceback (most recent call last):" for line in lines)
            for rank, lines in result.lines("stderr").items()}


def contiguous(err: str, rank: int) -> None:
    """Every traceback of ``rank`` runs from its header to its exception line without a line of
    another rank (or of the launcher) in between."""
    lines = err.splitlines()
    mine = f"[{rank}]<stderr>:"
    for start, line in enumerate(lines):
        if line == mine + "Traceback (most recent call last):":
            end = next(i for i in range(start, len(lines))
                       if lines[i].startswith(mine + "ValueError:"))
            intruders = [ln for ln in lines[start:end + 1] if not ln.startswith(mine)]
            assert not intruders, f"rank {rank}'s traceback is interleaved:\n" + "\n".join(
                lines[start:end + 1])


def test_root_cause_once_and_the_peers_consequence_in_one_line() -> None:
    result = run_hora("run", "-np", "2", *worker(FAILS_THEN_PEER), timeout=60)
    text = result.out + result.err
    assert result.rc == 1, text
    assert text.count("bad input shape 42") == 2, text  # its traceback and the summary
    assert tracebacks(result) == {1: 1}, text  # rank 0's consequential traceback is not shown
    messages = result.hora_messages()
    assert ("also failed after rank 1: rank 0 raised ShutdownError (traceback not shown; "
            "--output-filename DIR keeps every rank's full output).") in messages, text
    assert any(m.startswith("job failed: rank 1 of 2 on localhost exited with code 1")
               for m in messages), text
    assert messages[-2:] == ["rank 1's error (its traceback is above):",
                             "  ValueError: bad input shape 42"], text


def test_the_same_error_on_every_rank_is_printed_once() -> None:
    code = ("import numpy as np, hora\nhora.init()\n"
            "hora.allreduce(np.ones(3 + hora.rank(), np.float32), name='x')\n")
    result = run_hora("run", "-np", "3", *worker(code), timeout=60)
    text = result.out + result.err
    assert result.rc == 1, text
    message = "Mismatched shape for tensor 'allreduce.x'"
    assert text.count(message) == 2, text
    assert sum(tracebacks(result).values()) == 1, text
    line = next(m for m in result.hora_messages() if m.startswith("also failed after rank"))
    assert line.count("raised the same error") == 2, line


def test_a_deadlock_logged_and_raised_is_printed_once_plus_the_summary() -> None:
    code = ("import numpy as np, hora\nhora.init()\n"
            "if hora.rank() == 0:\n    hora.allreduce(np.ones(3, np.float32), name='x')\n"
            "else:\n    hora.barrier()\n")
    result = run_hora("run", "-np", "2", *worker(code), timeout=60)
    text = result.out + result.err
    assert result.rc == 1, text
    assert text.count("are all blocked and none of their ops can ever complete") == 2, text
    assert sum(tracebacks(result).values()) == 1, text


def test_a_killed_rank_and_its_peers_errors_in_one_line() -> None:
    code = ("import os, time, numpy as np, hora\nhora.init()\n"
            "if hora.rank() == 1:\n    os.kill(os.getpid(), 9)\n"
            "for _ in range(200):\n"
            "    hora.allreduce(np.ones(3, np.float32), name='x'); time.sleep(0.05)\n")
    result = run_hora("run", "-np", "3", *worker(code), timeout=60)
    text = result.out + result.err
    assert result.rc == 137, text
    assert tracebacks(result) == {}, text
    line = [m for m in result.hora_messages() if m.startswith("also failed after rank 1:")]
    assert len(line) == 1 and "rank 0 raised" in line[0] and "rank 2 raised" in line[0], text
    assert "job failed: rank 1 of 3 on localhost was killed by signal SIGKILL (9)" in text, text


SLOW_TRACEBACK = (
    "import os, sys, time\n"
    "r = os.environ['HORA_RANK']\n"
    "def say(line):\n"
    "    sys.stderr.write(line + '\\n'); sys.stderr.flush(); time.sleep(0.03)\n"
    "say('Traceback (most recent call last):')\n"
    "for i in range(8):\n"
    "    say(f'  File \"train.py\", line {i}, in step')\n"
    "    say(f'    step(rank={r}, i={i})')\n"
    "say(f'ValueError: rank {r} failed')\n")


def test_tracebacks_written_at_once_never_interleave_fatal() -> None:
    code = SLOW_TRACEBACK + "sys.exit(1)\n"
    result = run_hora("run", "-np", "3", *worker(code), timeout=60)
    assert result.rc == 1, result.err
    for rank in range(3):  # three errors of their own: each shown, each in one piece
        contiguous(result.err, rank)
        assert f"[{rank}]<stderr>:ValueError: rank {rank} failed" in result.err, result.err


def test_tracebacks_of_ranks_that_go_on_never_interleave_and_are_all_shown() -> None:
    code = SLOW_TRACEBACK + "print('went on', flush=True)\n"
    result = run_hora("run", "-np", "3", *worker(code), timeout=60)
    assert result.rc == 0, result.err
    assert tracebacks(result) == {0: 1, 1: 1, 2: 1}, result.err
    for rank in range(3):
        contiguous(result.err, rank)
    assert result.lines() == {r: ["went on"] for r in range(3)}


def test_a_traceback_of_a_rank_that_runs_on_is_not_held_for_long() -> None:
    code = ("import sys, time\n"
            "sys.stderr.write('Traceback (most recent call last):\\n  File \"x.py\", line 1\\n"
            "ValueError: logged, not fatal\\n'); sys.stderr.flush()\n"
            "time.sleep(30)\n")
    with Launcher("run", "-np", "1", *worker(code)) as launcher:
        assert launcher.proc.stderr is not None
        fd = launcher.proc.stderr.fileno()
        seen = b""
        deadline = time.monotonic() + 15
        while b"ValueError: logged, not fatal" not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                seen += os.read(fd, 65536)
        assert re.search(rb"\[0\]<stderr>:ValueError: logged, not fatal", seen), seen
        assert launcher.proc.poll() is None, "shown while the rank still runs"
