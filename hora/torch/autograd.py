"""The synchronous, differentiable collectives: ``torch.autograd.Function`` wrappers.

Horovod makes ``allreduce``, ``grouped_allreduce``, ``allgather``, ``grouped_allgather``,
``broadcast``, ``alltoall``, ``reducescatter`` and ``grouped_reducescatter`` differentiable, with
these backward rules (kept exactly, including the two that are not the mathematical gradient):

========================  ===================================================================
forward                   backward of ``grad``
========================  ===================================================================
allreduce(op, pre, post)  allreduce(grad) with the same op, factors and set (Min/Max/Product
                          re-apply the op: Horovod's rule, not the true derivative)
allgather                 Average-allreduce(grad), then this rank's rows
broadcast(root)           Average-allreduce(grad); zeros on every rank but the root
alltoall(splits)          alltoall(grad, splits=received_splits)
reducescatter(op)         grad * set size (Sum only) * pre * post, then allgather (so an
                          Average gets grad, a Sum grad * size: Horovod's rule)
========================  ===================================================================

Grouped forms apply the same rule with grouped ops. Each function accepts any tensor; the ops
run through :mod:`hora.torch.ops` (the collective contract is documented there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hora.collectives.ops import ReduceOp
from hora.core.frontend import api as _api
from hora.core.frontend import gradients as _grads
from hora.core.frontend import op_forms as _sp
from hora.core.op import device as _device
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.torch import ops
from hora.torch.compression import Compression, Compressor


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float,
                post: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.args = (op, pre, post, process_set)
        # waits at once, so the core lets this thread drive the op (fast lane)
        out: torch.Tensor = _sp.run(ops.TORCH, _sp.ALLREDUCE, tensor, None, name, op, pre, post,
                                    process_set)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _grads.allreduce(ops.TORCH, grad, *ctx.args), None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across the set: ``postscale * op(prescale * x_i)`` (default Average;
    integer Average truncates). Returns a new tensor; the input is untouched. Differentiable.

    Raises:
        ValueError: unsupported dtype, not a member of ``process_set``, duplicate name.
        HorovodInternalError: ranks disagree on shape/dtype/op/factors (at completion).
    """
    if average is None and (op is None or type(op) is ReduceOp):
        resolved = ReduceOp.Average if op is None else op
    else:
        resolved = _api.resolve_op(op, average)
    if compression is Compression.none and type(tensor) is torch.Tensor \
            and not tensor.requires_grad and tensor.device.type == "cpu" \
            and tensor.layout is torch.strided and tensor.dtype in ops.REDUCE_DTYPES \
            and tensor.dtype is not torch.bfloat16 and "torch" not in _device.native_frameworks:
        # What a training loop does every step: a CPU tensor no gradient flows through, nothing
        # to compress, hora's own data plane. The same result as the path below, without
        # autograd's Function machinery (a dozen Python calls in torch per op) and the bridge:
        # the core reduces the tensor's memory straight into a new tensor's.
        out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        _api.allreduce_async(tensor.detach().numpy(), name=name, op=resolved,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             process_set=process_set, output=out.numpy(), sync=True).wait()
        return out
    compressed, cctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, name, resolved, prescale_factor, postscale_factor,
                           process_set)
    return compression.decompress(out, cctx)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, pre: float, post: float,
                process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, pre, post, process_set)
        # waits at once: the core lets this thread drive the group (fast lane), as for one op
        return tuple(_sp.run(ops.TORCH, _sp.GROUPED_ALLREDUCE, list(tensors), None, name, op,
                             pre, post, process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        outs = _grads.grouped_allreduce(ops.TORCH, grads, *ctx.args)
        return (None, None, None, None, None, *outs)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None,
                      compression: type[Compressor] = Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce a list of tensors as one group (paired by list position across ranks).
    Returns the list of results. Differentiable."""
    resolved = _api.resolve_op(op, average)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(name, resolved, prescale_factor, postscale_factor,
                                   process_set, *[c for c, _ in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        out = _sp.run(ops.TORCH, _sp.ALLGATHER, tensor, name, process_set)  # (drives, as above)
        ctx.dim0, ctx.process_set = tensor.shape[0], process_set
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _grads.allgather(ops.TORCH, grad, ctx.dim0, ctx.process_set), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every member's tensor along dimension 0 (set rank order; first dimensions
    may differ, the rest and the dtype must agree; 0-d tensors are rejected). Differentiable."""
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = _sp.run(ops.TORCH, _sp.GROUPED_ALLGATHER, list(tensors), name, process_set)
        ctx.dims, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        rows = _grads.grouped_allgather(ops.TORCH, grads, ctx.dims, ctx.process_set)
        return (None, None, *rows)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather each tensor of a list; returns the list of results. Differentiable."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return ops.synchronize(ops.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _grads.broadcast(ops.TORCH, grad, ctx.root_rank, ctx.process_set), None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return ``root_rank``'s tensor (global rank, member of the set) on every member. Shape,
    dtype and root must agree on all ranks. The input is not modified. Differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: ProcessSet) -> Any:
        out, received = ops.synchronize(ops.alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set, ctx.rows = received, process_set, tensor.shape[0]
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
        back = _grads.alltoall(ops.TORCH, grad, ctx.received, ctx.rows, ctx.process_set)
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[j]`` rows (dimension 0) to member ``j``, receive theirs. Returns the
    received tensor when ``splits`` is None (even split), else ``(received, received_splits)``
    (int32, non-differentiable). Differentiable in the received tensor."""
    return _Alltoall.apply(tensor, splits, name, process_set)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp,
                process_set: ProcessSet, pre: float, post: float) -> torch.Tensor:
        ctx.scale = _grads.reducescatter_scale(op, pre, post, process_set)
        ctx.process_set = process_set
        return ops.synchronize(ops.reducescatter_async(tensor, name, op, process_set, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out = _grads.reducescatter(ops.TORCH, grad, ctx.scale, ctx.process_set)
        return out, None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none,
                  op: int | None = ReduceOp.Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce (Sum or Average) across the set and return this rank's share of dimension 0
    (the first ``dim0 % size`` members get one extra row). Differentiable.

    Raises:
        HorovodInternalError: op other than Sum/Average.
        ValueError: 0-d input, unsupported dtype.
    """
    resolved = ops.reducescatter_op(op)
    compressed, cctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, resolved, process_set, prescale_factor,
                               postscale_factor)
    return compression.decompress(out, cctx)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, process_set: ProcessSet, pre: float,
                post: float, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.scale = _grads.reducescatter_scale(op, pre, post, process_set)
        ctx.process_set = process_set
        return tuple(ops.synchronize(ops.grouped_reducescatter_async(
            list(tensors), name, op, process_set, pre, post)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        outs = _grads.grouped_reducescatter(ops.TORCH, grads, ctx.scale, ctx.process_set)
        return (None, None, None, None, None, *outs)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none,
                          op: int | None = ReduceOp.Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatter each tensor of a list; returns the list of shares. Differentiable."""
    resolved = ops.reducescatter_op(op)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(name, resolved, process_set, prescale_factor,
                                       postscale_factor, *[c for c, _ in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]
