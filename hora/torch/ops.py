"""Torch tensors <-> the core's numpy buffers (:data:`TORCH`, the adapter's bridge), and
Horovod's non-differentiable forms of every collective, compiled by
:func:`hora.core.frontend.op_forms.spell` from the core's one definition of each op.

The bridge checks a tensor's dtype against Horovod's per-op tables, hands the core a numpy view
of the tensor's memory (zero-copy on the CPU; bfloat16 is reinterpreted through int16; CUDA
tensors are staged through host memory) and turns results back into tensors (in-place results
bump autograd's version counter). On the torch data plane the core gets the tensors themselves,
on their device (:mod:`hora.torch.buffers`): no host copy, CUDA tensors go through NCCL. All
collective logic (naming, negotiation, averaging, validation across ranks, handles) is the
core's.

Contract shared by every op here (Horovod's): every member of the process set must call the op
with the same ``name`` (unnamed ops match by call order), the same dtype, and the shape rules of
the op; mismatches fail the handle on every rank with ``HorovodInternalError`` at
``synchronize``; argument errors raise ``ValueError`` at call time.

CUDA tensors: on hora's builtin data plane a CUDA tensor is copied to host memory, reduced
there and copied back (two device<->host copies per op); on the torch data plane
(``HORA_DATA_PLANE=torch``) it stays on the GPU and NCCL reduces it (see docs/torch.md). Nothing
requires a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hora.collectives.ops import BFLOAT16
from hora.core.frontend import api as _api
from hora.core.frontend import grouped as _grouped
from hora.core.frontend import op_forms as _sp
from hora.core.frontend.api import synchronize as synchronize  # re-exported: ops.synchronize
from hora.core.op import device as _device
from hora.core.op.device import DeviceBuffer
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.torch import buffers as _buffers

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


class _TorchBridge:
    """torch tensors <-> the core's host buffers, for :mod:`hora.core.frontend.op_forms`."""

    passthrough = False

    def host(self, tensor: Any, table: str) -> _sp.TensorView:
        t = check_tensor(tensor, REDUCE_DTYPES if table == _sp.REDUCE else MOVE_DTYPES)
        if _device.native("torch"):  # the torch data plane: the tensor itself, on its device
            return _sp.TensorView(_buffers.wrap(t), device_kind(t), t)
        return _sp.TensorView(host_array(t), device_kind(t), t)

    def hosts(self, tensors: Sequence[Any], table: str) -> tuple[list[_sp.TensorView], str]:
        allowed = REDUCE_DTYPES if table == _sp.REDUCE else MOVE_DTYPES
        checked = [check_tensor(t, allowed) for t in tensors]
        if not checked:
            return [], "cpu"
        device = checked[0].device
        if any(t.device != device for t in checked):
            raise ValueError("Tensors in list must be on same device.")
        if _device.native("torch"):
            return ([_sp.TensorView(_buffers.wrap(t), device_kind(t), t) for t in checked],
                    device.type)
        return [_sp.TensorView(host_array(t), device_kind(t), t) for t in checked], device.type

    def result(self, like: _sp.TensorView, out: Any) -> torch.Tensor:
        if isinstance(out, DeviceBuffer):  # made on the tensor's device by the core
            result: torch.Tensor = out.native
            return result
        return to_tensor(out, like.tensor.device)

    def written(self, host: _sp.TensorView, out: Any) -> torch.Tensor:
        tensor: torch.Tensor = host.tensor
        if type(host.array) is np.ndarray and tensor.is_cpu:  # reduced in its own memory
            if _increment_version is not None:  # autograd sees the in-place change
                _increment_version(tensor)
            return tensor
        with torch.no_grad():
            if isinstance(host.array, DeviceBuffer):  # reduced where it lives
                if host.array.native.data_ptr() != tensor.data_ptr():  # a contiguous copy
                    tensor.copy_(host.array.native.view(tensor.shape))
            elif tensor.device.type != "cpu":  # the result is in the staging copy: copy it back
                tensor.copy_(to_tensor(host.array, torch.device("cpu")))
                return tensor
            if _increment_version is not None:  # autograd sees the in-place change
                _increment_version(tensor)
        return tensor

    def splits(self, splits: Any) -> list[int] | None:
        if splits is None:
            return None
        if isinstance(splits, torch.Tensor):
            if splits.dim() != 1:
                raise ValueError("splits must be a 1-D tensor")
            if splits.dtype is not torch.int32:
                raise ValueError(f"splits must be an int32 tensor, not {splits.dtype}")
            return [int(s) for s in splits.tolist()]
        return [int(s) for s in splits]

    def received_splits(self, splits: Any, received: np.ndarray) -> torch.Tensor:
        device = splits.device if isinstance(splits, torch.Tensor) else torch.device("cpu")
        return to_tensor(received, device)

    # the tensor math of the gradient rules (hora.core.frontend.gradients)
    def rows(self, tensor: torch.Tensor, start: int, count: int) -> torch.Tensor:
        return tensor.narrow(0, start, count)

    def zeros_like(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(tensor)

    def pad_rows(self, tensor: torch.Tensor, rows: int) -> torch.Tensor:
        if tensor.shape[0] >= rows:
            return tensor
        pad = tensor.new_zeros((rows - tensor.shape[0],) + tuple(tensor.shape[1:]))
        return torch.cat([tensor, pad])

    def scaled(self, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        return tensor * factor


TORCH = _TorchBridge()
"""The torch bridge: every collective of this adapter goes through it."""

def _spell(family: _sp.OpForm, public: str, inplace: bool, wait: bool) -> Any:
    return _sp.spell(TORCH, family, public, inplace=inplace, wait=wait, module=__name__)


# Horovod's non-differentiable forms (the differentiable x are in hora.torch.autograd).
allreduce_ = _spell(_sp.ALLREDUCE, "allreduce_", True, True)
allreduce_async = _spell(_sp.ALLREDUCE, "allreduce_async", False, False)
allreduce_async_ = _spell(_sp.ALLREDUCE, "allreduce_async_", True, False)
grouped_allreduce_ = _spell(_sp.GROUPED_ALLREDUCE, "grouped_allreduce_", True, True)
grouped_allreduce_async = _spell(_sp.GROUPED_ALLREDUCE, "grouped_allreduce_async", False, False)
grouped_allreduce_async_ = _spell(_sp.GROUPED_ALLREDUCE, "grouped_allreduce_async_", True,
                                  False)
allgather_async = _spell(_sp.ALLGATHER, "allgather_async", False, False)
grouped_allgather_async = _spell(_sp.GROUPED_ALLGATHER, "grouped_allgather_async", False, False)
broadcast_ = _spell(_sp.BROADCAST, "broadcast_", True, True)
broadcast_async = _spell(_sp.BROADCAST, "broadcast_async", False, False)
broadcast_async_ = _spell(_sp.BROADCAST, "broadcast_async_", True, False)
alltoall_async = _spell(_sp.ALLTOALL, "alltoall_async", False, False)
reducescatter_async = _spell(_sp.REDUCESCATTER, "reducescatter_async", False, False)
grouped_reducescatter_async = _spell(_sp.GROUPED_REDUCESCATTER, "grouped_reducescatter_async",
                                     False, False)
reducescatter_op = _api.reducescatter_op


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
    h = _grouped.sparse_allreduce_async(host_array(values), host_array(indices), name=name,
                                        op=_api.resolve_op(op, None), process_set=process_set,
                                        device=device_kind(tensor))
    device, shape = tensor.device, tensor.size()

    def wait() -> torch.Tensor:
        gathered_values, gathered_indices = h.wait()
        v, i = to_tensor(gathered_values, device), to_tensor(gathered_indices, device)
        return torch.sparse_coo_tensor(i.transpose(0, 1), v, shape, check_invariants=False)

    return wait


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
