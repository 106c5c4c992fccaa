"""TF1 session helpers: ``broadcast_global_variables`` and ``BroadcastGlobalVariablesHook``
(Horovod's, for ``tf.compat.v1`` graphs run by a ``Session`` or ``MonitoredTrainingSession``).

Under TensorFlow 2's eager execution there are no global variables: use
``hvd.broadcast_variables(model.variables, root_rank)`` or the Keras callback.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora.tensorflow.functions import broadcast_variables


def broadcast_global_variables(root_rank: int) -> Any:
    """The op that assigns ``root_rank``'s values to every ``tf.compat.v1.global_variables()``
    of the default graph (one group of broadcasts); run it in a session.

    Raises:
        RuntimeError: executing eagerly (Horovod's text).
    """
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. "
                           "Please use `hvd.broadcast_variables(<model/optimizer variables>)` "
                           "instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """A ``SessionRunHook`` that broadcasts every global variable from ``root_rank`` once the
    session is created (after variables are initialized or restored from a checkpoint), so
    that every rank starts from the same values."""

    def __init__(self, root_rank: int, device: str = "") -> None:
        """``device`` is accepted for Horovod compatibility (hora broadcasts in host
        memory)."""
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op: Any = None
        self.device = device

    def begin(self) -> None:
        """Build the broadcast op in the graph about to be run (again if the graph changed)."""
        graph = tf.compat.v1.get_default_graph()
        if self.bcast_op is None or self.bcast_op.graph is not graph:
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        """Run the broadcast in the new session."""
        session.run(self.bcast_op)


__all__ = ["BroadcastGlobalVariablesHook", "broadcast_global_variables"]
