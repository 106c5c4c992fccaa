"""``ShardedOptimizer`` (hora-only): ZeRO-style sharded optimizer state behind Horovod's
``DistributedOptimizer`` API.

As :func:`hora.torch.DistributedOptimizer` does, :func:`ShardedOptimizer` builds a runtime
subclass of the wrapped optimizer's class (``isinstance(opt, torch.optim.Adam)`` holds) sharing
its param groups. Each trainable parameter, or for elementwise optimizers each slice of one
(``split_parameters``), is owned by one member of the process set (the plans of
:mod:`hora.core.frontend.sharding`, balanced by bytes). ``step()``:

1. packs the gradients into one ``[size, width]`` buffer per dtype (row ``s``: the gradients of
   the parameters shard ``s`` owns) and reduce-scatters it (``op``, predivide factor and
   compression as ``DistributedOptimizer``): every member receives the averaged gradients of
   its own parameters, written into their ``.grad``;
2. runs the wrapped optimizer's step on the parameters this rank owns only, so ``opt.state``
   holds this rank's shard (about ``1/size`` of the unsharded state's bytes);
3. allgathers the owners' new parameter values into every rank's parameters.

The buffers are packed per bucket (``bucket_bytes`` per rank's row, two buckets in flight), and
the gradients of parameters other ranks own are released as soon as they are packed, so the
step's extra memory stays small next to the state it saves.

``state_dict()`` is collective (every member calls it) and returns the full state, in the
wrapped optimizer's own format (loadable by the unwrapped optimizer, at any size);
``load_state_dict(full)`` keeps this rank's shard of a full state written at any size.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import hora
from hora._util.log import get_logger
from hora.collectives.ops import ReduceOp
from hora.core.frontend import distopt, sharding
from hora.core.frontend import objects as _objects
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.torch import ops
from hora.torch.compression import Compression, Compressor
from hora.torch.elastic import state as _elastic_state
from hora.torch.elastic._snapshot import snapshot, thawed
from hora.torch.sharded_buckets import ShardedCollectives
from hora.torch.sharded_state import cut_piece, join_pieces, resolve_split
from hora.torch.wrapping import init_wrapped

log = get_logger(__name__)

_ZERO_GRAD_PENDING = ("optimizer.zero_grad() was called after loss.backward() but before "
                      "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                      "cause a race condition.")
_STEP_AFTER_SYNC = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.")


class _ShardedOptimizer(torch.optim.Optimizer, ShardedCollectives):
    """Methods mixed into the runtime subclass of the wrapped optimizer's class."""

    _hora_sharded = True
    _hora_base: Any = torch.optim.Optimizer

    def __init__(self, params: Any, named_parameters: Iterable[Any] | None,
                 compression: type[Compressor], backward_passes_per_step: int, op: int,
                 gradient_predivide_factor: float, process_set: ProcessSet, bucket_bytes: int,
                 split_parameters: bool, base_kwargs: dict[str, Any], state: dict[Any, Any]
                 ) -> None:
        init_wrapped(self, params, base_kwargs, state)
        self.bucket_bytes = bucket_bytes
        self.split_parameters = split_parameters
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = ReduceOp(op)
        self.gradient_predivide_factor = gradient_predivide_factor
        self.process_set = process_set
        self._parameter_names: dict[torch.Tensor, str] = distopt.parameter_names(
            [group["params"] for group in self.param_groups], named_parameters)
        self._passes: dict[torch.Tensor, int] = {}
        self._synchronized = False
        self._should_synchronize = True
        self._plan_key: Any = None
        self._plan: sharding.Plan | None = None
        self._buckets: list[sharding.Bucket] = []
        self._trainable: list[torch.Tensor] = []
        self._pieces: list[sharding.Piece] = []
        self._units: dict[int, torch.Tensor] = {}
        self._split: set[int] = set()
        self._split_grads: list[tuple[int, torch.Tensor]] = []
        self._shard: int | None = None
        self._hook_handles: list[Any] = []
        self._buffers: dict[Any, torch.Tensor] = {}
        self._bucket_of: dict[torch.Tensor, list[int]] = {}
        self._order: list[int] = []
        self._waiting: list[int] = []
        self._next = 0
        self._pending: list[tuple[sharding.Bucket, Any, Any]] = []
        self._launches = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._hook_handles.append(
                        p.register_post_accumulate_grad_hook(self._count_pass))
        self._replan()

    # ---- the plan ------------------------------------------------------------------------------
    def _membership(self) -> tuple[Any, ...]:
        ranks = tuple(self.process_set.ranks) if self.process_set.ranks else (0,)
        count = sum(len(g["params"]) for g in self.param_groups)
        return ranks, hora.rank() if hora.is_initialized() else 0, count

    def _replan(self) -> None:
        """(Re)compute the plan for the current members and parameters; drop the state of the
        parameters this rank no longer owns."""
        key = self._membership()
        if key == self._plan_key:
            return
        ranks, rank, _ = key
        slices = {(id(self._param(j)), self._pieces[j].start, self._pieces[j].numel): unit
                  for j, unit in self._units.items() if unit is not self._param(j)}
        self._trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._shard = sharding.shard_of(ranks, rank)
        size = len(ranks) if self._shard is not None else 1
        params = self._trainable
        if self.split_parameters:
            items = [p.element_size() for p in params]
            self._plan, self._pieces = sharding.chunk(*sharding.split_plan(
                [p.numel() for p in params], items, size,
                [p.is_contiguous() and not p.is_sparse for p in params]), items,
                self.bucket_bytes)  # no row over bucket_bytes: the packed buffers stay small
        else:
            self._plan = sharding.plan([p.numel() * p.element_size() for p in params], size)
            self._pieces = [sharding.Piece(i, 0, p.numel()) for i, p in enumerate(params)]
        self._split = {pc.index for pc in self._pieces if pc.numel != params[pc.index].numel()}
        self._buckets = sharding.layout(
            self._plan, [pc.numel for pc in self._pieces],
            [(str(params[pc.index].dtype), str(params[pc.index].device)) for pc in self._pieces],
            max_row_bytes=self.bucket_bytes,
            itemsizes=[params[pc.index].element_size() for pc in self._pieces])
        mine = self._shard if self._shard is not None else 0
        self._units = {j: self._flat(j) for j in self._plan.owned(mine)}
        for j, unit in self._units.items():  # a slice this rank keeps keeps its state
            old = slices.get((id(self._param(j)), self._pieces[j].start, self._pieces[j].numel))
            if old is not None and old in self.state:
                self.state[unit] = self.state.pop(old)
        kept = {id(u) for u in self._units.values()}
        for p in list(self.state):
            if id(p) not in kept:
                del self.state[p]
        self._buffers = {}
        self._bucket_of = {}
        for k, b in enumerate(self._buckets):
            for slot in b.slots:
                self._bucket_of.setdefault(self._param(slot.index), []).append(k)
        self._order = list(reversed(range(len(self._buckets))))
        self._new_round()
        self._plan_key = key
        log.debug("ShardedOptimizer(%s): %d parameters (%d split) in %d shards, imbalance "
                  "%.3f, padding %.3f", self._hora_base.__name__, len(params),
                  len(self._split), size, self._plan.imbalance(),
                  sharding.padding_ratio(self._buckets, size))

    def owned_parameters(self) -> list[torch.Tensor]:
        """The parameters whose optimizer state (or a slice of it, for a split parameter)
        lives on this rank (hora-only)."""
        self._replan()
        owned = {self._pieces[j].index for j in self._units}
        return [p for i, p in enumerate(self._trainable) if i in owned]

    def _owned_units(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """What the wrapped optimizer steps for ``params`` (one param group's) on this rank."""
        units: dict[int, list[torch.Tensor]] = {}
        for j in self._units:
            units.setdefault(id(self._param(j)), []).append(self._unit(j))
        return [u for p in params for u in units.get(id(p), [])]

    # ---- public API ----------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Reduce-scatter the gradients: each parameter's owner gets the average in ``.grad``
        (the gradients of parameters other ranks own are released). Collective. Use it, as with
        ``DistributedOptimizer``, before gradient clipping (:meth:`clip_grad_norm_`) or AMP
        unscaling, then ``step()`` inside :meth:`skip_synchronize`; if any member's averaged
        gradients are not finite, every rank's are made so (AMP skips the step everywhere)."""
        self._replan()
        if self._sharded:
            self._reduce_scatter()
            self._agree_on_non_finite()
        self._passes.clear()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this context ``step()`` does not reduce-scatter (after ``synchronize()``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Reduce-scatter the gradients (unless inside ``skip_synchronize()``), step the wrapped
        optimizer on this rank's parameters, allgather the parameters. Collective."""
        self._replan()
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_AFTER_SYNC, stacklevel=2)
            if self._sharded:
                self._reduce_scatter()
            self._passes.clear()
        self._synchronized = False
        if not self._sharded:
            return self._hora_base.step(self, closure)
        saved = [g["params"] for g in self.param_groups]
        try:
            for g in self.param_groups:
                g["params"] = self._owned_units(g["params"])
            result = self._hora_base.step(self, closure)
        finally:
            for g, params in zip(self.param_groups, saved):
                g["params"] = params
        self._allgather_parameters()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad(set_to_none)``.

        Raises:
            AssertionError: gradients are being reduce-scattered (backward ran, but neither
                ``step()`` nor ``synchronize()`` did), as ``DistributedOptimizer`` raises.
        """
        if self._pending:
            raise AssertionError(_ZERO_GRAD_PENDING)
        self._passes.clear()
        self._hora_base.zero_grad(self, set_to_none)
        for j, unit in self._units.items():  # a slice's view would keep the old gradient
            if unit is not self._param(j):
                unit.grad = None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients by their global norm (hora-only; after
        ``synchronize()``): each rank's shard contributes to one allreduce of the norm, and each
        owner scales its gradients. Returns the total norm (equal on every rank). Collective.
        ``torch.nn.utils.clip_grad_norm_`` over the model would see only this rank's shard."""
        self._replan()
        grads = [u.grad for u in self._owned_units(self._trainable) if u.grad is not None]
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            local = max((float(g.detach().abs().max()) for g in grads if g.numel()), default=0.0)
            total_t = torch.tensor([local], dtype=torch.float64)
            if self._sharded:
                total_t = ops.synchronize(ops.allreduce_async(
                    total_t, name="sharded_optimizer.norm", op=ReduceOp.Max,
                    process_set=self.process_set))
            total = float(total_t[0])
        else:
            local = sum(float(g.detach().double().abs().pow(norm_type).sum()) for g in grads)
            total_t = torch.tensor([local], dtype=torch.float64)
            if self._sharded:
                total_t = ops.synchronize(ops.allreduce_async(
                    total_t, name="sharded_optimizer.norm", op=ReduceOp.Sum,
                    process_set=self.process_set))
            total = float(total_t[0]) ** (1.0 / norm_type)
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef)
        return torch.tensor(total)

    def state_dict(self) -> dict[str, Any]:
        """The full state (every member's shard), in the wrapped optimizer's format. Collective:
        every member of the process set must call it (e.g. ``sd = opt.state_dict()`` on every
        rank, then ``torch.save`` on rank 0)."""
        self._replan()
        held = {j: self.state.pop(u) for j, u in self._split_units().items() if u in self.state}
        try:  # the slices' states are keyed by tensors outside the param groups
            local = self._hora_base.state_dict(self)
        finally:
            for j, st in held.items():
                self.state[self._unit(j)] = st
        if not self._sharded:
            return local
        position = self._positions()
        mine = dict(local["state"])
        portable = {k: _portable(s) for k, s in mine.items()}
        slices = {(position[self._pieces[j].index], self._pieces[j].start):
                  (self._pieces[j].numel, _portable(st)) for j, st in held.items()}
        parts = _objects.allgather_object((portable, slices), name="sharded_optimizer.state_dict",
                                          process_set=self.process_set)
        full = sharding.merge_states(
            {k: v for k, v in part.items() if k not in mine} for part, _ in parts)
        full.update(mine)  # this rank's entries are its live tensors
        joined: dict[int, list[tuple[int, int, Any]]] = {}
        for _, part_slices in parts:
            for (k, start), (numel, st) in part_slices.items():
                joined.setdefault(k, []).append((start, numel, st))
        params = {position[i]: self._trainable[i] for i in self._split}
        for k, pieces in joined.items():
            p = params[k]
            full[k] = {n: (v.to(p.device) if torch.is_tensor(v) and v.dim() else v)
                       for n, v in join_pieces(pieces, p.shape, p.numel()).items()}
        return {"state": dict(sorted(full.items())), "param_groups": local["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (from :meth:`state_dict`, a plain optimizer or
        ``DistributedOptimizer``, written at any size): keep this rank's shard."""
        self._replan()
        self._drop_round()
        self._passes.clear()
        self._synchronized = False
        self._should_synchronize = True
        given = {int(k): v for k, v in state_dict["state"].items()}
        position = self._positions()
        if self._sharded:
            owned = [position[self._pieces[j].index] for j in self._units
                     if self._pieces[j].index not in self._split]
            state_dict = {**state_dict, "state": sharding.select_states(state_dict["state"],
                                                                        owned)}
        self._hora_base.load_state_dict(self, state_dict)
        for j, unit in self._split_units().items():
            piece = self._pieces[j]
            entry = given.get(position[piece.index])
            if entry is not None:
                self.state[unit] = cut_piece(entry, piece.start, piece.numel, self._param(j))

    def _split_units(self) -> dict[int, torch.Tensor]:
        return {j: self._unit(j) for j in self._units if self._pieces[j].index in self._split}

    def _positions(self) -> dict[int, int]:
        """Each trainable parameter's index in the state dict (its position in the groups)."""
        index = {id(p): i for i, p in
                 enumerate(p for g in self.param_groups for p in g["params"])}
        return {i: index[id(p)] for i, p in enumerate(self._trainable)}

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated locally before each step."""
        self._drop_round()
        self.backward_passes_per_step = passes
        self._passes.clear()

    def _drop_round(self) -> None:
        """Forget the reduce-scatters already launched (as ``DistributedOptimizer`` forgets its
        handles); their packed buffers are not reused."""
        if self._pending or self._next:
            self._buffers = {}
        self._new_round()


def _portable(state: dict[str, Any]) -> dict[str, Any]:
    return {n: (v.detach().cpu() if torch.is_tensor(v) else v) for n, v in state.items()}


class ShardedOptimizerStateHandler(_elastic_state.StateHandler):
    """Elastic state of a :func:`ShardedOptimizer` (``TorchState`` uses it). ``save`` (at
    commit, collective) keeps the full state; ``restore`` loads it (no collective: this runs
    after a failure); ``reset`` (the world changed) and ``sync`` load the committed full state
    (``sync``: rank 0's, on every rank), so a job that changed size re-shards it for its new
    members."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self._saved: Any = None
        self.save()

    def save(self) -> None:
        self._saved = snapshot(self.value.state_dict(), self._saved)

    def restore(self) -> None:
        self.value.load_state_dict(thawed(self._saved, None, True))

    def sync(self) -> None:
        full = _objects.broadcast_object(self._saved if hora.rank() == 0 else None, 0,
                                         name="sharded_optimizer.sync")
        self._saved = full
        self.value.load_state_dict(thawed(full, None, True))

    def reset(self) -> None:
        """The world changed (``TorchState.reset``): take this rank's shard of the committed
        full state under the new plan, locally. After removals only, elastic skips ``sync``;
        the shards of the ranks that left live on in every survivor's committed copy (the
        commit that raised ``HostsUpdatedInterrupt`` has just saved it)."""
        self.value.load_state_dict(thawed(self._saved, None, True))


def _register_handler() -> None:
    registry = _elastic_state.get_handler_registry()
    if not any(t is ShardedCollectives for t, _ in registry):
        _elastic_state.set_handler_registry(
            [(ShardedCollectives, ShardedOptimizerStateHandler), *registry])


def ShardedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 - Horovod-style name
                     named_parameters: Iterable[Any] | None = None,
                     compression: type[Compressor] = Compression.none,
                     backward_passes_per_step: int = 1, op: int = ReduceOp.Average,
                     gradient_predivide_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set,
                     bucket_bytes: int = 32 * 2**20,
                     split_parameters: bool | None = None) -> Any:
    """Wrap ``optimizer`` (hora-only): gradients averaged across the process set as
    :func:`hora.torch.DistributedOptimizer` does, optimizer state sharded across its members.

    Args:
        optimizer: the optimizer to wrap; the result is an instance of its class. Any state it
            already has for parameters other ranks own is dropped.
        named_parameters: ``model.named_parameters()`` (checked as ``DistributedOptimizer``
            checks them).
        compression: ``Compression.none`` or ``Compression.fp16`` (gradients only).
        backward_passes_per_step: backward passes accumulated locally before each ``step()``.
        op: Average (default) or Sum.
        gradient_predivide_factor: Average is done as ``1/f`` before and ``f/size`` after.
        process_set: the ranks that average together and share the state; other ranks step
            the whole optimizer locally.
        bucket_bytes: hora-only: the most bytes of one rank's row in one packed buffer (a
            reduce-scatter and an allgather per bucket, two in flight; a larger parameter is
            cut into slices of at most this size when parameters are split, else gets a
            bucket of its own). The step reuses two packed buffers of ``size`` rows and two
            rows for the allgather: ``2 * (size + 1) * bucket_bytes`` of memory kept.
        split_parameters: hora-only: plan the shards over the parameters' flattened bytes, a
            parameter split at element boundaries where it does not fit (each rank steps its
            slice), so every rank holds ``1/size`` of the state even when one parameter
            dominates. Default (None): for the elementwise torch.optim classes (Adam, AdamW,
            SGD, Adagrad, RMSprop, ...; exact class); True: for any optimizer whose update is
            elementwise; False: whole parameters only.

    Raises:
        ValueError: an op other than Average / Sum, invalid options or ``named_parameters``;
            ``split_parameters=True`` for an optimizer that needs whole tensors (LBFGS, ...).
    """
    distopt.check_options(op, gradient_predivide_factor, backward_passes_per_step, 0, None)
    if ReduceOp(op) not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"ShardedOptimizer reduce-scatters gradients: op must be Average or "
                         f"Sum, not {ReduceOp(op).name}")
    base = optimizer.__class__
    split = resolve_split(base, split_parameters)
    _register_handler()
    namespace = dict(_ShardedOptimizer.__dict__)
    namespace["_hora_base"] = base
    cls = type(base.__name__, (base, ShardedCollectives), namespace)
    from hora.torch.optimizer import _base_kwargs

    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               op, gradient_predivide_factor, process_set, bucket_bytes, split,
               _base_kwargs(optimizer), dict(optimizer.state))


__all__ = ["ShardedOptimizer", "ShardedOptimizerStateHandler"]
