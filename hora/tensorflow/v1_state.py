"""Variables of a TF1 graph, committed, restored and synced through a ``tf.compat.v1.Session``:
the engine of ``hvd.elastic.TensorFlowState(variables, session=sess)`` (Horovod's TF1 form).

As in Horovod, the values are read with the session (a commit holds numpy copies), written
back with assign ops, and rank 0's values are broadcast by a broadcast op run in the session.
Unlike Horovod (``var.load`` adds assign ops to the graph at every restore), every op is built
once, when the state is created: commits, restores and syncs never grow the graph, so they also
work in a finalized graph (``MonitoredTrainingSession``) once the state exists.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from hora.tensorflow.functions import broadcast_variables

v1 = tf.compat.v1


def _as_list(variables: Any) -> list[Any]:
    many = isinstance(variables, (list, tuple)) or (
        not hasattr(variables, "assign") and hasattr(variables, "__iter__"))
    found: list[Any] = []
    seen: set[int] = set()
    for v in (list(variables) if many else [variables]):
        if id(v) not in seen:
            seen.add(id(v))
            found.append(v)
    return found


def default_session(owner: str) -> Any:
    """The session a graph-mode state runs in when none was given: the default session
    (``with sess.as_default():``, Horovod's default), else ``ValueError``."""
    session = v1.get_default_session()
    if session is None:
        raise ValueError(f"{owner}: in graph mode (tf.compat.v1) the state needs a session: "
                         "pass session=sess, or create the state inside "
                         "`with sess.as_default():`.")
    return session


class SessionVariables:
    """``variables`` (default: the global variables of ``session.graph``) with the ops that
    read, write and broadcast them, all built now in ``session.graph``.

    Raises:
        ValueError: no variables, or a variable that is not in the session's graph.
        TypeError: ``session`` is not a session, or an entry is not a variable.
    """

    def __init__(self, variables: Any, session: Any, owner: str) -> None:
        if not (callable(getattr(session, "run", None)) and hasattr(session, "graph")):
            raise TypeError(f"{owner}: session must be a tf.compat.v1.Session (or None); got "
                            f"{type(session).__name__}")
        graph = session.graph
        self.session = session
        with graph.as_default():
            found = v1.global_variables() if variables is None else _as_list(variables)
            if not found:
                raise ValueError(f"{owner}(session=...): no variables to track (the session's "
                                 "graph has no global variables); pass variables=[...].")
            bad = sorted({type(v).__name__ for v in found if not hasattr(v, "assign")})
            if bad:
                raise TypeError(f"{owner}: variables must be tf.Variable objects; got "
                                f"{', '.join(bad)}")
            foreign = [str(v.name) for v in found if getattr(v, "graph", None) is not graph]
            if foreign:
                raise ValueError(f"{owner}: variable(s) {', '.join(foreign[:5])} are not in the "
                                 "session's graph (build the variables and the session in the "
                                 "same tf.Graph).")
            self.variables = found
            with tf.name_scope("hora_elastic_state"):
                self._feeds = [v1.placeholder(tf.as_dtype(v.dtype).base_dtype, v.shape)
                               for v in found]
                self._load = tf.group(*[v.assign(p, read_value=False)
                                        for v, p in zip(found, self._feeds)])
                self._bcast = broadcast_variables(found, root_rank=0)
        self.values: list[np.ndarray] = []

    def save(self) -> None:
        """Snapshot the variables' current values (copies: later steps never change them)."""
        self.values = [np.array(a, copy=True) for a in self.session.run(self.variables)]

    def restore(self) -> None:
        """Assign the snapshot back to the variables."""
        self.session.run(self._load, feed_dict=dict(zip(self._feeds, self.values)))

    def broadcast(self) -> None:
        """Give every rank rank 0's current values (collective: every rank runs it)."""
        self.session.run(self._bcast)


__all__ = ["SessionVariables", "default_session"]
