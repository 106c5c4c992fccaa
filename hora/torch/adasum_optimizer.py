"""``DistributedOptimizer(op=hvd.Adasum)``: Horovod's Adasum *delta* optimizer.

With Adasum the ranks do not combine gradients: each rank applies its own optimizer step and
the ranks combine the resulting parameter *changes* with Adasum (:mod:`hora.collectives.adasum`),
so the wrapped optimizer's own logic (momentum, Adam's moments) runs on local gradients. Per
trainable parameter ``p``, once its gradient has been accumulated ``backward_passes_per_step``
times (a gradient hook, so communication overlaps the rest of backward):

1. ``start = p``; the wrapped optimizer steps on ``p`` alone (its param groups narrowed to
   ``p`` for the call), so ``p`` becomes ``start + delta``;
2. ``delta = p - start`` is allreduced in place with ``op=Adasum`` (asynchronously);

and ``step()`` waits for every delta and sets ``p = start + adasum(deltas)``. Parameters whose
hook did not fire are stepped in ``step()``. As Horovod's: ``synchronize()`` does nothing,
``skip_synchronize()`` is refused, only the global process set is supported, and the number of
ranks must be a power of two.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hora.collectives.ops import ReduceOp
from hora.core.frontend import distopt
from hora.torch import ops
from hora.torch.compression import Compressor
from hora.torch.wrapping import init_wrapped

_ZERO_GRAD_PENDING = ("optimizer.zero_grad() was called after loss.backward() but before "
                      "optimizer.step(). This is prohibited as it can cause a race condition.")


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    """Methods mixed into the runtime subclass of the wrapped optimizer's class (Adasum)."""

    _hora_distributed = True
    _hora_base: Any = torch.optim.Optimizer

    def __init__(self, params: Any, named_parameters: Iterable[Any] | None,
                 compression: type[Compressor], backward_passes_per_step: int,
                 base_kwargs: dict[str, Any], state: dict[Any, Any]) -> None:
        init_wrapped(self, params, base_kwargs, state)
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = ReduceOp.Adasum
        all_params = [p for group in self.param_groups for p in group["params"]]
        self._parameter_names: dict[torch.Tensor, str] = distopt.parameter_names(
            [group["params"] for group in self.param_groups], named_parameters)
        self._allreduce_delay = {p: backward_passes_per_step for p in all_params}
        self._starts = {p: torch.zeros_like(p, requires_grad=False) for p in all_params}
        self._handles: dict[torch.Tensor, tuple[Any, Any]] = {}
        self._requires_update = [p for p in all_params if p.requires_grad]
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook(p))
                              for p in self._requires_update]

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _make_hook(self, p: torch.Tensor) -> Any:
        def hook(_param: torch.Tensor) -> None:
            if self._allreduce_delay[p] <= 0:
                raise AssertionError("Gradients were computed more than backward_passes_per_step "
                                     "times before call to step(). Increase "
                                     "backward_passes_per_step to accumulate gradients locally.")
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                self._handles[p] = self._step_and_reduce(p)

        return hook

    def _step_and_reduce(self, p: torch.Tensor) -> tuple[Any, Any]:
        """Step the wrapped optimizer on ``p`` alone, then start the Adasum of its delta."""
        start = self._starts[p]
        start.copy_(p.detach())
        stashed = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [p] if any(q is p for q in group["params"]) else []
            with torch.no_grad():
                self._hora_base.step(self)
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        with torch.no_grad():
            p.sub_(start)  # p holds the delta until step() puts start + adasum(delta) back
        compressed, ctx = self._compression.compress(p.data)
        return ops.allreduce_async_(compressed, name=f"adasum.{self._parameter_names[p]}",
                                    op=ReduceOp.Adasum), ctx

    def synchronize(self) -> None:
        """Nothing to do: with Adasum, ``step()`` combines the parameter deltas."""

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError("Skipping synchronization is not supported when using Adasum "
                             "optimizer.")
        yield  # pragma: no cover

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for p in self._requires_update:
            if p not in self._handles:  # its hook did not fire (yet): step it now
                self._handles[p] = self._step_and_reduce(p)
        for p, (handle, ctx) in self._handles.items():
            delta = self._compression.decompress(ops.synchronize(handle), ctx)
            with torch.no_grad():
                p.copy_(self._starts[p] + delta.to(p.dtype))
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError(_ZERO_GRAD_PENDING)
        self._hora_base.zero_grad(self, set_to_none=set_to_none)


__all__: list[str] = []
