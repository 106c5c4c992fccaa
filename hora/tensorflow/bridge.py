"""TensorFlow tensors <-> the core's host buffers, eagerly and inside ``tf.function``.

Every collective of this adapter is a function over numpy arrays (the core's one definition of
the op, run through :data:`HOST`, a :class:`~hora.core.frontend.op_forms.Bridge` with TensorFlow's
dtype tables) wrapped by :func:`host_call`:

* eagerly, the tensors' host values are handed over (``EagerTensor.numpy()``) and the results
  come back as tensors;
* in a graph (``tf.function``, Keras ``fit``), the call becomes one ``tf.numpy_function`` op
  (stateful, so ``tf.function`` runs the collectives of a trace in program order on every rank:
  the same order of automatic names everywhere, and no two of them competing for TensorFlow's
  inter-op threads), and static shapes are set where Horovod's ops give them. A call whose
  results are written into its inputs' memory (the gradients' in-place allreduce) is one
  ``tf.py_function`` instead (:func:`host_call_in_place`), which hands TensorFlow back its own
  buffers.

The gradient rules (:mod:`hora.core.frontend.gradients`) run the same way, inside ``host_call``,
over the core's numpy bridge (:class:`hora.core.frontend.host_bridge.HostBridge`, shared with
``hora.jax``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

try:  # the dataset whose function runs inline, on the thread that reads it (TF 2.13+)
    from tensorflow.python.data.ops.map_op import _MapDataset
except ImportError:  # pragma: no cover - older or newer layouts: collectives block a thread
    _MapDataset = None

from hora.core.frontend import op_forms as _sp
from hora.core.frontend.host_bridge import HostBridge
from hora.tensorflow.op_errors import install_session_translation, translated

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


install_session_translation()

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
        try:
            outs = fn(*[_host_array(t) for t in inputs])
        except Exception as exc:
            converted = translated(exc)
            if converted is None:
                raise
            raise converted from exc
        return [tf.convert_to_tensor(np.asarray(o, dtype=d.as_numpy_dtype))
                for o, d in zip(outs, dtypes)]

    def graph_fn(*arrays: np.ndarray) -> list[np.ndarray]:
        return [np.asarray(o, dtype=d.as_numpy_dtype) for o, d in zip(fn(*arrays), dtypes)]

    op = _op_name(name)
    if in_tf1_graph() and _MapDataset is not None:
        return _off_the_executor(graph_fn, inputs, dtypes, op)
    return _as_list(tf.numpy_function(graph_fn, list(inputs), list(dtypes), stateful=True,
                                      name=op))


def host_call_in_place(fn: Callable[..., Sequence[np.ndarray]], inputs: Sequence[tf.Tensor],
                       name: str = "hora") -> list[tf.Tensor]:
    """:func:`host_call` of a ``fn`` that may write its results into its input arrays and
    return those (inside ``tf.function`` only; the inputs' buffers must be this call's alone,
    see :func:`hora.tensorflow.gradients.unshared`). Results of the inputs' dtypes.

    One stateful ``tf.py_function`` op (program order, as :func:`host_call`): ``fn`` gets each
    input as a numpy array over the tensor's own memory (writeable), and an input array it
    returns goes back as the input tensor itself: TensorFlow's own buffer. A
    ``tf.numpy_function`` would hand back a numpy-owned buffer instead, which no later kernel
    may reuse for its output (TensorFlow forwards only buffers it allocated): the optimizer's
    update would then allocate and fill a fresh buffer per gradient, one more pass over the
    gradients' bytes in memory. A result that is not an input array goes back converted (a
    copy where it is not 64-byte aligned).
    """
    dtypes = [x.dtype for x in inputs]

    def run(*tensors: tf.Tensor) -> list[Any]:
        arrays = [_own_memory(t) for t in tensors]
        outs = list(fn(*arrays))
        result = [t if out is array else out for t, out, array in zip(tensors, outs, arrays)]
        del arrays, outs  # (the views of TensorFlow's buffers go while the op still runs)
        return result

    with tf.device("/device:CPU:0"):  # (host tensors in, the same tensors out)
        return _as_list(tf.py_function(run, list(inputs), list(dtypes), name=_op_name(name)))


def _op_name(name: str) -> str:
    """A host call's graph op name: ``name`` with the characters TF op names refuse replaced."""
    return name.replace(".", "_").replace("/", "_")


def _as_list(result: Any) -> list[tf.Tensor]:
    """A host call op's outputs as a list (TF returns a bare tensor for one output)."""
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _own_memory(tensor: Any) -> np.ndarray:
    """A numpy array over ``tensor``'s own memory: writeable where ``fn`` may write its result
    there. ``EagerTensor._numpy`` is what ``__array__`` returns (numpy marks that view
    read-only): for a host tensor (the op runs on the CPU: TensorFlow hands it host tensors) an
    array over the tensor's buffer; anything else is made read-only (``fn`` then writes its
    results elsewhere)."""
    array: np.ndarray = tensor._numpy()
    if array.base is None:  # (a copy, which owns its data: writing into it changes nothing)
        array.flags.writeable = False
    return array


def _off_the_executor(graph_fn: Callable[..., list[np.ndarray]], inputs: Sequence[tf.Tensor],
                      dtypes: Sequence[tf.DType], op: str) -> list[tf.Tensor]:
    """A TF1 graph's host call, run on a thread of its own instead of one of the session's
    inter-op threads.

    A ``Session`` runs independent ops on a small pool (one thread per core by default), in
    any order, and each rank in its own order. A collective blocks its thread until every rank
    has submitted it, so N independent collectives in one ``Session.run`` on a pool of fewer
    than N threads could block every thread of rank 0 in ops that rank 1 has not reached, and
    the reverse (a certain deadlock; Horovod's kernels are asynchronous and never hold a
    thread). Here the ``tf.numpy_function`` runs inside a one-element dataset read by
    ``DatasetToSingleElement``, an asynchronous kernel that runs each read on a thread of an
    unbounded pool, with the map's function run inline on that thread.
    """
    with tf.name_scope(op):
        feed = tuple(inputs) if inputs else (tf.zeros([], tf.int32),)

        def body(*arrays: tf.Tensor) -> tuple[tf.Tensor, ...]:
            args = list(arrays) if inputs else []
            out = tf.numpy_function(graph_fn, args, list(dtypes), stateful=True, name=op)
            return tuple(out) if isinstance(out, (list, tuple)) else (out,)

        dataset = _MapDataset(tf.data.Dataset.from_tensors(feed), body,
                              use_inter_op_parallelism=False)
        return list(dataset.get_single_element())


def differentiable(what: str, xs: Sequence[tf.Tensor], forward: Callable[..., Sequence[Any]],
                   shapes: Sequence[Any], backward: Callable[..., Sequence[Any]] | None,
                   extra: Callable[[Sequence[tf.Tensor]], list[tf.Tensor]] | None = None
                   ) -> list[tf.Tensor]:
    """One collective over ``xs``: host function ``forward`` in one :func:`host_call` (op
    ``Hora<what>``; outputs of the inputs' dtypes, shaped ``shapes``), differentiable when
    every input is floating point: ``backward(name, *cotangents, *extra(inputs))`` (op
    ``Hora<what>Grad``) returns the inputs' cotangents (the rules of
    :mod:`hora.core.frontend.gradients`);
    ``name`` is the gradient op's name in the core, from :func:`op_name` (None outside a TF1
    graph).
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
            name = op_name(None, tensor=dys[0], kind=f"{what}Grad")
            gs = host_call(lambda *a: backward(name, *a), [*dys, *more],
                           [d.dtype for d in dys], f"Hora{what}Grad")
            for g, x in zip(gs, inputs):
                g.set_shape(x.shape)
            return gs
        return run(*inputs), grad

    return list(fn(*xs))


_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9_]")


def in_tf1_graph() -> bool:
    """Whether ops are being added to a ``tf.compat.v1`` graph run by a ``Session`` (not eager,
    not a ``tf.function`` trace). Its executor runs independent ops in any order, so ranks
    must pair its collectives by name, never by call or run order."""
    return (not tf.executing_eagerly()
            and not tf.compat.v1.get_default_graph().building_function)


def op_name(name: str | None, ignore_name_scope: bool = False, tensor: Any = None,
            kind: str = "") -> str | None:
    """The op's name in the core.

    * Eagerly and in ``tf.function``: ``name`` under the current ``tf.name_scope`` (Horovod's
      rule; ``ignore_name_scope`` drops the scope), or None for an automatic, call-order name
      (``tf.function``'s stateful ops run in program order on every rank).
    * In a TF1 graph (:func:`in_tf1_graph`), Horovod's rule: the name of the op's node, made
      unique in the graph, from ``name`` or, unnamed, from the input ``tensor``
      (``Horovod<kind>_<tensor name>``). Every rank that builds the same graph gets the same
      names, whatever order its executor runs them in; two different ops never share one.
    """
    if in_tf1_graph() and (name or tensor is not None):
        base = name or f"Horovod{kind}_{_NOT_IN_NAMES.sub('_', tensor.name)}"
        graph = tf.compat.v1.get_default_graph()
        if not ignore_name_scope:
            return str(graph.unique_name(base))
        with graph.name_scope(None):  # unique among names outside any scope
            return str(graph.unique_name(base))
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


__all__ = ["HOST", "MOVE_DTYPES", "REDUCE_DTYPES", "check_dtype", "host_call", "host_call_in_place",
           "in_tf1_graph", "op_name", "rows_shape"]
