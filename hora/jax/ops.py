"""Horovod's collectives on ``jax.Array``\\ s and pytrees, eager and inside ``jax.jit``, with
their gradients.

Each op runs the core's one definition of the collective (:mod:`hora.core.frontend.op_forms`) on
host arrays through :func:`hora.jax.bridge.apply` (a direct call eagerly, a ``pure_callback``
wrapped in ``custom_vjp`` when traced). A pytree is one grouped op (one fused collective); a
bare array is Horovod's single-tensor op with Horovod's name. Gradients are Horovod's rules
(:mod:`hora.core.frontend.gradients`):

========================  ===================================================================
forward                   gradient of ``dy``
========================  ===================================================================
allreduce(op, pre, post)  allreduce(dy) with the same op, factors and set
allgather                 Average-allreduce(dy), then this rank's rows
broadcast(root)           Average-allreduce(dy); zeros on every rank but the root
alltoall                  alltoall(dy) back along the received splits
reducescatter(op)         dy * set size (Sum only) * pre * post, then allgather
========================  ===================================================================

Contract (Horovod's): every member of the process set calls the op with the same ``name``
(unnamed ops pair by call order, or inside ``jit`` by trace order), the same pytree structure,
dtypes and shape rules. Argument errors raise ``ValueError`` at call (trace) time; ranks that
disagree get ``HorovodInternalError`` (a pytree's differing leaf path is named), inside ``jit``
as the runtime error that carries its text.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from hora.collectives.ops import ReduceOp
from hora.core.data import packing as _packing
from hora.core.engine import context as _context
from hora.core.frontend import api as _api
from hora.core.frontend import gradients as _grads
from hora.core.frontend import grouped as _grouped
from hora.core.frontend import op_forms as _sp
from hora.core.op.handle import Handle
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.jax import host_call
from hora.jax import packed as _packed
from hora.jax.bridge import HOST, apply, check_leaf, is_traced
from hora.jax.compression import Compression, Compressor
from hora.jax.tree import Flat, diagnose, flatten

Spec = jax.ShapeDtypeStruct


def _set(process_set: ProcessSet) -> tuple[int, int]:
    """(this rank in the set, set size), checked."""
    size = process_set.size()
    if size is None:
        raise ValueError(f"{process_set} is not registered: pass it to hvd.init(process_sets=...)"
                         " or hvd.add_process_set first.")
    return int(process_set.rank() or 0), int(size)


def _specs(flat: Flat, table: str, kind: str) -> list[Spec]:
    paths = flat.paths() if not flat.single else ["<array>"]
    return [check_leaf(x, table, f"{kind} leaf {p}") for x, p in zip(flat.leaves, paths)]


def op_name(kind: str, name: str | None, flat: Flat, grouped: bool,
            process_set: ProcessSet) -> str | None:
    """The op's name: Horovod's for one eager array (None: the core names it at submission);
    a pytree's carries its structure tag; traced ops are named now, at trace time."""
    if not grouped and not is_traced(flat.leaves):
        return name
    base = _context.get(kind).engine.names.base(kind, name, process_set.process_set_id or 0)
    return f"{base}.{flat.tag()}" if grouped and not flat.single else base


def _grad_name(name: str | None, traced: bool) -> str | None:
    return f"{name}.grad" if traced and name else None


def _guard(kind: str, flat: Flat, specs: list[Spec], grouped: bool,
           process_set: ProcessSet, fn: Any) -> Any:
    """``fn`` whose cross-rank failure names the differing leaf of a pytree."""
    if not grouped:
        return fn
    shapes = Flat(list(specs), flat.treedef)
    return lambda *args: diagnose(kind, shapes, process_set, lambda: fn(*args))


# ---- allreduce -----------------------------------------------------------------------------
def _allreduce(kind: str, flat: Flat, leaves: list[Any], name: str | None, op: ReduceOp,
               pre: float, post: float, process_set: ProcessSet, grouped: bool) -> list[Any]:
    full = op_name("grouped_allreduce" if grouped else "allreduce", name, flat, grouped,
                   process_set)
    if grouped and len(leaves) > 1 and op is not ReduceOp.Adasum:  # Adasum: per leaf
        return _allreduce_packed(kind, flat, leaves, full, op, pre, post, process_set)
    specs = _specs(Flat(leaves, flat.treedef), _sp.REDUCE, kind)
    gname = _grad_name(full, is_traced(leaves))
    args = (op, pre, post, process_set)

    def forward(a: list[np.ndarray]) -> list[np.ndarray]:
        if grouped:
            out: list[np.ndarray] = _sp.run(HOST, _sp.GROUPED_ALLREDUCE, a, None, full, *args)
            return out
        return [_sp.run(HOST, _sp.ALLREDUCE, a[0], None, full, *args)]

    def backward(g: list[np.ndarray]) -> list[np.ndarray]:
        if grouped:
            return _grads.grouped_allreduce(HOST, g, *args, name=gname)
        return [_grads.allreduce(HOST, g[0], *args, name=gname)]

    def into(a: list[np.ndarray], outs: list[np.ndarray] | None) -> list[np.ndarray]:
        # the core writes the result straight into XLA's result buffer (no copy after)
        handle = _api.allreduce_async(a[0], name=full, op=op, prescale_factor=pre,
                                      postscale_factor=post, process_set=process_set,
                                      output=outs[0] if outs is not None else None, sync=True)
        return [handle.wait()]

    single_into = into if not grouped and op is not ReduceOp.Adasum else None
    return apply(kind, leaves, _guard(kind, flat, specs, grouped, process_set, forward), specs,
                 backward, into=single_into)


def _allreduce_packed(kind: str, flat: Flat, leaves: list[Any], full: str | None,
                      op: ReduceOp, pre: float, post: float,
                      process_set: ProcessSet) -> list[Any]:
    """A tree's allreduce as one buffer per dtype (:mod:`hora.jax.packed`): one op, not one
    per leaf. Traced: XLA concatenates, one callback reduces the buffers and hands back every
    leaf as its own result (differentiable: the backward pass concatenates the cotangents and
    allreduces them); eagerly, the tree shape's cached plan packs with one jitted call and
    unpacks with another. When every buffer is a concatenation (hora's own memory), the core
    reduces it in place (traced: every concatenation, through the FFI host call's aliased
    results); traced, a lone leaf the jitted function computes is reduced in place too (aliased
    to its own result), and a lone leaf that is an argument is written straight into XLA's
    result buffer of that leaf (the host call's ``into`` mode). The op name carries the
    leaves' shapes, so trees that differ only in shapes do not pair."""
    plan = _packed.plan(leaves, _sp.REDUCE, kind, lambda: Flat(leaves, flat.treedef).paths())
    name = f"{full}.{_packing.layout_tag(plan.layout)}"
    args = (op, pre, post, process_set)
    single = len(plan.layout.groups) == 1  # one buffer: the core's single-array op

    def reduce(inplace: bool) -> Any:
        def run(a: list[np.ndarray]) -> list[np.ndarray]:
            if single:
                return [_sp.run(HOST, _sp.ALLREDUCE, a[0], None, name, *args, inplace=inplace)]
            out: list[np.ndarray] = _sp.run(HOST, _sp.GROUPED_ALLREDUCE, a, None, name, *args,
                                            inplace=inplace)
            return out
        return _guard(kind, flat, plan.specs, True, process_set, run)

    if not is_traced(leaves):
        buffers = plan.host_buffers(leaves)
        # every buffer hora's own packed copy: reduce it in place (no copy, no new buffer)
        inplace = plan.owned and all(b.flags.writeable for b in buffers)
        return plan.leaves(reduce(inplace)(buffers))
    if not host_call.available():  # jax.pure_callback: read-only operands, results copied
        return apply(kind, plan.operands(leaves), reduce(False), plan.specs,
                     _backward(name, args), plan.operand_specs, plan.operands,
                     plan.pieces)
    # the FFI host call: aliased buffers reduced in place, a lone argument leaf straight into
    # its result (``into``), the packed leaves copied out by the host call
    aliases, lone = plan.aliases(leaves), plan.lone

    def into(a: list[np.ndarray], outs: list[np.ndarray] | None) -> list[np.ndarray]:
        outputs = [a[k] if k in aliases else outs[lone[k]] if outs is not None and k in lone
                   else None for k in range(len(a))]  # (outs: views of those lone leaves)
        if single:
            return [_api.allreduce_async(
                a[0], name=name, op=op, prescale_factor=pre, postscale_factor=post,
                process_set=process_set, output=outputs[0], sync=True).wait()]
        handle = _grouped.grouped_allreduce_async(
            a, name=name, op=op, prescale_factor=pre, postscale_factor=post,
            process_set=process_set, sync=True, outputs=outputs)
        out: list[np.ndarray] = handle.wait()
        return out

    return apply(kind, plan.operands(leaves), reduce(False), plan.specs,
                 _backward(name, args), plan.operand_specs, plan.operands, plan.pieces,
                 aliases, _guard(kind, flat, plan.specs, True, process_set, into),
                 [i for k, i in lone.items() if k not in aliases])


def _backward(name: str, args: tuple[ReduceOp, float, float, ProcessSet]) -> Any:
    """The gradient of a packed tree's allreduce: the cotangents packed as the operands were,
    allreduced (one op)."""
    gname = _grad_name(name, True)

    def backward(g: list[np.ndarray]) -> list[np.ndarray]:
        if len(g) == 1:
            return [_grads.allreduce(HOST, g[0], *args, name=gname)]
        return _grads.grouped_allreduce(HOST, g, *args, name=gname)
    return backward


def _compressed(compression: type[Compressor], leaves: list[Any],
                run: Any) -> list[Any]:
    """``run`` (leaves -> results) on the compressed leaves, its results decompressed; no
    per-leaf calls for ``Compression.none``."""
    if compression is Compression.none:
        out: list[Any] = run(leaves)
        return out
    pairs = [compression.compress(x) for x in leaves]
    outs = run([c for c, _ in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


def _check_adasum(op: ReduceOp, flat: Flat, process_set: ProcessSet) -> None:
    """Adasum's argument errors at call (trace) time, as Horovod raises them."""
    if op is ReduceOp.Adasum:
        for leaf in flat.leaves:
            dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
            _api.check_adasum(np.dtype(dtype), process_set)


def allreduce(tensor: Any, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Reduce ``tensor`` (an array or a pytree of arrays: one fused group) across the set:
    ``postscale * op(prescale * x_i)`` (default Average; integer Average truncates). Returns
    the same structure. Differentiable; callable inside ``jax.jit``. A dict of scalars is the
    way to average metrics: ``hvd.allreduce({"loss": l, "acc": a})``."""
    resolved = _api.resolve_op(op, average)
    flat = flatten(tensor)
    _check_adasum(resolved, flat, process_set)
    return flat.unflatten(_compressed(compression, flat.leaves, lambda leaves: _allreduce(
        "allreduce", flat, leaves, name, resolved, prescale_factor, postscale_factor,
        process_set, not flat.single)))


def grouped_allreduce(tensors: Any, average: bool | None = None, name: str | None = None,
                      compression: type[Compressor] = Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> Any:
    """Allreduce a list of arrays (or any pytree) as one group; returns the same structure."""
    resolved = _api.resolve_op(op, average)
    flat = flatten(tensors)
    if not flat.leaves:
        return tensors
    _check_adasum(resolved, flat, process_set)
    return flat.unflatten(_compressed(compression, flat.leaves, lambda leaves: _allreduce(
        "grouped_allreduce", flat, leaves, name, resolved, prescale_factor, postscale_factor,
        process_set, True)))


# ---- allgather -----------------------------------------------------------------------------
def _rows(specs: list[Spec], kind: str) -> list[int]:
    for s in specs:
        if not s.shape:
            raise ValueError(f"hora.jax.{kind}: 0-d arrays cannot be gathered along dimension "
                             "0; reshape to (1,) first.")
    return [int(s.shape[0]) for s in specs]


def _allgather(kind: str, tensor: Any, name: str | None, process_set: ProcessSet,
               grouped: bool) -> Any:
    flat = flatten(tensor)
    if not flat.leaves:
        return tensor
    grouped = grouped or not flat.single
    specs = _specs(flat, _sp.MOVE, kind)
    dims = _rows(specs, kind)
    _, size = _set(process_set)
    out_specs = [Spec((d * size,) + tuple(s.shape[1:]), s.dtype) for d, s in zip(dims, specs)]
    full = op_name("grouped_allgather" if grouped else "allgather", name, flat, grouped,
                   process_set)
    gname = _grad_name(full, is_traced(flat.leaves))

    def forward(a: list[np.ndarray]) -> list[np.ndarray]:
        if grouped:
            out: list[np.ndarray] = _sp.run(HOST, _sp.GROUPED_ALLGATHER, a, full, process_set)
            return out
        return [_sp.run(HOST, _sp.ALLGATHER, a[0], full, process_set)]

    def backward(g: list[np.ndarray]) -> list[np.ndarray]:
        if grouped:
            return _grads.grouped_allgather(HOST, g, dims, process_set, name=gname)
        return [_grads.allgather(HOST, g[0], dims[0], process_set, name=gname)]

    outs = apply(kind, flat.leaves, _guard(kind, flat, specs, grouped, process_set, forward),
                 out_specs, backward)
    return flat.unflatten(outs)


def allgather(tensor: Any, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every member's array along dimension 0 (set rank order). Eagerly the first
    dimensions may differ; inside ``jit`` they must be equal (static shapes). A pytree is
    gathered leaf by leaf in one group. Differentiable."""
    return _allgather("allgather", tensor, name, process_set, False)


def grouped_allgather(tensors: Any, name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> Any:
    """Allgather each array of a list (or pytree) as one group."""
    return _allgather("grouped_allgather", tensors, name, process_set, True)


# ---- broadcast -----------------------------------------------------------------------------
def _wait_all(handles: list[tuple[Handle, Any]]) -> list[Any]:
    """Wait for every handle, then raise the first error (none is left in flight)."""
    out, first_error = [], None
    for handle, convert in handles:
        try:
            out.append(convert(handle.wait()))
        except BaseException as exc:  # noqa: BLE001 - finish every op, then raise the first
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
    return out


def broadcast_host(arrays: list[np.ndarray], root_rank: int, name: str | None,
                   process_set: ProcessSet) -> list[np.ndarray]:
    """Broadcast host arrays (op names ``<name>.<i>``), all submitted before any is waited."""
    if len(arrays) == 1 and name is None:
        return [_sp.run(HOST, _sp.BROADCAST, arrays[0], root_rank, None, process_set)]
    return _wait_all([_sp.BROADCAST.submit(HOST, False, False, a, root_rank,
                                           f"{name}.{i}" if name else None, process_set)
                      for i, a in enumerate(arrays)])


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s array (or pytree: every leaf) on every member. Shapes, dtypes
    and the root must agree on all ranks. Differentiable."""
    flat = flatten(tensor)
    if not flat.leaves:
        return tensor
    specs = _specs(flat, _sp.MOVE, "broadcast")
    grouped = not flat.single
    full = op_name("broadcast", name, flat, grouped, process_set)
    gname = _grad_name(full, is_traced(flat.leaves))

    def forward(a: list[np.ndarray]) -> list[np.ndarray]:
        if not grouped:
            return [_sp.run(HOST, _sp.BROADCAST, a[0], root_rank, full, process_set)]
        return broadcast_host(a, root_rank, full, process_set)

    def backward(g: list[np.ndarray]) -> list[np.ndarray]:
        return [_grads.broadcast(HOST, x, root_rank, process_set,
                                 name=f"{gname}.{i}" if gname else None)
                for i, x in enumerate(g)]

    outs = apply("broadcast", flat.leaves,
                 _guard("broadcast", flat, specs, grouped, process_set, forward), specs,
                 backward)
    return flat.unflatten(outs)


# ---- alltoall / reducescatter ----------------------------------------------------------------
def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[j]`` rows (dimension 0) to member ``j``, receive theirs. Returns the
    received array when ``splits`` is None (even split), else ``(received,
    received_splits)``. Inside ``jit``: ``splits=None`` only, the same first dimension on
    every rank (static shapes). Differentiable in the received array."""
    flat = flatten(tensor)
    if not flat.single:
        raise ValueError("hora.jax.alltoall takes one array, not a pytree.")
    spec = _specs(flat, _sp.MOVE, "alltoall")[0]
    rows = _rows([spec], "alltoall")[0]
    _, size = _set(process_set)
    traced = is_traced(flat.leaves)
    if traced and splits is not None:
        raise ValueError("hora.jax.alltoall inside jax.jit needs splits=None (the received "
                         "shape must be known when tracing); call it outside jit for uneven "
                         "splits.")
    full = op_name("alltoall", name, flat, False, process_set)
    gname = _grad_name(full, traced)
    received: list[Any] = [None]

    def forward(a: list[np.ndarray]) -> list[np.ndarray]:
        out, received[0] = _sp.run(HOST, _sp.ALLTOALL, a[0], splits, full, process_set)
        return [out]

    def backward(g: list[np.ndarray]) -> list[np.ndarray]:
        back = [rows // size] * size if traced else received[0]
        return [_grads.alltoall(HOST, g[0], back, rows, process_set, name=gname)]

    out = apply("alltoall", flat.leaves, forward, [spec], backward)[0]
    if splits is None:
        return out
    return out, jax.numpy.asarray(received[0])


def _reducescatter(kind: str, tensor: Any, name: str | None,
                   compression: type[Compressor], op: int | None, process_set: ProcessSet,
                   pre: float, post: float, grouped: bool) -> Any:
    resolved = _api.reducescatter_op(op)
    flat = flatten(tensor)
    if not flat.leaves:
        return tensor
    grouped = grouped or not flat.single
    pairs = [compression.compress(x) for x in flat.leaves]
    leaves = [c for c, _ in pairs]
    specs = _specs(Flat(leaves, flat.treedef), _sp.REDUCE, kind)
    dims = _rows(specs, kind)
    me, size = _set(process_set)
    out_specs = [Spec((d // size + (1 if me < d % size else 0),) + tuple(s.shape[1:]), s.dtype)
                 for d, s in zip(dims, specs)]
    full = op_name("grouped_reducescatter" if grouped else "reducescatter", name, flat, grouped,
                   process_set)
    gname = _grad_name(full, is_traced(leaves))
    scale = _grads.reducescatter_scale(resolved, pre, post, process_set)
    args = (resolved, process_set, pre, post)

    def forward(a: list[np.ndarray]) -> list[np.ndarray]:
        if grouped:
            out: list[np.ndarray] = _sp.run(HOST, _sp.GROUPED_REDUCESCATTER, a, full, *args)
            return out
        return [_sp.run(HOST, _sp.REDUCESCATTER, a[0], full, *args)]

    def backward(g: list[np.ndarray]) -> list[np.ndarray]:
        if grouped:
            return _grads.grouped_reducescatter(HOST, g, scale, process_set, name=gname)
        return [_grads.reducescatter(HOST, g[0], scale, process_set, name=gname)]

    outs = apply(kind, leaves, _guard(kind, flat, specs, grouped, process_set, forward),
                 out_specs, backward)
    return flat.unflatten([compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)])


def reducescatter(tensor: Any, name: str | None = None,
                  compression: type[Compressor] = Compression.none,
                  op: int | None = ReduceOp.Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """Reduce (Sum or Average) across the set and return this rank's share of dimension 0
    (the first ``dim0 % size`` members get one extra row). Pytrees: one group.
    Differentiable."""
    return _reducescatter("reducescatter", tensor, name, compression, op, process_set,
                          prescale_factor, postscale_factor, False)


def grouped_reducescatter(tensors: Any, name: str | None = None,
                          compression: type[Compressor] = Compression.none,
                          op: int | None = ReduceOp.Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
    """Reducescatter each array of a list (or pytree) as one group."""
    return _reducescatter("grouped_reducescatter", tensors, name, compression, op, process_set,
                          prescale_factor, postscale_factor, True)


__all__ = ["allgather", "allreduce", "alltoall", "broadcast", "broadcast_host",
           "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "op_name",
           "reducescatter"]
