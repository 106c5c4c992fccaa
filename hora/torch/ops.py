"""Torch tensors <-> the core's numpy buffers, and every asynchronous collective on tensors.

This is the thin half of the adapter: it checks a tensor's dtype against Horovod's per-op
tables, hands the core a numpy view of the tensor's memory (zero-copy on the CPU; bfloat16 is
reinterpreted through int16; CUDA tensors are staged through host memory), calls
:mod:`hora.core.api`, and registers a :class:`~hora.core.handle.DerivedHandle` in the shared
integer handle table whose result is the torch tensor. All collective logic (naming,
negotiation, averaging, validation across ranks) is the core's.

Contract shared by every op here (Horovod's): every member of the process set must call the op
with the same ``name`` (unnamed ops match by call order), the same dtype, and the shape rules of
the op; mismatches fail the handle on every rank with ``HorovodInternalError`` at
``synchronize``; argument errors raise ``ValueError`` at call time.

CUDA tensors: hora has no GPU data path; a CUDA tensor is copied to host memory, reduced there
and copied back (two device<->host copies per op; see docs/torch.md). Nothing requires a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hora.collectives.ops import BFLOAT16, ReduceOp
from hora.core import api as _api
from hora.core import context as _context
from hora.core.api import synchronize
from hora.core.handle import DerivedHandle, Handle
from hora.core.process_set import ProcessSet, global_process_set
from hora.errors import HorovodInternalError

# Horovod's torch binding registers kernels for these dtypes (spec §2.1); hora adds bfloat16.
REDUCE_DTYPES = frozenset({torch.int32, torch.int64, torch.float16, torch.bfloat16,
                           torch.float32, torch.float64})
"""Dtypes accepted by allreduce, grouped_allreduce, reducescatter and their variants."""
MOVE_DTYPES = REDUCE_DTYPES | {torch.uint8, torch.int8, torch.int16}
"""Dtypes accepted by allgather, broadcast and alltoall."""


# Lets autograd notice that an in-place op changed a tensor saved for backward (torch >= 2.1).
_increment_version = getattr(torch.autograd.graph, "increment_version", None)


# ---- tensor <-> buffer -----------------------------------------------------------------------
def check_tensor(tensor: Any, allowed: frozenset[torch.dtype]) -> torch.Tensor:
    """Return ``tensor`` if it is a dense tensor of an allowed dtype.

    Raises:
        ValueError: ``'Tensor type <type> is not supported.'`` (Horovod's text).
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"Tensor type {type(tensor).__name__} is not supported: expected a "
                         "torch.Tensor.")
    if tensor.layout is not torch.strided or tensor.dtype not in allowed:
        raise ValueError(f"Tensor type {tensor.type()} is not supported.")
    return tensor


def device_kind(tensor: torch.Tensor) -> str:
    """The device kind the core compares across ranks (``'cpu'``, ``'cuda'``): Horovod only
    requires every rank to agree on CPU vs GPU, not on the GPU index."""
    return tensor.device.type


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array over the tensor's values: a view of its memory for CPU tensors (the core
    may write into it), a fresh host copy for tensors on other devices."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype is torch.bfloat16:
        assert BFLOAT16 is not None, "bfloat16 needs ml_dtypes"
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def to_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A tensor over ``array`` (zero-copy on the CPU), moved to ``device`` if it is not the CPU."""
    if BFLOAT16 is not None and array.dtype == BFLOAT16:
        t = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(array)
    return t if device.type == "cpu" else t.to(device)


def _inplace_result(tensor: torch.Tensor, host: np.ndarray) -> Callable[[Any], torch.Tensor]:
    """Conversion for in-place ops: the result already sits in ``tensor``'s memory (CPU) or in
    the staging copy ``host`` (other devices); bump the autograd version counter either way."""

    def convert(_result: Any) -> torch.Tensor:
        with torch.no_grad():
            if tensor.device.type != "cpu":
                tensor.copy_(to_tensor(host, torch.device("cpu")))
            elif _increment_version is not None:
                _increment_version(tensor)
        return tensor

    return convert


def _same_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    if not tensors:
        return torch.device("cpu")
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError("Tensors in list must be on same device.")
    return device


def register(core_handle: Handle, convert: Callable[[Any], Any]) -> int:
    """Put ``core_handle`` in the shared table; ``synchronize`` returns ``convert(result)``."""
    return int(_context.get("handles").handles.add(DerivedHandle(core_handle, convert)))


# ---- handles -----------------------------------------------------------------------------------
# ---- allreduce ---------------------------------------------------------------------------------
def _allreduce(tensor: torch.Tensor, inplace: bool, name: str | None, op: ReduceOp,
               prescale_factor: float, postscale_factor: float,
               process_set: ProcessSet, sync: bool = False) -> int:
    check_tensor(tensor, REDUCE_DTYPES)
    host = host_array(tensor)
    h = _api.allreduce_async(host, name=name, op=op, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, process_set=process_set,
                             inplace=inplace, device=device_kind(tensor), sync=sync)
    if inplace:
        return register(h, _inplace_result(tensor, host))
    return register(h, lambda out: to_tensor(out, tensor.device))


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start ``postscale * op(prescale * tensor_i)`` over the set (default op Average); the input
    is not modified. Returns a handle; ``synchronize`` gives a new tensor of the same shape and
    dtype. ``average`` is deprecated (True: Average, False: Sum)."""
    return _allreduce(tensor, False, name, _api.resolve_op(op, average), prescale_factor,
                      postscale_factor, process_set)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None,
                     name: str | None = None, op: int | None = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place :func:`allreduce_async`: the result is written into ``tensor``."""
    return _allreduce(tensor, True, name, _api.resolve_op(op, average), prescale_factor,
                      postscale_factor, process_set)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: int | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place allreduce (not differentiable); returns ``tensor``."""
    return synchronize(_allreduce(tensor, True, name, _api.resolve_op(op, average),
                                  prescale_factor, postscale_factor, process_set, sync=True))


def _grouped_allreduce(tensors: Sequence[torch.Tensor], inplace: bool, name: str | None,
                       op: ReduceOp, prescale_factor: float, postscale_factor: float,
                       process_set: ProcessSet) -> int:
    tensors = list(tensors)
    for t in tensors:
        check_tensor(t, REDUCE_DTYPES)
    device = _same_device(tensors)
    hosts = [host_array(t) for t in tensors]
    h = _api.grouped_allreduce_async(hosts, name=name, op=op, prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor,
                                     process_set=process_set, inplace=inplace,
                                     device=device.type)
    if inplace:
        converts = [_inplace_result(t, a) for t, a in zip(tensors, hosts)]
        return register(h, lambda outs: [c(o) for c, o in zip(converts, outs)])
    return register(h, lambda outs: [to_tensor(o, device) for o in outs])


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: int | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Allreduce a list of tensors as one group (names ``<name>_<i>of<n>``); ``synchronize``
    gives the list of results. All tensors must be on the same device."""
    return _grouped_allreduce(tensors, False, name, _api.resolve_op(op, average),
                              prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: int | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """In-place :func:`grouped_allreduce_async`."""
    return _grouped_allreduce(tensors, True, name, _api.resolve_op(op, average),
                              prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: int | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place grouped allreduce (not differentiable); returns the list of input tensors."""
    return list(synchronize(_grouped_allreduce(tensors, True, name,
                                               _api.resolve_op(op, average), prescale_factor,
                                               postscale_factor, process_set)))


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int | None,
                           process_set: ProcessSet = global_process_set
                           ) -> Callable[[], torch.Tensor]:
    """Horovod's sparse allreduce: allgather the COO values and indices of ``tensor``
    (``<name>.values`` / ``<name>.indices``). Returns a **callable** that waits and builds the
    sparse sum (values divided by the set size for Average; duplicates not coalesced).
    ``synchronize`` cannot be used with it."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async needs a sparse COO tensor")
    values = check_tensor(tensor._values(), MOVE_DTYPES)
    indices = tensor._indices().transpose(0, 1).contiguous()
    h = _api.sparse_allreduce_async(host_array(values), host_array(indices), name=name,
                                    op=_api.resolve_op(op, None), process_set=process_set,
                                    device=device_kind(tensor))
    device, shape = tensor.device, tensor.size()

    def wait() -> torch.Tensor:
        gathered_values, gathered_indices = h.wait()
        v, i = to_tensor(gathered_values, device), to_tensor(gathered_indices, device)
        return torch.sparse_coo_tensor(i.transpose(0, 1), v, shape, check_invariants=False)

    return wait


# ---- allgather, broadcast, alltoall, reducescatter ---------------------------------------------
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every member's tensor along dimension 0 (in set rank order; first
    dimensions may differ, the others must agree). The input is not modified."""
    check_tensor(tensor, MOVE_DTYPES)
    h = _api.allgather_async(host_array(tensor), name=name, process_set=process_set,
                             device=device_kind(tensor))
    return register(h, lambda out: to_tensor(out, tensor.device))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Allgather each tensor of a list; ``synchronize`` gives the list of results."""
    tensors = list(tensors)
    for t in tensors:
        check_tensor(t, MOVE_DTYPES)
    device = _same_device(tensors)
    h = _api.grouped_allgather_async([host_array(t) for t in tensors], name=name,
                                     process_set=process_set, device=device.type)
    return register(h, lambda outs: [to_tensor(o, device) for o in outs])


def _broadcast(tensor: torch.Tensor, root_rank: int, name: str | None, inplace: bool,
               process_set: ProcessSet) -> int:
    check_tensor(tensor, MOVE_DTYPES)
    host = host_array(tensor)
    h = _api.broadcast_async(host, root_rank, name=name, process_set=process_set,
                             inplace=inplace, device=device_kind(tensor))
    if inplace:
        return register(h, _inplace_result(tensor, host))
    return register(h, lambda out: to_tensor(out, tensor.device))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start copying ``root_rank``'s tensor (a global rank in the set) to every member; the
    input is not modified. Shape, dtype and root must agree on every rank."""
    return _broadcast(tensor, root_rank, name, False, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place :func:`broadcast_async`: the root's values are written into ``tensor``."""
    return _broadcast(tensor, root_rank, name, True, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place broadcast (not differentiable); returns ``tensor``."""
    return synchronize(_broadcast(tensor, root_rank, name, True, process_set))


def _split_list(splits: Any) -> list[int] | None:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 1:
            raise ValueError("splits must be a 1-D tensor")
        if splits.dtype is not torch.int32:
            raise ValueError(f"splits must be an int32 tensor, not {splits.dtype}")
        return [int(s) for s in splits.tolist()]
    return [int(s) for s in splits]


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start sending ``splits[j]`` rows of dimension 0 to set member ``j`` (even split when
    ``splits`` is None). ``splits``: a 1-D int32 tensor or a list. ``synchronize`` gives
    ``(received, received_splits)``; ``received_splits`` is int32 on the splits' device."""
    check_tensor(tensor, MOVE_DTYPES)
    split_list = _split_list(splits)
    h = _api.alltoall_async(host_array(tensor), split_list, name=name, process_set=process_set,
                            device=device_kind(tensor))
    splits_device = splits.device if isinstance(splits, torch.Tensor) else torch.device("cpu")

    def convert(result: tuple[np.ndarray, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        out, received = result
        return to_tensor(out, tensor.device), to_tensor(received, splits_device)

    return register(h, convert)


def reducescatter_op(op: int | None) -> ReduceOp:
    """Resolve a reducescatter ``op``; Horovod raises HorovodInternalError for other ops."""
    resolved = _api.resolve_op(op, None)
    if resolved not in (ReduceOp.Sum, ReduceOp.Average):
        raise HorovodInternalError("Reducescatter currently only supports AVERAGE and SUM.")
    return resolved


def reducescatter_async(tensor: torch.Tensor, name: str | None = None,
                        op: int | None = ReduceOp.Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start reducing (Sum or Average) across the set, then keep this rank's share of dimension
    0 (the first ``dim0 % size`` members get one extra row). Shapes must agree on all ranks.

    Raises:
        HorovodInternalError: an op other than Sum/Average (Horovod's error type).
        ValueError: a 0-d tensor.
    """
    check_tensor(tensor, REDUCE_DTYPES)
    h = _api.reducescatter_async(host_array(tensor), name=name, op=reducescatter_op(op),
                                 prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, process_set=process_set,
                                 device=device_kind(tensor))
    return register(h, lambda out: to_tensor(out, tensor.device))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: int | None = ReduceOp.Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Reducescatter each tensor of a list; ``synchronize`` gives the list of shares."""
    tensors = list(tensors)
    for t in tensors:
        check_tensor(t, REDUCE_DTYPES)
    device = _same_device(tensors)
    h = _api.grouped_reducescatter_async(
        [host_array(t) for t in tensors], name=name, op=reducescatter_op(op),
        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        process_set=process_set, device=device.type)
    return register(h, lambda outs: [to_tensor(o, device) for o in outs])


# ---- control ---------------------------------------------------------------------------------
def join(device: int = -1) -> int:
    """This rank has no more data: until every rank has joined, it contributes zeros to the
    others' allreduces (Average keeps the full divisor; other collectives fail meanwhile).
    Blocks until all ranks joined; returns the last rank to join. ``device`` is accepted for
    Horovod compatibility (zeros are produced in host memory)."""
    return _api.join(global_process_set)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every member of the set has called ``barrier``."""
    _api.barrier(process_set)
