"""Process-set queries by id, with Horovod's return codes (``horovod_process_set_size`` /
``horovod_process_set_included`` of Horovod's C API).

Framework adapters call these from ops that read the values when a graph *runs*, not when it
is traced (``hora.tensorflow.size_op`` and ``process_set_included_op``): a set added or removed
after the trace, or an elastic reset, is seen by the next run.
"""

from __future__ import annotations

from hora.core.engine import context

PROCESS_SET_ERROR_INIT = -1
"""Horovod's code for "not initialized" (hora raises ``NotInitializedError`` instead, as the
TensorFlow ops of Horovod do)."""
PROCESS_SET_ERROR_UNKNOWN_SET = -3
"""Horovod's code for an id that names no registered process set."""


def process_set_size(process_set_id: int) -> int:
    """Number of ranks in the registered set ``process_set_id`` (0: the job's size), or
    :data:`PROCESS_SET_ERROR_UNKNOWN_SET`.

    Raises:
        NotInitializedError: before ``init()``.
    """
    ctx = context.get("size_op")
    if int(process_set_id) == 0:
        return ctx.size
    members = ctx.engine.registry.members(int(process_set_id))
    return PROCESS_SET_ERROR_UNKNOWN_SET if members is None else len(members)


def process_set_included(process_set_id: int) -> int:
    """1 if this rank belongs to the registered set ``process_set_id`` (always for 0), 0 if
    not, or :data:`PROCESS_SET_ERROR_UNKNOWN_SET`.

    Raises:
        NotInitializedError: before ``init()``.
    """
    ctx = context.get("process_set_included_op")
    if int(process_set_id) == 0:
        return 1
    members = ctx.engine.registry.members(int(process_set_id))
    if members is None:
        return PROCESS_SET_ERROR_UNKNOWN_SET
    return int(ctx.rank in members)


__all__ = ["PROCESS_SET_ERROR_INIT", "PROCESS_SET_ERROR_UNKNOWN_SET", "process_set_included",
           "process_set_size"]
