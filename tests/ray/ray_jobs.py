"""Functions the hora.ray tests run on the workers (sent by value: the workers cannot import
this directory). Heavy imports happen inside them, on the workers."""

from __future__ import annotations

import os
import signal
import time
from typing import Any


def identity_and_allreduce() -> dict[str, Any]:
    """init, then everything a rank knows about itself, and a Sum-allreduce of rank + 1."""
    import numpy as np

    import hora

    hora.init()
    total = hora.allreduce(np.full(5, hora.rank() + 1.0), op=hora.Sum, name="ident")
    return {"rank": hora.rank(), "size": hora.size(), "local_rank": hora.local_rank(),
            "local_size": hora.local_size(), "cross_rank": hora.cross_rank(),
            "cross_size": hora.cross_size(), "host": os.environ["HORA_HOSTNAME"],
            "pid": os.getpid(), "sum": total.tolist()}


def scaled_rank(factor: int, *, offset: int = 0) -> int:
    """init, then ``rank * factor + offset``."""
    import hora

    hora.init()
    return hora.rank() * factor + offset


def environment(names: list[str]) -> dict[str, str | None]:
    """The values of ``names`` in the worker's environment."""
    return {n: os.environ.get(n) for n in names}


def cmdline_and_secret() -> tuple[str, str]:
    """This process's command line and its HORA_SECRET_KEY."""
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    return cmdline, os.environ.get("HORA_SECRET_KEY", "")


class Counter:
    """An executable: created in every worker by ``start(executable_cls=Counter, ...)``."""

    def __init__(self, start: int, *, step: int = 1) -> None:
        import hora

        hora.init()
        self.value = start + hora.rank() * step

    def bump(self) -> int:
        self.value += 1
        return self.value


def log_values(n: int) -> int:
    """Send ``n`` values to the driver's callbacks (rank 0 only, Horovod's default)."""
    import hora
    from hora.ray import ray_logger

    hora.init()
    for i in range(n):
        ray_logger.log({"step": i, "rank": hora.rank()})
    return hora.rank()


def raise_on(rank: int, after_init: bool = True) -> int:
    """Raise ValueError on ``rank``; the others return their rank."""
    import hora

    if after_init:
        hora.init()
    if int(os.environ["HORA_RANK"]) == rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    return int(os.environ["HORA_RANK"])


def raise_while_others_allreduce(rank: int) -> int:
    """``rank`` raises after init; the others block in an allreduce it never joins."""
    import numpy as np

    import hora

    hora.init()
    if hora.rank() == rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    hora.allreduce(np.ones(3), name="never_completes")
    return hora.rank()


def allreduce_loop(kill_rank: int, kill_at: int, steps: int) -> int:
    """Allreduce ``steps`` times; ``kill_rank`` SIGKILLs itself at step ``kill_at`` (a crash
    mid-run: no Python cleanup, its peers blocked in the next allreduce)."""
    import numpy as np

    import hora

    hora.init()
    x = np.ones(1 << 12)
    for step in range(steps):
        if step == kill_at and hora.rank() == kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        hora.allreduce(x, name=f"loop.{step}")
    return hora.rank()


def sleep_forever() -> None:
    """Block (for the tests that kill a busy worker from the driver)."""
    while True:
        time.sleep(0.1)


def first_allreduce_time() -> float:
    """init, one allreduce, the wall-clock time it completed."""
    import numpy as np

    import hora

    hora.init()
    hora.allreduce(np.ones(4), name="first")
    return time.time()
