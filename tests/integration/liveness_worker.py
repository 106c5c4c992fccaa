"""Ranks for tests/integration/test_liveness_jobs.py: python liveness_worker.py SCENARIO DIR.

They write what the test checks into files of DIR (atomically: ``name.tmp`` then rename), never
on stdout or stderr: a rank of a killed launcher has no one reading its pipes.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import numpy as np

import hora


def _put(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def orphan(out: Path) -> None:
    """A rank that handles SIGTERM (as a script that checkpoints on it would) and trains on
    without writing anything: after its launcher is SIGKILLed, only hora can stop it."""
    def on_term(signum: int, frame: FrameType | None) -> None:  # may run twice, nested
        with open(out / f"term.{os.getpid()}", "a") as f:
            f.write(f"{time.time():.3f}\n")

    signal.signal(signal.SIGTERM, on_term)
    hora.init()
    rank = hora.rank()
    _put(out / f"pid.{rank}", f"{os.getpid()}.")
    start = time.monotonic()
    try:
        while time.monotonic() - start < 60:
            hora.allreduce(np.ones(4), name="step")
            time.sleep(0.02)
        _put(out / f"err.{rank}", "trained for 60 s: nothing stopped it")
    except BaseException as exc:  # the test wants HorovodInternalError: see the type
        _put(out / f"err.{rank}", f"{time.time():.3f} {type(exc).__name__}: {exc}")
    os._exit(3)


def stopped(out: Path) -> None:
    """The last rank stops itself (SIGSTOP) after noting when; rank 0 notes when its heartbeat
    check declared it lost."""
    hora.init()
    rank, size = hora.rank(), hora.size()
    pids = hora.allgather_object(os.getpid())
    if rank == size - 1:
        _put(out / "stopped_at", f"{time.time():.3f}")
        os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(0)  # resumed by rank 0 once it saw the error
    try:
        hora.allreduce(np.ones(4), name="never")
        _put(out / f"err.{rank}", "no error")
    except hora.HorovodInternalError as exc:
        _put(out / f"err.{rank}", f"{time.time():.3f} {exc}")
    if rank == 0:
        os.kill(pids[-1], signal.SIGCONT)


def steady(out: Path) -> None:
    """Allreduces for a while with short heartbeats; says whether a launcher is watched."""
    from hora.rendezvous import launcher_watch

    hora.init()
    for step in range(40):
        hora.allreduce(np.ones(4), name=f"s{step}")
        time.sleep(0.05)
    _put(out / f"ok.{hora.rank()}", f"watched={launcher_watch.active()}")
    hora.shutdown()


if __name__ == "__main__":
    {"orphan": orphan, "stopped": stopped, "steady": steady}[sys.argv[1]](Path(sys.argv[2]))
