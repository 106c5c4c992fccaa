"""TensorFlow tensors <-> the core's host buffers, eagerly and inside ``tf.function``.

Every collective of this adapter is a function over numpy arrays (the core's one definition of
the op, run through :data:`HOST`, a :class:`~hora.core.spellings.Bridge` with TensorFlow's
dtype tables) wrapped by :func:`host_call`:

* eagerly, the tensors' host values are handed over (``EagerTensor.numpy()``) and the results
  come back as tensors;
* in a graph (``tf.function``, Keras ``fit``), the call becomes one ``tf.numpy_function`` op
  (stateful, so ``tf.function`` runs the collectives of a trace in program order on every rank:
  the same order of automatic names everywhere, and no two of them competing for TensorFlow's
  inter-op threads), and static shapes are set where Horovod's ops give them.

The gradient rules (:mod:`hora.core.gradients`) run the same way, inside ``host_call``, over the
core's numpy bridge (:class:`hora.core.host_bridge.HostBridge`, shared with ``hora.jax``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hora.core import spellings as _sp
from hora.core.host_bridge import HostBridge

# Horovod's TensorFlow kernels are registered for these dtypes; hora adds bfloat16.
REDUCE_DTYPES = frozenset({tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.bfloat16,
                           tf.float32, tf.float64})
"""Dtypes accepted by allreduce, grouped_allreduce, reducescatter and their gradients."""
MOVE_DTYPES = REDUCE_DTYPES | {tf.uint16, tf.int16, tf.bool}
"""Dtypes accepted by allgather, broadcast and alltoall."""
_TABLES = {_sp.REDUCE: REDUCE_DTYPES, _sp.MOVE: MOVE_DTYPES}


def check_dtype(tensor: Any, table: str) -> tf.Tensor:
    """``tensor`` as a dense tensor of a dtype the op accepts.

    Raises:
        ValueError: ``'Tensor type <dtype> is not supported.'`` (the text of hora.torch).
    """
    if isinstance(tensor, tf.IndexedSlices):
        raise ValueError("tf.IndexedSlices are not supported by this op: convert it with "
                         "tf.convert_to_tensor (allreduce handles IndexedSlices itself).")
    t = tf.convert_to_tensor(tensor)
    if t.dtype not in _TABLES[table]:
        allowed = ", ".join(sorted(d.name for d in _TABLES[table]))
        raise ValueError(f"Tensor type {t.dtype.name} is not supported. Allowed here: "
                         f"{allowed}.")
    return t


HOST = HostBridge()
"""The bridge every collective of :mod:`hora.tensorflow` runs through (on host arrays, whose
dtypes :func:`check_dtype` checked against TensorFlow's tables before they left TensorFlow)."""


def _host_array(tensor: tf.Tensor) -> np.ndarray:
    array: np.ndarray = tensor.numpy()
    return array


def host_call(fn: Callable[..., Sequence[np.ndarray]], inputs: Sequence[tf.Tensor],
              dtypes: Sequence[tf.DType], name: str = "hora") -> list[tf.Tensor]:
    """Run ``fn(*arrays) -> arrays`` on the host values of ``inputs``; results as tensors of
    ``dtypes``. Eager: a direct call. In a graph: one stateful ``tf.numpy_function`` op."""
    if tf.executing_eagerly():
        outs = fn(*[_host_array(t) for t in inputs])
        return [tf.convert_to_tensor(np.asarray(o, dtype=d.as_numpy_dtype))
                for o, d in zip(outs, dtypes)]

    def graph_fn(*arrays: np.ndarray) -> list[np.ndarray]:
        return [np.asarray(o, dtype=d.as_numpy_dtype) for o, d in zip(fn(*arrays), dtypes)]

    result = tf.numpy_function(graph_fn, list(inputs), list(dtypes), stateful=True,
                               name=name.replace(".", "_").replace("/", "_"))
    return list(result) if isinstance(result, (list, tuple)) else [result]


def differentiable(what: str, xs: Sequence[tf.Tensor], forward: Callable[..., Sequence[Any]],
                   shapes: Sequence[Any], backward: Callable[..., Sequence[Any]] | None,
                   extra: Callable[[Sequence[tf.Tensor]], list[tf.Tensor]] | None = None
                   ) -> list[tf.Tensor]:
    """One collective over ``xs``: host function ``forward`` in one :func:`host_call` (op
    ``Hora<what>``; outputs of the inputs' dtypes, shaped ``shapes``), differentiable when
    every input is floating point: ``backward(*cotangents, *extra(inputs))`` (op
    ``Hora<what>Grad``) returns the inputs' cotangents (the rules of :mod:`hora.core.gradients`).
    """
    def run(*inputs: tf.Tensor) -> list[tf.Tensor]:
        ys = host_call(forward, inputs, [x.dtype for x in inputs], f"Hora{what}")
        for y, shape in zip(ys, shapes):
            y.set_shape(shape)
        return ys

    if backward is None or not all(x.dtype.is_floating for x in xs):
        return run(*xs)

    @tf.custom_gradient
    def fn(*inputs: tf.Tensor) -> Any:
        more = extra(inputs) if extra is not None else []

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            gs = host_call(backward, [*dys, *more], [d.dtype for d in dys], f"Hora{what}Grad")
            for g, x in zip(gs, inputs):
                g.set_shape(x.shape)
            return gs
        return run(*inputs), grad

    return list(fn(*xs))


def op_name(name: str | None, ignore_name_scope: bool = False) -> str | None:
    """The op's name in the core: ``name`` under the current ``tf.name_scope`` (Horovod's rule;
    ``ignore_name_scope`` drops the scope), or None for an automatic, call-order name."""
    if not name:
        return None
    scope = "" if ignore_name_scope else tf.get_current_name_scope()
    return f"{scope}/{name}" if scope else name


def rows_shape(tensor: tf.Tensor) -> tf.TensorShape:
    """Static shape of a result whose first dimension is only known at run time."""
    shape = tensor.shape
    if shape.rank is None:
        return tf.TensorShape(None)
    return tf.TensorShape([None] + shape.as_list()[1:])


__all__ = ["HOST", "MOVE_DTYPES", "REDUCE_DTYPES", "check_dtype", "host_call", "op_name",
           "rows_shape"]
