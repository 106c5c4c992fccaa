"""Horovod's TensorFlow collectives, eager and in ``tf.function``, with their gradients.

Each op runs the core's one definition of the collective (:mod:`hora.core.frontend.op_forms`) on
host arrays through :func:`hora.tensorflow.bridge.host_call`, and registers Horovod's gradient
(:mod:`hora.core.frontend.gradients`) with ``tf.custom_gradient``:

========================  ===================================================================
forward                   gradient of ``dy``
========================  ===================================================================
allreduce(op, pre, post)  allreduce(dy) with the same op, factors and set
allgather                 Average-allreduce(dy), then this rank's rows
broadcast(root)           Average-allreduce(dy); zeros on every rank but the root
alltoall(splits)          alltoall(dy, splits=received_splits)
reducescatter(op)         dy * set size (Sum only) * pre * post, then allgather
========================  ===================================================================

Contract (Horovod's): every member of the process set calls the op with the same ``name``
(unnamed ops pair by call order, which ``tf.function`` keeps: the ops are stateful), dtype and
shape rules. Argument errors raise ``ValueError`` at call (trace) time. Ranks that disagree get
``HorovodInternalError`` naming the tensor, field and ranks: eagerly as that exception, in a
graph as the ``tf.errors.OpError`` that carries its text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hora.collectives.ops import ReduceOp
from hora.core.engine import context as _context
from hora.core.frontend import api as _api
from hora.core.frontend import gradients as _grads
from hora.core.frontend import grouped as _grouped
from hora.core.frontend import op_forms as _sp
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.tensorflow.bridge import (
    HOST,
    check_dtype,
    differentiable,
    host_call,
    op_name,
    rows_shape,
)
from hora.tensorflow.compression import Compression, Compressor


def _differentiable(x: tf.Tensor) -> bool:
    return bool(x.dtype.is_floating)


# ---- allreduce ---------------------------------------------------------------------------------
def _allreduce(tensor: tf.Tensor, name: str | None, op: ReduceOp, pre: float, post: float,
               process_set: ProcessSet) -> tf.Tensor:
    args = (op, pre, post, process_set)
    return differentiable(
        "Allreduce", [tensor],
        lambda a: [_sp.run(HOST, _sp.ALLREDUCE, a, None, name, *args)], [tensor.shape],
        lambda n, g: [_grads.allreduce(HOST, g, *args, name=n)])[0]


def _sparse_checks(op: ReduceOp, pre: float, post: float) -> None:
    """Horovod's rules for ``tf.IndexedSlices``, checked when the op is built."""
    if op not in (ReduceOp.Sum, ReduceOp.Average):
        raise NotImplementedError(
            f"The {op.name} reduction does not support sparse tensors (tf.IndexedSlices are "
            "allgathered: only Sum and Average): pass sparse_as_dense=True to "
            "DistributedOptimizer or convert with tf.convert_to_tensor.")
    if pre != 1.0 or post != 1.0:
        raise NotImplementedError("prescale_factor and postscale_factor are not supported with "
                                  "tf.IndexedSlices (a sparse allreduce is an allgather).")


def _sparse_allreduce(slices: tf.IndexedSlices, name: str | None, op: ReduceOp,
                      process_set: ProcessSet) -> tf.IndexedSlices:
    """IndexedSlices: values and indices are allgathered (the core's sparse allreduce, summed);
    Average then divides the values by the set size with TensorFlow's division, as Horovod
    does (integer values become floating point: ``/`` is true division)."""
    values = check_dtype(slices.values, _sp.MOVE)
    indices = tf.convert_to_tensor(slices.indices)

    def run(v: np.ndarray, i: np.ndarray) -> list[np.ndarray]:
        ctx = _context.get("allreduce")
        base = ctx.engine.names.base("sparse_allreduce", name, process_set.process_set_id or 0)
        out: tuple[np.ndarray, np.ndarray] = _grouped.sparse_allreduce_async(
            v, i, name=base, op=ReduceOp.Sum, process_set=process_set).wait()
        return list(out)

    v, i = host_call(run, [values, indices], [values.dtype, indices.dtype], "HoraSparseAllreduce")
    v.set_shape(rows_shape(values))
    i.set_shape(rows_shape(indices))
    if op is ReduceOp.Average:
        v = v / tf.cast(process_set.size() or 1, v.dtype)
    return tf.IndexedSlices(v, i, dense_shape=slices.dense_shape)


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: type[Compressor] = Compression.none,
              op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: str | None = None, process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` across the set: ``postscale * op(prescale * x_i)`` (default Average;
    integer Average truncates). A ``tf.IndexedSlices`` is allgathered instead (values divided
    by the set size for Average; Sum and Average only). Differentiable.

    ``device_dense`` / ``device_sparse`` are accepted for Horovod compatibility (hora reduces in
    host memory).
    """
    resolved = _api.resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        _sparse_checks(resolved, prescale_factor, postscale_factor)
        full = op_name(name, ignore_name_scope, tensor.values, "Allreduce")
        return _sparse_allreduce(tensor, full, resolved, process_set)
    x = check_dtype(tensor, _sp.REDUCE)
    full = op_name(name, ignore_name_scope, x, "Allreduce")
    if resolved is ReduceOp.Adasum:  # Horovod raises these when the op is built
        _api.check_adasum(x.dtype.as_numpy_dtype, process_set)
    compressed, ctx = compression.compress(x)
    out = _allreduce(compressed, full, resolved, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: type[Compressor] = Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      name: str | None = None, process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False) -> list[Any]:
    """Allreduce a list of tensors as one group (paired by list position across ranks; the
    engine fuses them). Returns the list of results. Differentiable."""
    resolved = _api.resolve_op(op, average)
    if not tensors:
        return []
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    if sparse:  # Horovod: each IndexedSlices allgathered on its own, the rest as one group
        _sparse_checks(resolved, prescale_factor, postscale_factor)
        out: list[Any] = list(tensors)
        for i in sparse:
            out[i] = allreduce(tensors[i], op=resolved, compression=compression,
                               name=f"{name}.{i}" if name else None, process_set=process_set,
                               ignore_name_scope=ignore_name_scope)
        dense = sorted(set(range(len(tensors))) - set(sparse))
        reduced = grouped_allreduce([tensors[i] for i in dense], None, device_dense,
                                    device_sparse, compression, resolved, prescale_factor,
                                    postscale_factor, name, process_set, ignore_name_scope)
        for i, r in zip(dense, reduced):
            out[i] = r
        return out
    checked = [check_dtype(t, _sp.REDUCE) for t in tensors]
    full = op_name(name, ignore_name_scope, checked[0], "GroupedAllreduce")
    if resolved is ReduceOp.Adasum:
        for t in checked:
            _api.check_adasum(t.dtype.as_numpy_dtype, process_set)
    pairs = [compression.compress(t) for t in checked]
    xs = [c for c, _ in pairs]
    args = (resolved, prescale_factor, postscale_factor, process_set)
    outs = differentiable(
        "GroupedAllreduce", xs,
        lambda *a: _sp.run(HOST, _sp.GROUPED_ALLREDUCE, list(a), None, full, *args),
        [x.shape for x in xs], lambda n, *g: _grads.grouped_allreduce(HOST, g, *args, name=n))
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


# ---- allgather ---------------------------------------------------------------------------------
def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every member's tensor along dimension 0 in set rank order (first
    dimensions may differ, the rest and the dtype must agree). Differentiable."""
    return grouped_allgather([tensor], name, ignore_name_scope, process_set)[0]


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Allgather each tensor of a list; returns the list of results. Differentiable."""
    xs = [check_dtype(t, _sp.MOVE) for t in tensors]
    if not xs:
        return []
    full = op_name(name, ignore_name_scope, xs[0], "Allgather")
    single = len(xs) == 1
    family = _sp.ALLGATHER if single else _sp.GROUPED_ALLGATHER
    n = len(xs)

    def forward(*a: np.ndarray) -> list[np.ndarray]:
        out = _sp.run(HOST, family, a[0] if single else list(a), full, process_set)
        return [out] if single else list(out)

    def backward(grad_name: str | None, *a: np.ndarray) -> list[np.ndarray]:
        rows = [int(d) for d in a[n:]]  # a: cotangents, then each input's rows
        if single:
            return [_grads.allgather(HOST, a[0], rows[0], process_set, grad_name)]
        return _grads.grouped_allgather(HOST, a[:n], rows, process_set, grad_name)

    return differentiable("Allgather", xs, forward, [rows_shape(x) for x in xs], backward,
                          lambda inputs: [tf.shape(x, out_type=tf.int64)[0] for x in inputs])


# ---- broadcast ---------------------------------------------------------------------------------
def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Return ``root_rank``'s tensor (global rank, member of the set) on every member. Shape,
    dtype and root must agree on all ranks. Differentiable."""
    x = check_dtype(tensor, _sp.MOVE)
    full = op_name(name, ignore_name_scope, x, "Broadcast")
    return differentiable(
        "Broadcast", [x], lambda a: [_sp.run(HOST, _sp.BROADCAST, a, root_rank, full,
                                             process_set)], [x.shape],
        lambda n, g: [_grads.broadcast(HOST, g, root_rank, process_set, n)])[0]


def broadcast_(variables: Any, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> Any:
    """In place: assign ``root_rank``'s values to ``variables`` (a variable, ``tf.Variable`` or
    Keras, or a list of them), as one group of broadcasts. Returns the variables' values after
    the broadcast (a tensor, or a list of them), as Horovod does: in a graph they are read
    after the assigns, so a session that evaluates them runs the broadcast."""
    single = not isinstance(variables, (list, tuple))
    var_list = [variables] if single else list(variables)
    assigns = broadcast_assign(var_list, root_rank, name, process_set)
    if tf.executing_eagerly():
        values = [tf.convert_to_tensor(v) for v in var_list]
    else:
        with tf.control_dependencies(assigns):
            values = [tf.identity(v) for v in var_list]
    return values[0] if single else values


def broadcast_assign(var_list: list[Any], root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """:func:`broadcast_`'s work: one host call broadcasts every variable, then one assign
    each. Returns the assigns (in a TF1 graph, what a session must run)."""
    if not var_list:
        return []
    xs = [check_dtype(v, _sp.MOVE) for v in var_list]
    base = op_name(name, tensor=xs[0], kind="BroadcastInplace")

    def run(*arrays: np.ndarray) -> list[np.ndarray]:
        names = [None] * len(arrays) if base is None else [f"{base}.{i}"
                                                           for i in range(len(arrays))]
        handles = [_api.broadcast_async(a, root_rank, name=n, process_set=process_set)
                   for a, n in zip(arrays, names)]
        return [h.wait() for h in handles]

    values = host_call(run, xs, [x.dtype for x in xs], "HoraBroadcastInplace")
    return [v.assign(tf.reshape(value, tf.shape(v))) for v, value in zip(var_list, values)]


# ---- alltoall ----------------------------------------------------------------------------------
def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[j]`` rows (dimension 0) to set member ``j``, receive theirs. Returns the
    received tensor when ``splits`` is None (even split), else ``(received, received_splits)``
    (int32, not differentiable). Differentiable in the received tensor."""
    x = check_dtype(tensor, _sp.MOVE)
    full = op_name(name, ignore_name_scope, x, "Alltoall")
    split_t = (tf.zeros([0], tf.int32) if splits is None
               else tf.cast(tf.reshape(tf.convert_to_tensor(splits), [-1]), tf.int32))
    even = splits is None

    def forward(t: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        def run(a: np.ndarray, s: np.ndarray) -> list[np.ndarray]:
            out, received = _sp.run(HOST, _sp.ALLTOALL, a, None if even else s, full,
                                    process_set)
            return [out, received]
        y, received = host_call(run, [t, split_t], [t.dtype, tf.int32], "HoraAlltoall")
        y.set_shape(rows_shape(t))
        received.set_shape([process_set.size() if process_set.included() else None])
        return y, received

    if not _differentiable(x):
        y, received = forward(x)
    else:
        @tf.custom_gradient
        def fn(t: tf.Tensor) -> Any:
            out, recv = forward(t)
            rows = tf.shape(t, out_type=tf.int64)[0]

            def grad(dy: tf.Tensor, _drecv: Any = None) -> tf.Tensor:
                gname = op_name(None, tensor=dy, kind="AlltoallGrad")
                g = host_call(lambda a, r, n: [_grads.alltoall(HOST, a, r, int(n), process_set,
                                                               gname)],
                              [dy, recv, rows], [dy.dtype], "HoraAlltoallGrad")[0]
                g.set_shape(t.shape)
                return g
            return (out, recv), grad

        y, received = fn(x)
        received = tf.stop_gradient(received)
    return y if even else (y, received)


# ---- reducescatter -----------------------------------------------------------------------------
def reducescatter(tensor: Any, device_dense: str = "",
                  compression: type[Compressor] = Compression.none,
                  op: int | None = ReduceOp.Average, name: str | None = None,
                  process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce (Sum or Average) across the set and return this rank's share of dimension 0 (the
    first ``dim0 % size`` members get one extra row). Differentiable."""
    out: tf.Tensor = grouped_reducescatter([tensor], device_dense, compression, op, name,
                                           process_set, ignore_name_scope, prescale_factor,
                                           postscale_factor)[0]
    return out


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: type[Compressor] = Compression.none,
                          op: int | None = ReduceOp.Average, name: str | None = None,
                          process_set: ProcessSet = global_process_set,
                          ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[tf.Tensor]:
    """Reducescatter each tensor of a list; returns the list of shares. Differentiable."""
    resolved = _api.reducescatter_op(op)
    pairs = [compression.compress(check_dtype(t, _sp.REDUCE)) for t in tensors]
    xs = [c for c, _ in pairs]
    if not xs:
        return []
    full = op_name(name, ignore_name_scope, xs[0], "Reducescatter")
    for x in xs:
        if x.shape.rank == 0:
            raise ValueError("Reducescatter does not support scalar inputs: reducescatter "
                             "needs a tensor with at least one dimension.")
    single = len(xs) == 1
    family = _sp.REDUCESCATTER if single else _sp.GROUPED_REDUCESCATTER
    args = (resolved, process_set, prescale_factor, postscale_factor)

    def forward(*a: np.ndarray) -> list[np.ndarray]:
        out = _sp.run(HOST, family, a[0] if single else list(a), full, *args)
        return [out] if single else list(out)

    def backward(grad_name: str | None, *g: np.ndarray) -> list[np.ndarray]:
        scale = _grads.reducescatter_scale(resolved, prescale_factor, postscale_factor,
                                           process_set)
        if single:
            return [_grads.reducescatter(HOST, g[0], scale, process_set, grad_name)]
        return _grads.grouped_reducescatter(HOST, g, scale, process_set, grad_name)

    outs = differentiable("Reducescatter", xs, forward, [rows_shape(x) for x in xs], backward)
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


# ---- control -----------------------------------------------------------------------------------
def join(process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """This rank has no more data: until every rank has joined, it contributes zeros to the
    others' allreduces. Blocks until all ranks joined; returns the last rank to join (an int32
    tensor, as Horovod's op)."""
    return host_call(lambda: [np.int32(_api.join(process_set))], [], [tf.int32], "HoraJoin")[0]


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every member of the set has called ``barrier`` (hora extra for
    TensorFlow: Horovod's TensorFlow module has none). Eager only."""
    _api.barrier(process_set)
