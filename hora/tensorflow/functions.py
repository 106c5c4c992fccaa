"""Helpers that keep variables and Python state identical on every rank.

``broadcast_variables`` assigns the root's values in place; ``broadcast_object`` /
``allgather_object`` pickle through the core's object collectives. All are collective: every
member of the process set calls them, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from hora.core.frontend import objects as _objects
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.tensorflow.mpi_ops import broadcast_assign


def broadcast_variables(variables: Any, root_rank: int,
                        process_set: ProcessSet = global_process_set,
                        inplace: bool = False) -> Any:
    """Assign ``root_rank``'s values to every ``tf.Variable`` of ``variables`` (one group of
    broadcasts, in list order). ``inplace`` is accepted for Horovod compatibility (variables
    are always assigned in place). Returns None eagerly; in a graph the ``tf.group`` op of the
    assigns, as Horovod does (a TF1 session must run it)."""
    assigns = broadcast_assign(list(variables), root_rank, process_set=process_set)
    return None if tf.executing_eagerly() else tf.group(*assigns)


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None,
                     name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s (cloud)pickled ``obj`` on every member (the root gets its own
    object back). ``session`` (TF1) is ignored. ``name`` defaults to an automatic, call-order
    name (Horovod used the object's type name, which hangs when ranks pass objects of
    different types, e.g. ``None``)."""
    return _objects.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function ``fn(obj)`` that broadcasts ``obj`` from ``root_rank`` (Horovod's helper for
    repeated broadcasts)."""
    def fn(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, session, name, process_set)
    return fn


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return every member's (cloud)pickled ``obj`` as a list in rank order."""
    return _objects.allgather_object(obj, name=name, process_set=process_set)
