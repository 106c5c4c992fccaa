"""hora.tensorflow: Horovod's TensorFlow 2 API (``import hora.tensorflow as hvd``) on hora's
engine.

A Horovod TensorFlow script runs unchanged except for the import, launched with
``hora run -np 2 python train.py``::

    import hora.tensorflow as hvd
    hvd.init()
    with tf.GradientTape() as tape:
        loss = ...
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    hvd.broadcast_variables(model.variables, root_rank=0)

The process API (``init``, ``rank``, ``size``, ...) is :mod:`hora`'s; the collectives take and
return TensorFlow tensors, eagerly and inside ``tf.function`` (:mod:`hora.tensorflow.mpi_ops`).
Keras: :mod:`hora.tensorflow.keras` (also :mod:`hora.keras`). Elastic training: ``hvd.elastic``
(:mod:`hora.tensorflow.elastic`). Differences from Horovod are
listed in docs/tensorflow.md.
"""

from __future__ import annotations

from hora import _basics
from hora._basics import *  # noqa: F403 - Horovod's common names, one list for every adapter
from hora.tensorflow import elastic  # hvd.elastic, as in Horovod (~12 ms of import time)
from hora.tensorflow.compression import Compression
from hora.tensorflow.functions import (
    allgather_object,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from hora.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from hora.tensorflow.graph_ops import (
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    size_op,
)
from hora.tensorflow.mpi_ops import (
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    reducescatter,
)
from hora.tensorflow.sync_batch_norm import SyncBatchNormalization
from hora.tensorflow.util import _executing_eagerly  # noqa: F401 - Horovod's module has it
from hora.tensorflow.v1_optimizer import DistributedOptimizer
from hora.tensorflow.v1_session import BroadcastGlobalVariablesHook, broadcast_global_variables

__all__ = [
    *_basics.__all__,
    "BroadcastGlobalVariablesHook", "Compression", "DistributedGradientTape",
    "DistributedOptimizer", "PartialDistributedGradientTape", "SyncBatchNormalization",
    "allgather", "allgather_object", "allreduce", "alltoall", "barrier", "broadcast",
    "broadcast_", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
    "broadcast_variables", "elastic", "grouped_allgather", "grouped_allreduce",
    "grouped_reducescatter", "join", "local_rank_op", "local_size_op",
    "process_set_included_op", "rank_op", "reducescatter", "size_op",
]
