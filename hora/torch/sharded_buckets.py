"""The collectives of :mod:`hora.torch.sharded`'s ``ShardedOptimizer`` (hora-only): gradients
packed per bucket and reduce-scattered to their owners (launched from the gradient hooks as
soon as a bucket's gradients are final, in one fixed order on every rank), parameters
allgathered from their owners, non-finite gradients agreed on for AMP. The plan and buckets
are :mod:`hora.core.frontend.sharding`'s.
"""

from __future__ import annotations

from typing import Any

import torch

from hora.collectives.ops import ReduceOp
from hora.core.frontend import distopt, sharding
from hora.core.op.process_set import ProcessSet
from hora.torch import ops
from hora.torch.compression import Compressor

TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before "
                   "call to step(). Increase backward_passes_per_step to accumulate gradients "
                   "locally.")


class ShardedCollectives:
    """Base of every runtime ``ShardedOptimizer`` class (after the wrapped optimizer's class):
    its collectives, and the marker the elastic state handler registry keys on."""

    # set by hora.torch.sharded._ShardedOptimizer
    backward_passes_per_step: int
    op: ReduceOp
    gradient_predivide_factor: float
    process_set: ProcessSet
    _compression: type[Compressor]
    _passes: dict[torch.Tensor, int]
    _plan: sharding.Plan | None
    _shard: int | None
    _buckets: list[sharding.Bucket]
    _trainable: list[torch.Tensor]
    _pieces: list[sharding.Piece]
    _units: dict[int, torch.Tensor]
    _split: set[int]
    _split_grads: list[tuple[int, torch.Tensor]]
    _unpacked: dict[int, int]
    _ready: set[int]
    _buffers: dict[Any, torch.Tensor]
    _bucket_of: dict[torch.Tensor, list[int]]
    _order: list[int]
    _waiting: list[int]
    _next: int
    _pending: list[tuple[sharding.Bucket, Any, Any]]
    _launches: int
    state: Any  # the wrapped optimizer's

    @property
    def _sharded(self) -> bool:
        return self._shard is not None and self._plan is not None and self._plan.size > 1

    def _param(self, j: int) -> torch.Tensor:
        """The parameter of piece ``j``."""
        return self._trainable[self._pieces[j].index]

    def _flat(self, j: int) -> torch.Tensor:
        """Piece ``j``'s elements of its parameter (a flat view; the parameter if whole)."""
        piece, p = self._pieces[j], self._param(j)
        if piece.index not in self._split:
            return p
        return p.detach().view(-1)[piece.start:piece.start + piece.numel]

    def _unit(self, j: int) -> torch.Tensor:
        """The tensor the wrapped optimizer steps for owned piece ``j`` (the parameter, or a
        flat view of its slice; made again, its state moved, if the parameter's storage was
        replaced)."""
        unit = self._units[j]
        if unit is not self._param(j) and \
                unit.untyped_storage().data_ptr() != \
                self._param(j).untyped_storage().data_ptr():
            fresh = self._flat(j)
            if unit in self.state:
                self.state[fresh] = self.state.pop(unit)
            self._units[j] = unit = fresh
        return unit

    # ---- hooks ---------------------------------------------------------------------------------
    def _count_pass(self, p: torch.Tensor) -> None:
        n = self._passes.get(p, 0) + 1
        if n > self.backward_passes_per_step:
            raise AssertionError(TOO_MANY_PASSES)
        self._passes[p] = n
        if n == self.backward_passes_per_step and self._sharded and p in self._bucket_of:
            for k in self._bucket_of[p]:
                self._waiting[k] -= 1
            # launch, in the fixed order, every bucket whose gradients are all final
            while self._next < len(self._order) and self._waiting[self._order[self._next]] <= 0:
                self._launch(self._order[self._next])
                self._next += 1

    def _new_round(self) -> None:
        """Forget this step's launches (after the reduce-scatter, or a plan change)."""
        self._waiting = [len(bucket.slots) for bucket in self._buckets]
        self._next = 0
        self._pending = []
        self._launches = 0
        self._split_grads = []
        self._unpacked = {}
        for piece in self._pieces:
            if piece.index in self._split:
                self._unpacked[piece.index] = self._unpacked.get(piece.index, 0) + 1
        self._ready = set()

    # ---- collectives ---------------------------------------------------------------------------
    def _pool(self, kind: str, bucket: sharding.Bucket, rows: int, k: int) -> torch.Tensor:
        """A ``[rows, bucket.width]`` view of one of two reused flat buffers per kind, dtype and
        device (bucket ``k`` takes buffer ``k % 2``: two buckets are in flight at most, and a
        buffer is used again only after its op was waited for)."""
        first = self._param(bucket.slots[0].index)
        key = (kind, first.dtype, first.device, k % 2)
        need = rows * max(b.width for b in self._buckets)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < need:
            buf = torch.empty(need, dtype=first.dtype, device=first.device)
            self._buffers[key] = buf
        return buf[:rows * bucket.width].view(rows, bucket.width)

    def _launch(self, k: int) -> None:
        """Pack bucket ``k``'s gradients and start its reduce-scatter. Buckets are launched in
        one fixed order on every rank (the last bucket first, as backward produces them), at
        most two in flight: before a third, the oldest is waited for and written back. Every
        rank's launches are a prefix of the same sequence, so a wait never blocks on an op that
        another rank can only launch after a wait of its own."""
        if len(self._pending) >= 2:
            self._write_grads(*self._pending.pop(0))
        bucket = self._buckets[k]
        pre, post = distopt.scale_factors(self.op, self.gradient_predivide_factor)
        buf = self._pack_grads(bucket, self._launches)
        self._launches += 1
        compressed, ctx = self._compression.compress(buf)
        handle = ops.reducescatter_async(compressed, name=f"sharded_optimizer.grads.{k}",
                                         op=self.op, prescale_factor=pre, postscale_factor=post,
                                         process_set=self.process_set)
        self._pending.append((bucket, handle, ctx))

    def _reduce_scatter(self) -> None:
        """Average every gradient into its owner's ``.grad``; the gradients of parameters other
        ranks own are released (``None``). Buckets whose gradients were all final during
        backward were launched from the gradient hooks already; the others are launched now
        (missing gradients as zeros), then every bucket is waited for."""
        self._passes.clear()
        assert self._plan is not None and self._shard is not None
        try:
            while self._next < len(self._order):
                self._launch(self._order[self._next])
                self._next += 1
            while self._pending:
                self._write_grads(*self._pending.pop(0))
            self._write_split_grads()
        finally:
            self._new_round()

    def _pack_grads(self, bucket: sharding.Bucket, k: int) -> torch.Tensor:
        assert self._plan is not None
        buf = self._pool("grads", bucket, self._plan.size, k)
        fill = [0] * self._plan.size
        for slot in bucket.slots:
            piece = self._pieces[slot.index]
            p = self._trainable[piece.index]
            grad = p.grad
            target = buf[slot.shard, slot.offset:slot.offset + slot.numel]
            fill[slot.shard] = max(fill[slot.shard], slot.offset + slot.numel)
            if grad is None:
                target.zero_()
            else:
                dense = grad.to_dense() if grad.is_sparse else grad
                target.copy_(dense.reshape(-1)[piece.start:piece.start + piece.numel])
            if piece.index in self._split:
                self._packed_piece(piece.index)
            elif slot.shard != self._shard:
                p.grad = None
        for shard, used in enumerate(fill):
            if used < bucket.width:
                buf[shard, used:].zero_()
        return buf

    def _write_grads(self, bucket: sharding.Bucket, handle: Any, ctx: Any) -> None:
        out = ops.synchronize(handle)
        row = self._compression.decompress(out, ctx).reshape(-1)
        for slot in bucket.slots:
            if slot.shard != self._shard:
                continue
            averaged = row[slot.offset:slot.offset + slot.numel]
            if self._pieces[slot.index].index in self._split:
                self._split_grads.append((slot.index, averaged))
                self._flush_split_grads()
                continue
            p = self._param(slot.index)
            # the averaged gradient is a view of the reduce-scatter's result: no copy
            p.grad = averaged.view_as(p)

    def _packed_piece(self, i: int) -> None:
        """One more piece of split parameter ``i`` packed; after its last one, its ``.grad``
        is released (this rank owns no slice of it) or made ready for the averaged slices:
        zeros but where they will be written (AMP's unscaling and inf checks over the param
        groups see them)."""
        self._unpacked[i] -= 1
        if self._unpacked[i] > 0:
            return
        p = self._trainable[i]
        if not any(self._pieces[j].index == i for j in self._units):
            p.grad = None
            return
        grad = p.grad
        if grad is None or grad.is_sparse or not grad.is_contiguous():
            grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        else:
            grad.zero_()
        p.grad = grad
        self._ready.add(i)

    def _flush_split_grads(self) -> None:
        """Write the averaged slices whose parameter's ``.grad`` is ready into it (each slice's
        tensor a view of it); the others wait."""
        waiting = []
        for j, averaged in self._split_grads:
            piece = self._pieces[j]
            if piece.index not in self._ready:
                waiting.append((j, averaged))
                continue
            grad = self._trainable[piece.index].grad
            assert grad is not None
            flat = grad.view(-1)[piece.start:piece.start + piece.numel]
            flat.copy_(averaged)
            self._unit(j).grad = flat
        self._split_grads = waiting

    def _write_split_grads(self) -> None:
        """After every bucket (every piece packed): the averaged slices still waiting."""
        self._flush_split_grads()
        assert not self._split_grads, "a split parameter's slices were not all packed"

    def _allgather_parameters(self) -> None:
        """Every owner's new values into every rank's parameters, one bucket at a time (the
        next one in flight while the last one is written)."""
        assert self._plan is not None and self._shard is not None
        pending: list[tuple[sharding.Bucket, Any]] = []
        for k, bucket in enumerate(self._buckets):
            row = self._pool("params", bucket, 1, k)
            used = 0
            for slot in bucket.slots:
                if slot.shard == self._shard:
                    row[0, slot.offset:slot.offset + slot.numel].copy_(
                        self._unit(slot.index).detach().reshape(-1))
                    used = max(used, slot.offset + slot.numel)
            if used < bucket.width:
                row[0, used:].zero_()
            pending.append((bucket, ops.allgather_async(
                row, name=f"sharded_optimizer.params.{k}", process_set=self.process_set)))
            if len(pending) > 1:
                self._write_params(*pending.pop(0))
        for item in pending:
            self._write_params(*item)

    def _write_params(self, bucket: sharding.Bucket, handle: Any) -> None:
        full = ops.synchronize(handle)
        with torch.no_grad():
            for slot in bucket.slots:
                if slot.shard != self._shard:
                    p = self._flat(slot.index)
                    p.copy_(full[slot.shard, slot.offset:slot.offset + slot.numel].view_as(p))

    def _agree_on_non_finite(self) -> None:
        """After an explicit ``synchronize()``: if any member's averaged gradients hold inf/NaN,
        every rank's gradients do (a NaN is written on the ranks that had none), so an AMP
        ``GradScaler`` skips ``step()`` on every rank or on none."""
        owned = [u.grad for u in self._units.values() if u.grad is not None]
        bad = any(bool((~torch.isfinite(g)).any()) for g in owned)
        flag = torch.tensor([1.0 if bad else 0.0])
        flag = ops.synchronize(ops.allreduce_async(flag, name="sharded_optimizer.non_finite",
                                                   op=ReduceOp.Max,
                                                   process_set=self.process_set))
        if float(flag[0]) > 0 and not bad:
            for p in self._trainable:
                if p.grad is not None and p.grad.numel() and not p.grad.is_sparse:
                    p.grad.view(-1)[0] = float("nan")
                    return


__all__ = ["TOO_MANY_PASSES", "ShardedCollectives"]
