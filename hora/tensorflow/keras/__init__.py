"""hora.tensorflow.keras: Horovod's Keras API on TensorFlow, for Keras 3 and for Keras 2 through
tf-keras (``import hora.tensorflow.keras as hvd``; :mod:`hora.keras` is the same module's API).

::

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss=...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])

The value helpers (``allreduce``, ``allgather``, ``broadcast``, ``reducescatter``) evaluate
and return numpy values, as Horovod's Keras helpers do.

Keras 2: with ``TF_USE_LEGACY_KERAS=1`` set before TensorFlow is imported (``pip install
tf-keras``), ``tf.keras`` is tf-keras and this module serves Horovod's Keras 2 semantics: the
callbacks, ``load_model`` and the elastic callbacks follow ``tf.keras``
(:mod:`hora.tensorflow.keras_flavor`); ``DistributedOptimizer`` follows the optimizer's class
(:mod:`hora.tensorflow.keras.keras2_optimizer` for any tf-keras optimizer).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from hora import (
    Adasum,
    Average,
    HorovodInternalError,
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
from hora.collectives.ops import ReduceOp
from hora.tensorflow import mpi_ops as _ops
from hora.tensorflow.compression import Compression, Compressor
from hora.tensorflow.functions import allgather_object, broadcast_object
from hora.tensorflow.keras import callbacks, elastic
from hora.tensorflow.keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from hora.tensorflow.keras.wrapping import loading_class
from hora.tensorflow.keras_flavor import keras_of_tf, legacy_keras


def broadcast_global_variables(root_rank: int) -> None:
    """Horovod's TF1 helper; raises as Horovod does under TensorFlow 2's eager execution.

    Raises:
        RuntimeError: always (use ``BroadcastGlobalVariablesCallback`` or
            ``hvd.broadcast_variables(model.variables, root_rank)``).
    """
    raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution "
                       "(TensorFlow 2 has no global variables). Please use "
                       "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) or "
                       "hora.tensorflow.broadcast_variables(model.variables, root_rank) "
                       "instead.")


def allreduce(value: Any, name: str | None = None, average: bool | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              op: int | None = None,
              compression: type[Compressor] = Compression.none) -> np.ndarray:
    """Allreduce ``value`` (array-like or tensor) and return the result as a numpy value."""
    out = _ops.allreduce(value, average=average, compression=compression, op=op,
                         prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                         name=name)
    return np.asarray(out)


def allgather(value: Any, name: str | None = None) -> np.ndarray:
    """Allgather ``value`` along dimension 0 and return the result as a numpy value."""
    return np.asarray(_ops.allgather(value, name=name))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> np.ndarray:
    """Broadcast ``value`` from ``root_rank`` and return the result as a numpy value."""
    return np.asarray(_ops.broadcast(value, root_rank, name=name))


def reducescatter(value: Any, name: str | None = None,
                  op: int | None = ReduceOp.Average) -> np.ndarray:
    """Reducescatter ``value`` and return this rank's share as a numpy value."""
    return np.asarray(_ops.reducescatter(value, op=op, name=name))


def load_model(filepath: Any, custom_optimizers: Any = None, custom_objects: Any = None,
               compression: type[Compressor] = Compression.none,
               legacy_opts: bool = False) -> Any:
    """``load_model`` of whichever Keras ``tf.keras`` is, whose optimizer comes back wrapped in
    :func:`DistributedOptimizer` (every built-in Keras optimizer and ``custom_optimizers``).
    With Keras 3 ``legacy_opts`` is accepted for Horovod compatibility (Keras 3 has no legacy
    optimizers); with tf-keras it picks ``tf.keras.optimizers.legacy`` classes for the saved
    optimizers, which otherwise follow the saved config
    (:func:`~hora.tensorflow.keras.keras2_optimizer.load_objects`)."""
    if legacy_keras():
        from hora.tensorflow.keras.keras2_optimizer import load_objects

        keras2 = keras_of_tf()
        objects = load_objects(
            keras2, custom_optimizers,
            lambda opt: DistributedOptimizer(opt, compression=compression), legacy_opts)
        objects.update(custom_objects or {})
        return keras2.models.load_model(filepath, custom_objects=objects)
    classes = [c for c in vars(keras.optimizers).values()
               if isinstance(c, type) and issubclass(c, keras.optimizers.Optimizer)]
    classes += list(custom_optimizers or [])
    wrapped: dict[str, Any] = {}
    for cls in classes:
        def make(config: dict[str, Any], base: Any = cls) -> Any:
            return DistributedOptimizer(base.from_config(config), compression=compression)
        wrapped[cls.__name__] = loading_class(cls, make)
    wrapped.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=wrapped)


__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max",
    "Min", "PartialDistributedOptimizer", "Product", "ProcessSet", "Sum", "add_process_set",
    "allgather", "allgather_object", "allreduce", "broadcast", "broadcast_global_variables",
    "broadcast_object", "callbacks", "ccl_built", "cross_rank", "cross_size", "cuda_built",
    "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled", "init",
    "is_initialized", "load_model", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "reducescatter", "remove_process_set",
    "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline",
]
