"""The asynchronous forms: start a collective on concrete arrays (or a pytree) and return an
integer handle; ``hvd.synchronize(handle)`` waits and returns the result as ``jax.Array``\\ s in
the input's structure, ``hvd.poll(handle)`` tells whether it finished.

They submit the same core op as the synchronous forms (:mod:`hora.core.frontend.op_forms` families
through :data:`hora.jax.bridge.HOST`); a pytree is one grouped op. Handles cannot leave a traced
function, so these raise a clear error inside ``jax.jit`` / ``grad`` / ``vmap``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hora.collectives.ops import ReduceOp
from hora.core.frontend import api as _api
from hora.core.frontend import op_forms as _sp
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.jax.bridge import HOST, eager_only, to_host, to_jax
from hora.jax.ops import op_name
from hora.jax.tree import Flat, flatten


def _start(kind: str, family: _sp.OpForm, grouped: bool, tensor: Any, *args: Any,
           name: str | None, process_set: ProcessSet, rows_of: bool = False) -> int:
    flat = flatten(tensor)
    eager_only(f"{kind}_async", flat.leaves)
    grouped = grouped or not flat.single
    full = op_name(f"grouped_{kind}" if grouped else kind, name, flat, grouped, process_set)
    arrays = [to_host(x) for x in flat.leaves]
    if grouped:
        handle, _ = family.submit(HOST, False, False, arrays, *_place(args, full, process_set))
        return _sp.register(handle, lambda outs: _tree(flat, outs))
    handle, _ = family.submit(HOST, False, False, arrays[0], *_place(args, full, process_set))
    return _sp.register(handle, lambda out: to_jax(out))


def _place(args: tuple[Any, ...], name: str | None, process_set: ProcessSet) -> tuple[Any, ...]:
    """The family's arguments after the tensor: ``args`` with ``"<name>"`` / ``"<set>"``
    placeholders filled in."""
    return tuple(name if a == "<name>" else process_set if a == "<set>" else a for a in args)


def _tree(flat: Flat, outs: list[np.ndarray]) -> Any:
    return flat.unflatten([to_jax(o) for o in outs])


def allreduce_async(tensor: Any, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an allreduce of an array or pytree; returns a handle for ``synchronize``."""
    resolved = _api.resolve_op(op, average)
    flat = flatten(tensor)
    family = _sp.ALLREDUCE if flat.single else _sp.GROUPED_ALLREDUCE
    return _start("allreduce", family, False, tensor, None, "<name>", resolved,
                  prescale_factor, postscale_factor, "<set>", name=name,
                  process_set=process_set)


def grouped_allreduce_async(tensors: Any, average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start a grouped allreduce of a list (or pytree) of arrays."""
    resolved = _api.resolve_op(op, average)
    return _start("allreduce", _sp.GROUPED_ALLREDUCE, True, tensors, None, "<name>", resolved,
                  prescale_factor, postscale_factor, "<set>", name=name,
                  process_set=process_set)


def allgather_async(tensor: Any, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an allgather of an array or pytree."""
    family = _sp.ALLGATHER if flatten(tensor).single else _sp.GROUPED_ALLGATHER
    return _start("allgather", family, False, tensor, "<name>", "<set>", name=name,
                  process_set=process_set)


def grouped_allgather_async(tensors: Any, name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start a grouped allgather of a list (or pytree) of arrays."""
    return _start("allgather", _sp.GROUPED_ALLGATHER, True, tensors, "<name>", "<set>",
                  name=name, process_set=process_set)


def broadcast_async(tensor: Any, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start a broadcast of one array from ``root_rank``."""
    if not flatten(tensor).single:
        raise ValueError("hora.jax.broadcast_async takes one array; use hvd.broadcast for a "
                         "pytree.")
    return _start("broadcast", _sp.BROADCAST, False, tensor, root_rank, "<name>", "<set>",
                  name=name, process_set=process_set)


def alltoall_async(tensor: Any, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start an alltoall of one array; ``synchronize`` gives ``(received, received_splits)``."""
    flat = flatten(tensor)
    eager_only("alltoall_async", flat.leaves)
    if not flat.single:
        raise ValueError("hora.jax.alltoall_async takes one array, not a pytree.")
    handle, _ = _sp.ALLTOALL.submit(HOST, False, False, to_host(flat.leaves[0]), splits, name,
                                    process_set)
    return _sp.register(handle, lambda r: (to_jax(r[0]), to_jax(r[1].astype(np.int32))))


def reducescatter_async(tensor: Any, name: str | None = None,
                        op: int | None = ReduceOp.Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start a reducescatter of an array or pytree."""
    family = _sp.REDUCESCATTER if flatten(tensor).single else _sp.GROUPED_REDUCESCATTER
    return _start("reducescatter", family, False, tensor, "<name>", op, "<set>",
                  prescale_factor, postscale_factor, name=name, process_set=process_set)


def grouped_reducescatter_async(tensors: Any, name: str | None = None,
                                op: int | None = ReduceOp.Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start a grouped reducescatter of a list (or pytree) of arrays."""
    return _start("reducescatter", _sp.GROUPED_REDUCESCATTER, True, tensors, "<name>", op,
                  "<set>", prescale_factor, postscale_factor, name=name,
                  process_set=process_set)


__all__ = ["allgather_async", "allreduce_async", "alltoall_async", "broadcast_async",
           "grouped_allgather_async", "grouped_allreduce_async", "grouped_reducescatter_async",
           "reducescatter_async"]
