"""A process's lifetime tied to its parent's (Linux ``PR_SET_PDEATHSIG``)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys


def die_with_parent(signum: int = int(signal.SIGTERM)) -> bool:
    """Ask Linux to send ``signum`` to this process when its parent exits.

    A rank that ``hora run --data-plane mpi`` started through mpirun calls it at ``init()``, so
    that killing the launcher (and with it mpirun) cannot leave ranks running, as ``hora run``'s
    own ranks cannot be left. Returns False where it is not available (not Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    parent = os.getppid()
    if prctl(1, signum, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        return False
    if parent == 1 or os.getppid() != parent:  # the parent is gone already
        os.kill(os.getpid(), signum)
    return True


__all__ = ["die_with_parent"]
