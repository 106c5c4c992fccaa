"""Horovod's graph-friendly topology ops: ``rank_op``, ``local_rank_op``, ``size_op``,
``local_size_op``, ``process_set_included_op``.

Each returns a scalar int32 tensor whose value is read when the op *runs* (one stateful
``tf.numpy_function`` op inside ``tf.function`` or a TF1 graph; a plain tensor eagerly), not
when the graph is traced: a ``tf.function`` traced before an elastic reset or before
``add_process_set`` sees the new values without retracing, as Horovod's kernels do. Like
Horovod's, the ops fail when hora is not initialized (``NotInitializedError`` eagerly; in a
graph the ``tf.errors.OpError`` carrying its text) and have no gradient.

``size_op`` and ``process_set_included_op`` return Horovod's error code -3
(``HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET``) for an id that names no registered set.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from hora import _basics
from hora.core.engine import set_queries
from hora.tensorflow.bridge import host_call


def _scalar(read: Callable[[], int], name: str | None, default: str) -> tf.Tensor:
    out = host_call(lambda: [np.int32(read())], [], [tf.int32], name or default)[0]
    out.set_shape([])
    return out


def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's global rank, read when the op runs."""
    return _scalar(_basics.rank, name, "HoraRank")


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank on its host, read when the op runs (Horovod's Python wrapper
    returns the global rank here, a bug; hora returns the local rank its docstring
    promises)."""
    return _scalar(_basics.local_rank, name, "HoraLocalRank")


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """Number of ranks in the job (``process_set_id=0``) or in that process set, read when the
    op runs; -3 for an unknown set id."""
    return _scalar(lambda: set_queries.process_set_size(process_set_id), name, "HoraSize")


def local_size_op(name: str | None = None) -> tf.Tensor:
    """Number of ranks on this host, read when the op runs."""
    return _scalar(_basics.local_size, name, "HoraLocalSize")


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this rank belongs to process set ``process_set_id`` (always for 0), else 0; -3 for
    an unknown set id. Read when the op runs."""
    return _scalar(lambda: set_queries.process_set_included(process_set_id), name,
                   "HoraProcessSetIncluded")


__all__ = ["local_rank_op", "local_size_op", "process_set_included_op", "rank_op", "size_op"]
