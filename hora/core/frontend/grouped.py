"""Grouped calls: several collectives submitted as one, with one handle for all of them.

``grouped_allreduce``, ``grouped_allgather``, ``grouped_reducescatter`` and the sparse
"allreduce" (an allgather of the values and one of the indices) are built on the single ops of
:mod:`hora.core.frontend.api`, whose contract they share. Each member is an op of its own, named
``<base>_<i>of<n>`` (sparse: ``<name>.values`` / ``<name>.indices``) and tagged with its group,
so that the coordinator fails a group's pending members together (deadlock detection).

Allreduce and allgather members are submitted together (:meth:`~hora.core.engine.engine.Engine.
submit_group`): in a fast lane (:mod:`hora.core.lane.fastlane`) they are one *unit*, logged at once,
run whole (one fused allreduce when it fits) and in the same order on every rank, or all
negotiated (a call of more than :data:`~hora.core.lane.fastlane.MAX_UNIT` members is several units,
in order). The :class:`~hora.core.op.handle.GroupHandle` returned drives that lane when waited
on, as a single op's handle does. ``sync=True`` promises that the caller waits at once (the
lane's wake-ups then go to the caller, not to the lane thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hora.collectives.ops import ReduceOp, scale_inplace
from hora.core.engine import context
from hora.core.frontend import api
from hora.core.lane import fastlane
from hora.core.op.entry import Entry
from hora.core.op.handle import DerivedHandle, GroupHandle, Handle
from hora.core.op.process_set import ProcessSet, global_process_set


def _submit_units(ctx: context.Context, entries: list[Entry]) -> None:
    """Submit ops together, in units of at most :data:`~hora.core.lane.fastlane.MAX_UNIT`."""
    step = fastlane.MAX_UNIT
    for start in range(0, len(entries), step):
        ctx.engine.submit_group(entries[start:start + step])


def _submit_group(ctx: context.Context, name: str, entries: list[Entry]) -> GroupHandle:
    """Submit a grouped call's ops together (:func:`_submit_units`); one handle for all."""
    _submit_units(ctx, entries)
    return GroupHandle(name, [e.handle for e in entries])


def grouped_allreduce_async(tensors: Sequence[Any], *, name: str | None = None,
                            op: int = ReduceOp.Average, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set,
                            inplace: bool = False, device: str = "cpu",
                            sync: bool = False,
                            outputs: Sequence[np.ndarray | None] | None = None) -> Handle:
    """Allreduce a list of tensors as one group (names ``grouped_allreduce.<base>_<i>of<n>``);
    resolves to the list of results. In a fast lane the members run as one unit: one fused
    allreduce when they fit in the lane's fusion limit, else in order, split where it is
    reached. ``outputs`` (not with ``inplace``): per member, a contiguous array of its shape
    and dtype to write the result into (an adapter's own result memory), or None for a new
    one."""
    ctx = context.get("grouped_allreduce")
    base = ctx.engine.names.base("grouped_allreduce", name, process_set.process_set_id or 0)
    n = len(tensors)
    group = f"grouped_allreduce.{base}"
    outs = outputs if outputs is not None else [None] * n
    entries = [api.allreduce_entry(ctx, t, f"{base}_{i + 1}of{n}", op, prescale_factor,
                                   postscale_factor, process_set, inplace, out,
                                   "grouped_allreduce", device, sync, group)
               for i, (t, out) in enumerate(zip(tensors, outs))]
    return _submit_group(ctx, group, entries)


def allreduce_unit_async(tensors: Sequence[Any], names: Sequence[str], *,
                         op: int = ReduceOp.Average, prescale_factor: float = 1.0,
                         postscale_factor: float = 1.0,
                         process_set: ProcessSet = global_process_set, inplace: bool = False,
                         sync: bool = False) -> list[Handle]:
    """:func:`~hora.core.frontend.api.allreduce_async` of each tensor under its own name
    (``allreduce.<name>``, no group: each is negotiated, named and reported as a single op),
    submitted together: in a fast lane one *unit* (in units of at most
    :data:`~hora.core.lane.fastlane.MAX_UNIT`), run whole, as one fused allreduce where it fits
    the fusion limit, members of 1 MiB and more included where the fused op needs no packing
    (:data:`~hora.core.lane.lane_leader.SOLO_BYTES`). An adapter's allreduces of one step's
    gradients. The handles, in order."""
    ctx = context.get("allreduce")
    entries = [api.allreduce_entry(ctx, t, name, op, prescale_factor, postscale_factor,
                                   process_set, inplace, None, "allreduce", "cpu", sync, "")
               for t, name in zip(tensors, names, strict=True)]
    _submit_units(ctx, entries)
    return [e.handle for e in entries]


def grouped_allgather_async(tensors: Sequence[Any], *, name: str | None = None,
                            process_set: ProcessSet = global_process_set,
                            device: str = "cpu", sync: bool = False) -> Handle:
    """Allgather each tensor of a list (names ``grouped_allgather.<base>_<i>of<n>``); resolves
    to the list of gathered arrays. In a fast lane: one unit, one allgather per member."""
    ctx = context.get("grouped_allgather")
    base = ctx.engine.names.base("grouped_allgather", name, process_set.process_set_id or 0)
    n = len(tensors)
    group = f"grouped_allgather.{base}"
    entries = [api.allgather_entry(ctx, t, f"{base}_{i + 1}of{n}", process_set,
                                   "grouped_allgather", device, group, sync)
               for i, t in enumerate(tensors)]
    return _submit_group(ctx, group, entries)


def grouped_reducescatter_async(tensors: Sequence[Any], *, name: str | None = None,
                                op: int = ReduceOp.Average, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0,
                                process_set: ProcessSet = global_process_set,
                                device: str = "cpu") -> Handle:
    """Reducescatter each tensor of a list (names ``grouped_reducescatter.<base>_<i>of<n>``);
    resolves to the list of this rank's shares (always negotiated)."""
    ctx = context.get("grouped_reducescatter")
    base = ctx.engine.names.base("grouped_reducescatter", name, process_set.process_set_id or 0)
    n = len(tensors)
    group = f"grouped_reducescatter.{base}"
    members = [api.reducescatter_async(t, name=f"{base}_{i + 1}of{n}", op=op,
                                       prescale_factor=prescale_factor,
                                       postscale_factor=postscale_factor,
                                       process_set=process_set, prefix="grouped_reducescatter",
                                       device=device, group=group)
               for i, t in enumerate(tensors)]
    return GroupHandle(group, members)


def sparse_allreduce_async(values: Any, indices: Any, *, name: str,
                           op: int = ReduceOp.Average,
                           process_set: ProcessSet = global_process_set,
                           device: str = "cpu", sync: bool = False) -> Handle:
    """Horovod's sparse "allreduce": allgather the non-zero ``values`` (nnz first) and their
    ``indices`` (shape ``[nnz, ndim]``, nnz first) as ``allgather.<name>.values`` /
    ``allgather.<name>.indices``, together (one unit in a fast lane).

    Resolves to ``(values, indices)`` concatenated in rank order (duplicate indices are not
    coalesced). With op Average the values are divided by the set size (in their own dtype);
    Sum leaves them; other ops raise ValueError.
    """
    op = ReduceOp(op)
    if op not in (ReduceOp.Sum, ReduceOp.Average):
        raise ValueError(f"sparse allreduce supports only Average and Sum, not {op.name}")
    ctx = context.get("sparse_allreduce")
    group = f"sparse_allreduce.{name}"
    entries = [api.allgather_entry(ctx, values, f"{name}.values", process_set, "allgather",
                                   device, group, sync),
               api.allgather_entry(ctx, indices, f"{name}.indices", process_set, "allgather",
                                   device, group, sync)]
    size = len(ctx.engine.registry.members(entries[0].request.set_id) or ())
    both = _submit_group(ctx, group, entries)

    def finish(gathered: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        gathered_values, gathered_indices = gathered
        if op is ReduceOp.Average:
            scale_inplace(gathered_values, 1.0 / size)
        return gathered_values, gathered_indices

    return DerivedHandle(both, finish)


__all__ = ["allreduce_unit_async", "grouped_allgather_async", "grouped_allreduce_async",
           "grouped_reducescatter_async", "sparse_allreduce_async"]
