"""``DistributedOptimizer``: average gradients across ranks while backward is still running.

As in Horovod, :func:`DistributedOptimizer` builds a class at runtime that inherits from the
wrapped optimizer's class (so ``isinstance(opt, torch.optim.SGD)`` holds and
``type(opt).__name__ == 'SGD'``) and shares its param-group dicts. Each trainable parameter gets
a ``register_post_accumulate_grad_hook``: the moment its gradient is accumulated, an in-place
async allreduce of it starts, so communication overlaps the rest of backward. ``step()`` waits
for them (``synchronize()``) and then runs the wrapped optimizer's step.

Overlap needs a core to communicate on: hora moves a CPU gradient's bytes with this process's
threads, which hold the GIL for their Python and take the core backward computes on. When this
rank has no core beyond torch's compute threads (:func:`overlaps`), the hooks only note that a
gradient is ready and ``synchronize()`` starts every allreduce at once and runs them on the
calling thread (fused where the engine fuses): the same ops, names and results, without
backward and the communication taking turns on one core. Except for large gradients
(:data:`INLINE_BYTES` and up): their hook starts the allreduce and runs it on the backward
thread at once, while backward's freshly written gradient is still partly in cache (and the
ones reduced last, the first layers', are the ones the optimizer reads first); the ranks reach
those hooks together (data parallel: the same graph). The hook waits at most
:data:`INLINE_WAIT_S`: a peer that reaches it later, or runs its hooks in another order, only
leaves the op pending for ``synchronize()``, as in overlap mode (no rank blocks on an op its
peers have not started). The ``torch_overlap`` knob
(``HORA_TORCH_OVERLAP=auto|on|off``) forces either mode. Gradients on a GPU (any device but the
CPU) always overlap: their backward runs on the device.

The rules that are not torch-specific (argument checks, names, groups, predivide factors) are in
:mod:`hora.core.frontend.distopt`; the collectives are :mod:`hora.torch.ops`.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

import hora
from hora._util.cpus import cores_per_rank
from hora._util.log import get_logger
from hora.collectives.ops import ReduceOp
from hora.core.engine import context as _context
from hora.core.frontend import distopt
from hora.core.frontend import objects as _objects
from hora.core.frontend import op_forms as _sp
from hora.core.op.handle import BLOCKED_AFTER_S
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.torch import ops
from hora.torch.compression import Compression, Compressor
from hora.torch.wrapping import init_wrapped

log = get_logger(__name__)

_ZERO_GRAD_PENDING = ("optimizer.zero_grad() was called after loss.backward() but before "
                      "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                      "cause a race condition.")
_TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate gradients "
                    "locally.")
_STEP_AFTER_SYNC = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.")


_SPARSE = object()  # the compression context of a sparse gradient's allreduce (none)

INLINE_BYTES = 1 << 20
"""Without overlap (module docstring), a dense ungrouped CPU gradient of at least this many bytes
is allreduced in its hook, on the backward thread; smaller ones wait for ``synchronize()``,
where they are fused (the signal rounds of one op per small gradient would cost more than
their bytes). Decided from the gradient's size, so every rank decides alike."""

INLINE_WAIT_S = min(0.02, BLOCKED_AFTER_S / 2)
"""How long a hook waits for its inline allreduce (a peer a little behind, or preempted for a
scheduler tick, still finds it running); past it the op is left to ``synchronize()``. Below
the engine's blocked-wait report, so a hook's wait never counts towards deadlock detection."""

OVERLAP: bool | None = None
"""Forces :func:`overlaps` (True or False) in this process, over the ``HORA_TORCH_OVERLAP`` knob
(tests running ranks in both modes in one job); None: the knob decides."""


def overlaps(local_size: int, mode: str = "auto") -> bool:
    """Whether the hooks of CPU gradients start their allreduces during backward: ``mode`` is
    the ``torch_overlap`` knob ('on', 'off', or 'auto': when a rank of ``local_size`` ranks on
    its host has a core to communicate on while backward computes with
    ``torch.get_num_threads()`` threads). :data:`OVERLAP` overrides it."""
    if OVERLAP is not None:
        return OVERLAP
    if mode != "auto":
        return mode == "on"
    return cores_per_rank(local_size) >= torch.get_num_threads() + 1


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into the runtime subclass of the wrapped optimizer's class."""

    _hora_distributed = True
    _hora_base: Any = torch.optim.Optimizer

    def __init__(self, params: Any, named_parameters: Iterable[Any] | None,
                 compression: type[Compressor], backward_passes_per_step: int, op: int,
                 gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool,
                 process_set: ProcessSet, base_kwargs: dict[str, Any],
                 state: dict[Any, Any]) -> None:
        init_wrapped(self, params, base_kwargs, state)
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = ReduceOp(op)
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set

        all_params = [p for group in self.param_groups for p in group["params"]]
        self._parameter_names: dict[torch.Tensor, str] = distopt.parameter_names(
            [group["params"] for group in self.param_groups], named_parameters)
        self._allreduce_delay: dict[torch.Tensor, int] = {
            p: backward_passes_per_step for p in all_params}
        self._handles: dict[Any, tuple[Any, Any]] = {}
        self._requires_update: dict[torch.Tensor, None] = {}
        self._hook_handles: list[Any] = []
        self._synchronized = False
        self._should_synchronize = True
        self._p_to_group: dict[torch.Tensor, tuple[torch.Tensor, ...]] = {}
        self._group_counts: dict[tuple[torch.Tensor, ...], int] = {}
        self._in_set = bool(process_set.included())
        ctx = _context.get("DistributedOptimizer")
        elastic = ctx.config.elastic
        self._overlap = overlaps(ctx.local_size, ctx.config.torch_overlap)  # module docstring
        if self._in_set and (hora.size() > 1 or elastic):
            self._register_hooks(groups)

    # ---- hooks ---------------------------------------------------------------------------------
    def _register_hooks(self, groups: Any) -> None:
        trainable = [p for group in self.param_groups for p in group["params"]
                     if p.requires_grad]
        if groups is not None:
            self._make_groups(trainable, groups)
        for p in trainable:
            self._requires_update[p] = None
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))
        log.debug("DistributedOptimizer(%s): gradient hooks on %d parameters, %d groups, op %s",
                  self._hora_base.__name__, len(trainable), len(self._group_counts),
                  self.op.name)

    def _make_groups(self, trainable: list[torch.Tensor], groups: Any) -> None:
        if isinstance(groups, int):
            # Every rank must form the same groups: order parameters as the first member does.
            names = _objects.broadcast_object([self._parameter_names[p] for p in trainable],
                                          self.process_set.ranks[0],
                                          name="DistributedOptimizer.groups",
                                          process_set=self.process_set)
            order = {n: i for i, n in enumerate(names)}
            trainable = sorted(trainable, key=lambda p: order.get(self._parameter_names[p],
                                                                  len(order)))
            parts = distopt.split_list(trainable, groups)
        else:
            wanted = set(trainable)
            parts = [[p for p in part if p in wanted] for part in groups]
        for part in parts:
            if part:
                group = tuple(part)
                for p in group:
                    self._p_to_group[p] = group
                self._group_counts[group] = 0

    def _make_hook(self, p: torch.Tensor) -> Any:
        def hook(_param: torch.Tensor) -> None:
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(_TOO_MANY_PASSES)
            assert p.grad is None or not p.grad.requires_grad, (
                "DistributedOptimizer cannot allreduce gradients that require grad "
                "(backward(create_graph=True)).")
            self._allreduce_delay[p] -= 1
            launched: tuple[Any, Any] = (None, None)
            if self._allreduce_delay[p] == 0 and (self._overlap or p.device.type != "cpu"):
                group = self._p_to_group.get(p)
                if group is not None:
                    self._group_counts[group] += 1
                    if self._group_counts[group] == len(group):
                        self._launch_group(group)
                        return
                else:
                    launched = self._allreduce_grad_async(p)
            elif self._allreduce_delay[p] == 0 and self._inline(p):
                launched = self._allreduce_grad_async(p, sync=True)
                _wait_briefly(launched[0])
            self._handles[p] = launched

        return hook

    # ---- launching -----------------------------------------------------------------------------
    def _inline(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s hook runs its allreduce (module docstring): no overlap, a dense CPU
        gradient of :data:`INLINE_BYTES` or more, not in a group."""
        grad = p.grad
        return (grad is not None and not grad.is_sparse and grad.device.type == "cpu"
                and p not in self._p_to_group
                and grad.nelement() * grad.element_size() >= INLINE_BYTES)

    def _grad(self, p: torch.Tensor) -> torch.Tensor:
        if p.grad is None:  # this rank's graph skipped p: still take part, with zeros
            p.grad = torch.zeros_like(p)
        return p.grad

    def _allreduce_grad_async(self, p: torch.Tensor, sync: bool = False) -> tuple[Any, Any]:
        """Start ``p``'s allreduce: (a call that waits and returns the result, compression
        context). ``sync``: the caller waits for it soon (its thread runs it: no hand-off to
        the lane's thread)."""
        name = self._parameter_names[p]
        grad = self._grad(p)
        if grad.is_sparse and not self.sparse_as_dense:
            return ops.sparse_allreduce_async(grad.coalesce(), name, self.op,
                                              self.process_set), _SPARSE
        tensor = grad.to_dense() if grad.is_sparse else grad
        compressed, ctx = self._compression.compress(tensor)
        pre, post = distopt.scale_factors(self.op, self.gradient_predivide_factor)
        handle, convert = _sp.ALLREDUCE.submit(ops.TORCH, True, sync, compressed, None, name,
                                               self.op, pre, post, self.process_set)
        return partial(_result, handle, convert), ctx

    def _launch_unit(self, params: list[torch.Tensor], sync: bool) -> None:
        """Start the allreduces of ``params`` that no hook started (without overlap: every
        gradient below :data:`INLINE_BYTES`), each under its own name as a single op; two or
        more dense CPU ones are submitted as one unit (one fused collective in a fast lane),
        largest first, so that every rank orders them alike and, where the fused op is split at
        the fusion limit, the small ones share one collective."""
        dense = dict.fromkeys(p for p in params if self.op is not ReduceOp.Adasum
                              and not self._grad(p).is_sparse
                              and self._grad(p).device.type == "cpu")
        if len(dense) < 2:
            dense = {}
        for p in params:
            if p not in dense:  # (tensors hash by identity)
                self._handles[p] = self._allreduce_grad_async(p, sync)
        if not dense:
            return
        unit = [(p, *self._compression.compress(self._grad(p))) for p in dense]
        unit.sort(key=lambda item: -item[1].nelement() * item[1].element_size())
        pre, post = distopt.scale_factors(self.op, self.gradient_predivide_factor)
        started = _sp.allreduce_unit(ops.TORCH, sync, [c for _, c, _ in unit],
                                     [self._parameter_names[p] for p, _, _ in unit], self.op,
                                     pre, post, self.process_set)
        for (p, _, ctx), (handle, convert) in zip(unit, started):
            self._handles[p] = (partial(_result, handle, convert), ctx)

    def _launch_group(self, group: tuple[torch.Tensor, ...], sync: bool = False) -> None:
        # Unlike Horovod, groups zero-fill missing gradients and honour the predivide factor.
        pairs = [self._compression.compress(g.to_dense() if g.is_sparse else g)
                 for g in (self._grad(p) for p in group)]
        pre, post = distopt.scale_factors(self.op, self.gradient_predivide_factor)
        handle, convert = _sp.GROUPED_ALLREDUCE.submit(
            ops.TORCH, True, sync, [c for c, _ in pairs], None, self._parameter_names[group[0]],
            self.op, pre, post, self.process_set)
        for p in group:
            self._handles.pop(p, None)
        self._handles[group] = (partial(_result, handle, convert), [c for _, c in pairs])
        self._group_counts[group] = 0

    # ---- public API ----------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every gradient allreduce and write the averaged gradients into ``p.grad``.

        Parameters whose hook did not fire (unused this step, or fewer backward passes than
        ``backward_passes_per_step``) are allreduced now, zero-filled if they have no gradient,
        so every rank submits the same ops. If one allreduce fails, the others are still waited
        for before the first error is raised (no op is left in flight).

        Raises:
            HorovodInternalError: an allreduce failed (mismatch across ranks, lost peer).
        """
        if not self._in_set:
            self._synchronized = True
            return
        sync = not self._overlap  # started here, run by this thread as it waits
        for group in self._group_counts:
            if group not in self._handles:
                self._launch_group(group, sync)
        self._launch_unit([p for p in self._requires_update if p not in self._p_to_group
                           and self._handles.get(p, (None,))[0] is None], sync)
        first_error: BaseException | None = None
        for key, (wait, ctx) in list(self._handles.items()):
            members = key if isinstance(key, tuple) else (key,)
            for p in members:
                self._allreduce_delay[p] = self.backward_passes_per_step
            try:
                if isinstance(key, tuple):
                    for p, out, c in zip(key, wait(), ctx):
                        self._write_grad(p, self._compression.decompress(out, c))
                elif ctx is _SPARSE:  # (its values and indices allgathered: not compressed)
                    self._write_grad(key, wait())
                else:
                    self._write_grad(key, self._compression.decompress(wait(), ctx))
            except BaseException as exc:  # noqa: BLE001 - wait for the rest, then raise
                first_error = first_error or exc
        self._handles.clear()
        self._synchronized = True
        if first_error is not None:
            raise first_error

    @staticmethod
    def _write_grad(p: torch.Tensor, output: torch.Tensor) -> None:
        grad = p.grad
        if grad is None or grad.is_sparse:
            p.grad = output if output.is_sparse or grad is None else output.to_sparse()
        elif output is not grad:
            grad.set_(output)  # type: ignore[call-overload]  # set_(Tensor) exists

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this context ``step()`` does not synchronize; use it after an explicit
        ``synchronize()`` (gradient clipping, AMP unscaling)::

            loss.backward(); optimizer.synchronize(); clip_grad_norm_(...)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Synchronize (unless inside ``skip_synchronize()``), then the wrapped optimizer's step.
        Warns if ``synchronize()`` was already called since the last step."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_AFTER_SYNC, stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return self._hora_base.step(self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad(set_to_none)`` (hora accepts ``set_to_none``;
        Horovod's override took no argument).

        Raises:
            AssertionError: gradients are still being allreduced (backward ran, but neither
                ``step()`` nor ``synchronize()`` did).
        """
        if self._handles:
            raise AssertionError(_ZERO_GRAD_PENDING)
        self._hora_base.zero_grad(self, set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Forget pending allreduces and accumulation counts, then load as the wrapped class."""
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._hora_base.load_state_dict(self, state_dict)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated locally before each allreduce."""
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes


def _wait_briefly(wait: Any) -> None:
    """Run a just-started allreduce on this thread for at most :data:`INLINE_WAIT_S`. Whatever
    happens is left in its handle: a pending op is waited for by ``synchronize()``, a failed
    one raises there (as in Horovod, errors surface at synchronize, not in backward)."""
    handle = wait.args[0]
    try:
        handle.wait(INLINE_WAIT_S)
    except Exception:  # noqa: BLE001, S110 - kept in the handle; synchronize() waits again
        pass


def _result(handle: Any, convert: Any) -> Any:
    """Wait for a core handle and convert its result (an in-place op: the tensor itself)."""
    return convert(handle.wait())


def _base_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The wrapped optimizer's defaults that its ``__init__`` accepts as keywords (so flags set
    at construction, e.g. ``fused=True``, are set up again in the runtime subclass)."""
    try:
        params = inspect.signature(type(optimizer).__init__).parameters.values()
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return {}
    names = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                  inspect.Parameter.KEYWORD_ONLY)}
    return {k: v for k, v in optimizer.defaults.items() if k in names and k != "params"}


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 - Horovod's name
                         named_parameters: Iterable[Any] | None = None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: int = ReduceOp.Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> Any:
    """Wrap ``optimizer`` so that gradients are averaged (``op``) across the process set.

    Args:
        optimizer: the optimizer to wrap; the result is an instance of its class.
        named_parameters: ``model.named_parameters()``; names key the allreduces and must be
            unique and cover every parameter of the optimizer. Default: generated names.
        compression: ``Compression.none`` or ``Compression.fp16`` (or your own compressor).
        backward_passes_per_step: backward passes accumulated locally before each allreduce.
        op: Average (default), Sum, Min, Max, Product, or Adasum: Horovod's delta optimizer
            (each rank steps locally, the parameter deltas are combined with Adasum; global
            process set, 2^k ranks; :mod:`hora.torch.adasum_optimizer`).
        gradient_predivide_factor: Average is done as ``1/f`` before and ``f/size`` after.
        num_groups: deprecated, use ``groups``.
        groups: an int k (parameters split into k groups, each one grouped allreduce) or a list
            of lists of parameters.
        sparse_as_dense: allreduce sparse gradients as dense tensors (else allgather them).
        process_set: the ranks that average together (others leave gradients untouched).

    Raises:
        ValueError: invalid options or ``named_parameters`` (see :mod:`hora.core.frontend.distopt`).
        NotImplementedError: ``op=Adasum`` with a process set other than the global one, or
            ranks (hosts, when hierarchical) that are not a power of two.
    """
    groups = distopt.check_options(op, gradient_predivide_factor, backward_passes_per_step,
                                   num_groups, groups)
    if isinstance(groups, list):
        distopt.check_explicit_groups(groups, torch.is_tensor)
    base = optimizer.__class__
    if distopt.adasum_active(op, process_set):
        from hora.torch.adasum_optimizer import _DistributedAdasumOptimizer

        namespace = dict(_DistributedAdasumOptimizer.__dict__)
        namespace["_hora_base"] = base
        return type(base.__name__, (base,), namespace)(
            optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
            _base_kwargs(optimizer), dict(optimizer.state))
    namespace = dict(_DistributedOptimizer.__dict__)
    namespace["_hora_base"] = base
    cls = type(base.__name__, (base,), namespace)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               op, gradient_predivide_factor, groups, sparse_as_dense, process_set,
               _base_kwargs(optimizer), dict(optimizer.state))
