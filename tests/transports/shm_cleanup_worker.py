"""Ranks for tests/transports/test_shm_cleanup.py, started without `hora run` (torchrun- or
mpirun-style environment). Usage: shm_cleanup_worker.py SCENARIO."""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

import hora


def _warm() -> None:
    """Make every shared-memory group exist: the set's route and its fast lane."""
    for _ in range(3):
        hora.allreduce(np.ones(16384, dtype=np.float32), name="warm")


def kill_one() -> None:
    """The last rank SIGKILLs itself with an allreduce in flight; the others must raise."""
    hora.init()
    _warm()
    hora.barrier()
    victim = hora.size() - 1
    if hora.rank() == victim:
        hora.allreduce_async(np.ones(16384, dtype=np.float32), name="last")
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        hora.allreduce(np.ones(16384, dtype=np.float32), name="last")
        hora.allreduce(np.ones(16384, dtype=np.float32), name="after")
    except hora.HorovodInternalError as exc:
        print(f"RAISED rank {hora.rank()}: {type(exc).__name__}", flush=True)
        hora.shutdown()
        sys.exit(3)
    print("NOT RAISED", flush=True)
    sys.exit(4)


def kill_all() -> None:
    """Every rank SIGKILLs itself with its segments mapped: nobody is left to clean up."""
    hora.init()
    _warm()
    hora.barrier()
    print(f"READY rank {hora.rank()}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def simple() -> None:
    hora.init()
    _warm()
    print(f"OK rank {hora.rank()}", flush=True)
    hora.shutdown()


if __name__ == "__main__":
    {"kill_one": kill_one, "kill_all": kill_all, "simple": simple}[sys.argv[1]]()
