"""``SyncBatchNorm``: batch normalization with statistics over the whole (all-rank) batch.

Training forward: every rank computes its per-channel count, mean and biased variance, one
allgather (``sync_batch_norm.stats``) brings all of them to every rank, and each rank combines
them into the global mean and variance (and updates the running statistics with them, using
the unbiased variance). Backward: the per-channel sums of ``dy`` and ``dy * (x - mean)`` are
Sum-allreduced (``sync_batch_norm.grads``) so the input gradient is the full-batch one; weight
and bias gradients stay local (the DistributedOptimizer averages them). Eval mode with running
statistics, or a process set of one rank, is an ordinary local batch norm.

Unlike Horovod, CPU input is accepted (Horovod required CUDA because it used CUDA-only kernels;
this module uses plain tensor ops on any device), and a ``process_set`` may be given.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from hora.collectives.ops import ReduceOp
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.torch import ops


def _channel_view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.view([1, -1] + [1] * (ndim - 2))


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """Statistics in float32 at least (float64 input stays float64)."""
    return t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, eps: float, momentum: float,
                process_set: ProcessSet) -> torch.Tensor:
        cdt = _compute_dtype(x)
        xf = x.detach().to(cdt)
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        count = xf.numel() // max(channels, 1)
        if count > 0:
            mean, var = xf.mean(dims), xf.var(dims, unbiased=False)
        else:
            mean, var = xf.new_zeros(channels), xf.new_zeros(channels)
        local = torch.cat([xf.new_tensor([float(count)]), mean, var]).unsqueeze(0)
        stats = ops.synchronize(ops.allgather_async(local, "sync_batch_norm.stats", process_set))
        counts = stats[:, :1]
        total = counts.sum()
        if total <= 1 and running_mean is not None:
            raise ValueError(f"Expected more than 1 value per channel when training, got input "
                             f"size {list(x.shape)} on every rank")
        means, variances = stats[:, 1:1 + channels], stats[:, 1 + channels:]
        g_mean = (counts * means).sum(0) / total
        g_var = (counts * (variances + (means - g_mean) ** 2)).sum(0) / total
        invstd = torch.rsqrt(g_var + eps)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                unbiased = g_var * (total / (total - 1))
                running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype),
                                                     alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype),
                                                    alpha=momentum)
        xhat = (xf - _channel_view(g_mean, x.dim())) * _channel_view(invstd, x.dim())
        out = xhat
        if weight is not None:
            out = out * _channel_view(weight.detach().to(cdt), x.dim())
        if bias is not None:
            out = out + _channel_view(bias.detach().to(cdt), x.dim())
        ctx.save_for_backward(x, weight, g_mean, invstd)
        ctx.total, ctx.process_set = float(total), process_set
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        n = x.dim()
        dims = [0] + list(range(2, n))
        cdt = _compute_dtype(x)
        dy, xmu = grad.to(cdt), x.to(cdt) - _channel_view(mean, n)
        sum_dy, sum_dy_xmu = dy.sum(dims), (dy * xmu).sum(dims)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            both = ops.synchronize(ops.allreduce_async(
                torch.cat([sum_dy, sum_dy_xmu]), None, "sync_batch_norm.grads", ReduceOp.Sum,
                1.0, 1.0, ctx.process_set))
            g_sum_dy, g_sum_dy_xmu = both.chunk(2)
            scale = invstd if weight is None else invstd * weight.to(cdt)
            grad_x = ((dy - _channel_view(g_sum_dy / ctx.total, n)
                       - xmu * _channel_view(invstd ** 2 * g_sum_dy_xmu / ctx.total, n))
                      * _channel_view(scale, n)).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = (sum_dy_xmu * invstd).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = sum_dy.to(grad.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the batch of every rank (Horovod's ``hvd.SyncBatchNorm``).

    Same arguments as ``torch.nn.BatchNorm*d``; input of any dimension >= 2 (N, C, ...).
    Collective in training mode: every member of ``process_set`` must run forward (and
    backward) together.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or (self.process_set.size() or 1) == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, use_batch_stats, factor, self.eps)
        running = self.training and self.track_running_stats
        return _SyncBatchNormFn.apply(input, self.weight, self.bias,
                                      self.running_mean if running else None,
                                      self.running_var if running else None, self.eps, factor,
                                      self.process_set)
