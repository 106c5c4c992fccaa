"""Averaging a step's gradients across ranks: one reducer for the tape and the Keras optimizers.

:class:`GradientReducer` takes the gradients of one step (``None`` entries stay ``None``) and
returns them reduced: dense gradients are compressed, then allreduced together in **one** host
call (one ``tf.py_function`` op inside ``tf.function``: all submitted before any is waited
for, so the engine fuses them), by groups when ``groups`` is set
(:func:`hora.core.frontend.distopt.allreduce_groups`); ``tf.IndexedSlices`` are allgathered unless
``sparse_as_dense``; gradients of local variables are only scaled by ``1/size`` (when
``scale_local_gradients``). Names are ``<prefix>.<position>.<variable name>``, the same on every
rank that builds the same model.

Inside ``tf.function`` the gradients are reduced **in place**, in buffers TensorFlow hands to the
host call, and handed back as the same tensors
(:func:`~hora.tensorflow.bridge.host_call_in_place`): no result memory besides the gradients'
own, and TensorFlow's own buffers, which the optimizer's update may reuse for its output. Each
gradient reaches the host call through :func:`unshared`, TensorFlow's own test of whether
anything else holds its buffer (a variable's value, a constant, a tensor another op still
reads): then, and only then, TensorFlow copies it first. Eagerly (the caller's tensors) and in
TF1 graphs the results go to pooled arrays (:class:`~hora.tensorflow.buffers.OutputPool`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hora.collectives.ops import ReduceOp
from hora.core.engine import context as _context
from hora.core.frontend import api as _api
from hora.core.frontend import distopt
from hora.core.frontend import grouped as _grouped
from hora.core.op.process_set import ProcessSet
from hora.tensorflow.bridge import check_dtype, host_call, host_call_in_place, in_tf1_graph
from hora.tensorflow.buffers import OutputPool
from hora.tensorflow.compression import Compressor, NoneCompressor
from hora.tensorflow.mpi_ops import allreduce


def variable_name(var: Any) -> str:
    """A readable, rank-independent name for a variable (Keras 3 ``path`` or TF ``name``)."""
    name = getattr(var, "path", None) or getattr(var, "name", None) or "var"
    return str(name).replace(":", "_")


def unshared(tensor: tf.Tensor) -> tf.Tensor:
    """``tensor``'s value in a buffer that nothing else holds, so that a host call may write its
    result there (graph mode: ``tf.function``).

    ``Snapshot`` forwards its input's buffer when nothing else references it (TensorFlow's
    ``forward_input_or_allocate_output``, the test Horovod's kernels use for in-place results)
    and copies it otherwise: a variable's value, a constant, a tensor that another op has not
    read yet or that the function returns. The ``Print`` before it (stateful, prints nothing:
    ``first_n=0``) passes the buffer on unchanged and keeps Grappler from folding the snapshot
    of a constant gradient into a constant, whose one buffer every run would then hand out.
    """
    with tf.device("/device:CPU:0"):  # where the host call reads it (Print has no GPU kernel)
        held = tf.raw_ops.Print(input=tensor, data=[], message="", first_n=0, summarize=0)
        return tf.raw_ops.Snapshot(input=held)


class GradientReducer:
    """The allreduce of a step's gradients (see the module docstring)."""

    def __init__(self, prefix: str, compression: type[Compressor], sparse_as_dense: bool,
                 op: int, gradient_predivide_factor: float, groups: Any,
                 process_set: ProcessSet, scale_local_gradients: bool) -> None:
        self.prefix = prefix
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = ReduceOp(op)
        self.groups = groups
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.prescale, self.postscale = distopt.scale_factors(op, gradient_predivide_factor)
        self.local_ids: set[int] = set()
        self.outputs = OutputPool()

    def active(self) -> bool:
        """False when reducing is the identity (a set of one, or this rank is outside it). An
        elastic worker always reduces, as Horovod does under ``HOROVOD_ELASTIC=1``: this runs
        when a ``tf.function`` is traced, and the world may grow after a one-rank trace."""
        if not self.process_set.included():
            return False
        if int(self.process_set.size() or 0) > 1:
            return True
        return bool(_context.get("DistributedGradientTape").config.elastic)

    def register_local(self, var: Any) -> None:
        """Leave ``var``'s gradient out of the reduction."""
        self.local_ids.add(id(var))

    def __call__(self, grads: Sequence[Any], variables: Sequence[Any],
                 scale: float = 1.0) -> list[Any]:
        """``grads`` (of ``variables``, position by position) reduced, each multiplied by
        ``scale``: a dense floating-point gradient's in its allreduce's postscale (without a
        pass of its own over it) when not compressed."""
        grads = list(grads)
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in grads]
        if not self.active():
            return _times(grads, scale, set())
        out: list[Any] = list(grads)
        dense: list[int] = []
        size = float(self.process_set.size() or 1)
        for i, (g, v) in enumerate(zip(grads, variables)):
            if g is None:
                continue
            if id(v) in self.local_ids:
                if self.scale_local_gradients:  # IndexedSlices: scale the values
                    out[i] = (tf.IndexedSlices(g.values / size, g.indices, g.dense_shape)
                              if isinstance(g, tf.IndexedSlices) else g / size)
            elif isinstance(g, tf.IndexedSlices):
                out[i] = allreduce(g, op=self.op, name=self._name(i, v),
                                   process_set=self.process_set, ignore_name_scope=True)
            else:
                dense.append(i)
        folded: set[int] = set()
        if dense:
            reduced, fold = self._dense([grads[i] for i in dense],
                                        [variables[i] for i in dense], dense, scale)
            for i, r in zip(dense, reduced):
                out[i] = r
            if fold:
                folded = set(dense)
        return _times(out, scale, folded)

    def _name(self, position: int, var: Any) -> str:
        return f"{self.prefix}.{position}.{variable_name(var)}"

    def _dense(self, grads: list[Any], variables: list[Any], positions: list[int],
               scale: float) -> tuple[list[tf.Tensor], bool]:
        """The dense gradients reduced in one host call, and whether ``scale`` was folded into
        their postscale (not yet applied otherwise)."""
        pairs = [self.compression.compress(check_dtype(g, "reduce")) for g in grads]
        names = [self._name(p, v) for p, v in zip(positions, variables)]
        if isinstance(self.groups, list):
            where = {id(v): k for k, group in enumerate(self.groups) for v in group}
            groups = distopt.group_indices(len(grads), self.groups,
                                           lambda i: where.get(id(variables[i])))
        else:
            groups = distopt.group_indices(len(grads), self.groups)
        grouped = any(len(g) > 1 for g in groups)
        xs = [c for c, _ in pairs]
        fold = scale != 1.0 and self.compression is NoneCompressor \
            and all(x.dtype.is_floating for x in xs)
        post = self.postscale * scale if fold else self.postscale
        in_place = not tf.executing_eagerly() and not in_tf1_graph()
        if in_place:
            xs = [unshared(x) for x in xs]

        def run(*arrays: np.ndarray) -> list[np.ndarray]:
            mine = in_place and all(a.flags.writeable for a in arrays)
            if grouped:
                return self._groups(arrays, names, groups, mine, post)
            if mine:  # (the step benchmarks time _singles with two arguments)
                return (self._singles(arrays, names) if post == self.postscale
                        else self._singles(arrays, names, post))
            return self._pooled(arrays, names, post)

        if in_place:
            reduced = host_call_in_place(run, xs, f"{self.prefix}_Allreduce")
        else:
            reduced = host_call(run, xs, [x.dtype for x in xs], f"{self.prefix}_Allreduce")
        outs = []
        for r, x, (_, ctx) in zip(reduced, xs, pairs):
            r.set_shape(x.shape)
            outs.append(self.compression.decompress(r, ctx))
        return outs, fold

    def _singles(self, arrays: Sequence[np.ndarray], names: list[str],
                 postscale: float | None = None) -> list[np.ndarray]:
        """Allreduce each array in place, submitted together (one fast-lane unit: one fused
        collective where it fits), and return the arrays: buffers TensorFlow handed over
        unshared (:func:`unshared`), which go back as the same tensors. Largest first (where
        the fused op is split at the fusion limit, the small ones share one collective). The
        calling thread runs the fast lane's collectives. (The step's host call in
        ``tf.function``: the step benchmarks time it under this name.)"""
        order = sorted(range(len(arrays)), key=lambda i: -arrays[i].nbytes)
        post = self.postscale if postscale is None else postscale
        _wait_all(_grouped.allreduce_unit_async(
            [arrays[i] for i in order], [names[i] for i in order], op=self.op,
            prescale_factor=self.prescale, postscale_factor=post,
            process_set=self.process_set, inplace=True, sync=True))
        return list(arrays)

    def _pooled(self, arrays: Sequence[np.ndarray], names: list[str],
                postscale: float) -> list[np.ndarray]:
        """Allreduce each array on its own (the engine fuses them), into pooled aligned
        results that TensorFlow adopts without a copy; largest first, so that the small ones
        share one fused collective. For inputs that are not this call's to write (eager
        tensors, TF1 graphs). The calling thread runs the fast lane's collectives."""
        order = sorted(range(len(arrays)), key=lambda i: -arrays[i].nbytes)
        handles = [_api.allreduce_async(
            arrays[i], name=names[i], op=self.op, prescale_factor=self.prescale,
            postscale_factor=postscale, process_set=self.process_set,
            output=self.outputs.take(names[i], arrays[i]), sync=True) for i in order]
        results = _wait_all(handles)
        out: list[np.ndarray] = list(arrays)
        for i, r in zip(order, results):
            out[i] = r
        return out

    def _groups(self, arrays: Sequence[np.ndarray], names: list[str],
                groups: list[list[int]], in_place: bool, postscale: float) -> list[np.ndarray]:
        """``groups``' allreduces: a group of several arrays is one grouped allreduce named
        after its first member, a single array is reduced alone (in place when
        ``in_place``, see :meth:`_singles`)."""
        if not in_place:
            return distopt.allreduce_groups(arrays, names, groups, self.op, self.prescale,
                                            postscale, self.process_set)
        op, pre, post, pset = self.op, self.prescale, postscale, self.process_set
        handles = []
        for group in groups:
            if len(group) == 1:
                handles.append(_api.allreduce_async(
                    arrays[group[0]], name=names[group[0]], op=op, prescale_factor=pre,
                    postscale_factor=post, process_set=pset, inplace=True, sync=True))
            elif group:
                handles.append(_grouped.grouped_allreduce_async(
                    [arrays[i] for i in group], name=names[group[0]], op=op,
                    prescale_factor=pre, postscale_factor=post, process_set=pset,
                    inplace=True, sync=True))
        _wait_all(handles)
        return list(arrays)


def _times(grads: list[Any], scale: float, done: set[int]) -> list[Any]:
    """``grads`` multiplied by ``scale``, but those at the positions ``done`` (and None)."""
    if scale == 1.0:
        return grads
    return [g if g is None or i in done else g * scale for i, g in enumerate(grads)]


def _wait_all(handles: Sequence[Any]) -> list[Any]:
    """Each handle's result, in order; every handle is waited for before the first error is
    raised (none is left in flight). Waited one by one: a group handle over them would keep
    the results alive until the garbage collector broke its cycle."""
    results: list[Any] = []
    first_error: BaseException | None = None
    for handle in handles:
        try:
            results.append(handle.wait())
        except BaseException as exc:  # noqa: BLE001 - wait for the rest, then raise
            first_error = first_error or exc
            results.append(None)
    if first_error is not None:
        raise first_error
    return results


__all__ = ["GradientReducer", "unshared", "variable_name"]
