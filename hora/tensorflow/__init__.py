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
Keras: :mod:`hora.tensorflow.keras` (also :mod:`hora.keras`). Differences from Horovod are
listed in docs/tensorflow.md.
"""

from __future__ import annotations

from hora import (
    Adasum,
    Average,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from hora.tensorflow.compression import Compression
from hora.tensorflow.functions import (
    allgather_object,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from hora.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
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

__all__ = [
    "Adasum", "Average", "Compression", "DistributedGradientTape", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Max", "Min", "PartialDistributedGradientTape", "Product",
    "ProcessSet", "Sum", "add_process_set", "allgather", "allgather_object", "allreduce",
    "alltoall", "barrier", "broadcast", "broadcast_", "broadcast_object", "broadcast_object_fn",
    "broadcast_variables", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allreduce", "grouped_reducescatter", "init", "is_homogeneous", "is_initialized",
    "join", "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "rank", "reducescatter", "remove_process_set", "rocm_built", "shutdown",
    "size", "start_timeline", "stop_timeline",
]
