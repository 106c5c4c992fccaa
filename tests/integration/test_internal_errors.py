"""A bug in hora's own threads (the engine thread, a fast lane) fails every op of that rank with
an error naming the op and the original exception, and the other ranks raise too; and an op
failed by a lost peer keeps its error's attributes up to the user's ``synchronize``.

Each test runs a real 2-rank job (`hora run -np 2`, real /dev/shm) whose worker injects the
fault in rank 1 (monkeypatching hora inside the worker), killed (its whole process group) after
a hard timeout. Every rank prints ``RAISED <type>: <message>`` when its op raises, then lingers
3 s (so a rank that never raises is seen as missing, not as stopped by the launcher).
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
from _case_jobs import run_group

from .conftest import Job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120),
              pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")]

JOB_TIMEOUT_S = 60.0
"""The job's hard limit: a rank that hangs instead of raising is killed with the job then."""

_PRELUDE = """\
import os
import signal
import sys
import time

import numpy as np

import hora


def report(exc):
    peer = getattr(exc, "peer", "-")
    text = str(exc).replace("\\n", " | ")
    print(f"RAISED {type(exc).__name__} peer={peer} cause={exc.__cause__!r}: {text}", flush=True)
    time.sleep(3)
    os._exit(1)


hora.init()
r, n = hora.rank(), hora.size()
"""


def _run_script(tmp_path: Path, body: str) -> Job:
    """`hora run -np 2 python SCRIPT` (prelude + body), killed after :data:`JOB_TIMEOUT_S`."""
    script = tmp_path / "internal_worker.py"
    script.write_text(_PRELUDE + textwrap.dedent(body))
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", "2", sys.executable,
           str(script)]
    ran = run_group(cmd, timeout=JOB_TIMEOUT_S,
                    env={**os.environ, "HORA_HEARTBEAT_TIMEOUT_SECONDS": "60"})
    return Job(ran.returncode, ran.stdout, ran.stderr)


def _raised(job: Job) -> dict[int, str]:
    """Each rank's ``RAISED`` line (without the prefix), by rank."""
    found: dict[int, str] = {}
    for line in job.stdout.splitlines():
        m = re.match(r"\[(\d+)\]<stdout>:RAISED (.*)", line)
        if m is not None:
            found[int(m.group(1))] = m.group(2)
    return found


def test_a_fast_lane_bug_fails_every_op_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's lane loses step in the middle of a batch of two (a bug): the op it already took
    for that batch used to be left pending for ever (rank 1 hung). Now both its ops fail naming
    the op and the bug, and rank 0 raises naming rank 1's error."""
    job = _run_script(tmp_path, """
        from hora.core.lane import fastlane

        if r == 1:
            real = fastlane.FastLane._run_batch
            batches = [0]

            def out_of_step(self, start, length):
                batches[0] += 1
                if batches[0] > 3 and length > 1:  # the batch's last op moves elsewhere
                    self._entries[start + 10_000] = self._entries.pop(start + length - 1)
                return real(self, start, length)

            fastlane.FastLane._run_batch = out_of_step
        try:
            for step in range(200):
                a, b = np.ones(4) * step, np.ones(4)
                hora.grouped_allreduce([a, b], name="pair")
        except Exception as exc:
            report(exc)
        print("NO ERROR", flush=True)
    """)
    raised = _raised(job)
    assert sorted(raised) == [0, 1], job.stdout + job.stderr
    assert re.search(r"^HoraInternalError .*op '\S+' failed: the fast lane of process set 0 "
                     r"failed: RuntimeError\('out of step at position \d+", raised[1]), raised
    assert "This is a bug in hora" in raised[1]
    assert raised[0].startswith("HoraInternalError"), raised
    assert "rank 1 failed" in raised[0] and "out of step" in raised[0], raised


def test_an_engine_thread_bug_fails_every_op_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's engine thread raises while it runs a response, and again while it stops its
    lanes: every op still fails (its wind-down used to end at the second error, leaving the ops
    pending for ever), naming the op and the original error; rank 0 raises naming it too."""
    job = _run_script(tmp_path, """
        from hora.core.engine import dispatch
        from hora.core.lane import lanes

        if r == 1:
            real = dispatch.Responses.execute
            calls = [0]

            def execute(self, responses):
                calls[0] += 1
                if calls[0] > 3:
                    raise RuntimeError("injected engine fault")
                return real(self, responses)

            def stop_all(self, error):
                raise RuntimeError("injected stop_all fault")

            dispatch.Responses.execute = execute
            lanes.Lanes.stop_all = stop_all
        try:
            for step in range(200):
                hora.broadcast(np.ones(4), 0, name=f"b{step}")
        except Exception as exc:
            report(exc)
        print("NO ERROR", flush=True)
    """)
    raised = _raised(job)
    assert sorted(raised) == [0, 1], job.stdout + job.stderr
    assert re.search(r"^HoraInternalError .*cause=RuntimeError\('injected engine fault'\): "
                     r"op 'broadcast.b\d+' failed: hora's engine thread failed: "
                     r"RuntimeError\('injected engine fault'\)\. This is a bug in hora",
                     raised[1]), raised
    assert "injected engine fault" in raised[0] and "rank 1" in raised[0], raised


def test_a_lost_peer_error_keeps_its_peer_up_to_synchronize(tmp_path: Path) -> None:
    """Rank 1 is killed while rank 0 waits on an async op: ``synchronize`` raises the
    PeerLostError with its ``peer`` (it used to be rebuilt from its text, ``peer`` None)."""
    job = _run_script(tmp_path, """
        hora.barrier()
        if r == 1:
            time.sleep(0.3)  # rank 0 submits first
            os.kill(os.getpid(), signal.SIGKILL)
        handle = hora.allreduce_async(np.ones(4), name="after_the_loss")
        try:
            hora.synchronize(handle)
        except Exception as exc:
            report(exc)
        print("NO ERROR", flush=True)
    """)
    raised = _raised(job)
    assert list(raised) == [0], job.stdout + job.stderr
    assert re.match(r"PeerLostError peer=1 .*rank 1 \(host ", raised[0]), raised
