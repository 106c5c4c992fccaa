"""Values a worker sends to the driver during ``RayExecutor.run(..., callbacks=[...])``:
Horovod's ``horovod.ray.ray_logger``.

Inside the function a worker runs, ``ray_logger.log({"loss": 0.1})`` puts the value on a queue
that the driver drains while it waits for the results, calling every callback with every
value, in order. By default only rank 0's values are sent (``chief_only=True``). Outside a run
with callbacks it warns once and does nothing.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

_queue: Any = None
_warned = False


def configure(queue: Any) -> None:
    """Set (or, with None, clear) this process's queue to the driver. Called by the worker
    actor; users do not call it."""
    global _queue
    _queue = queue


def log(info: Any, chief_only: bool = True) -> None:
    """Send ``info`` (any picklable value) to the driver's callbacks.

    Args:
        info: the value; Horovod passes a dict of metrics.
        chief_only: send only from rank 0 (``HOROVOD_RANK`` of this worker).
    """
    global _warned
    if chief_only and os.environ.get("HOROVOD_RANK", os.environ.get("HORA_RANK")) != "0":
        return
    if _queue is None:
        if not _warned:
            warnings.warn("hora.ray.ray_logger.log() called, but this run has no callbacks: "
                          "pass callbacks=[...] to RayExecutor.run() / execute() to receive "
                          "the values", stacklevel=2)
            _warned = True
        return
    _queue.put(info)


__all__ = ["configure", "log"]
