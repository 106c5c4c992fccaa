"""``ShardedOptimizer`` for optax (hora-only): ZeRO-style sharded optimizer state.

:func:`ShardedOptimizer` returns an ``optax.GradientTransformation`` (eager or inside
``jax.jit``). Every leaf of the parameter tree is owned by one member of the process set (the
plan of :mod:`hora.core.frontend.sharding`, balanced by bytes). ``init(params)`` initializes
the wrapped transformation on this rank's leaves only, so the state holds about ``1/size`` of
the bytes. ``update(grads, state, params)``:

1. packs the gradient leaves into one ``[size, width]`` array per dtype (row ``s``: the leaves
   shard ``s`` owns) and reduce-scatters it (``op``, predivide factor, compression as
   :func:`hora.jax.DistributedOptimizer`): this rank receives the averaged gradients of its
   leaves;
2. runs the wrapped transformation on them (its state is over this rank's leaves);
3. allgathers every owner's updates and returns the full update tree, as an unsharded
   transformation would.

The wrapped transformation sees a dict ``{"000012": leaf}`` keyed by each leaf's position in the
full tree, so its state says which leaf each entry belongs to: :meth:`gather_state` builds the
*full* state (the wrapped transformation's state over the dict of every leaf; the same at every
size) and :meth:`scatter_state` takes this rank's shard of a full state written at any size
(checkpoints, ``hora.elastic.ObjectState`` across a change of size);
:meth:`~ShardedTransformation.elastic_state` makes an elastic state that does it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hora
from hora.collectives.ops import ReduceOp
from hora.core.frontend import distopt, sharding
from hora.core.frontend import objects as _objects
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.jax import sharded_global
from hora.jax.compression import Compression, Compressor
from hora.jax.ops import grouped_allgather, grouped_reducescatter


def _key(i: int) -> str:
    return f"{i:06d}"


class _Layout(NamedTuple):
    plan: sharding.Plan
    buckets: list[sharding.Bucket]
    shard: int
    sharded: bool


class ShardedTransformation(optax.GradientTransformation):
    """An ``optax.GradientTransformation`` (``init``, ``update``) with the full-state helpers
    of :func:`ShardedOptimizer`."""

    def gather_state(self, state: Any) -> Any:
        """The full state (every member's shard; collective: every member calls it), as the
        wrapped transformation's state over ``{"000000": leaf0, ...}``, with numpy leaves."""
        return self._hora_gather(state)

    def scatter_state(self, full: Any, params: Any) -> Any:
        """This rank's shard of a full state (from :meth:`gather_state` at any size), for
        ``params`` (the parameter tree, or one of the same shapes)."""
        return self._hora_scatter(full, params)

    def elastic_state(self, params: Any, opt_state: Any, **kwargs: Any) -> Any:
        """An elastic state (``hora.elastic.run``) holding ``state.params`` and
        ``state.opt_state`` (this rank's shard; the full state at commit, re-sharded on
        restore, sync and reset) and the plain attributes ``kwargs``
        (:class:`~hora.jax.sharded_elastic.ShardedState`)."""
        from hora.jax.sharded_elastic import ShardedState

        return ShardedState(self, params, opt_state, **kwargs)


def ShardedOptimizer(optimizer: optax.GradientTransformation,  # noqa: N802 - Horovod-style
                     compression: type[Compressor] = Compression.none,
                     backward_passes_per_step: int = 1, op: int = ReduceOp.Average,
                     gradient_predivide_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set,
                     name: str = "ShardedOptimizer",
                     clip_global_norm: float | None = None) -> ShardedTransformation:
    """Wrap optax transformation ``optimizer`` (hora-only): gradients averaged across the
    process set as :func:`hora.jax.DistributedOptimizer` does, its state sharded across the
    members (see the module docstring).

    Args:
        compression: ``Compression.fp16`` sends floating gradients as float16.
        backward_passes_per_step: accumulate this many gradients locally (their mean,
            ``optax.MultiSteps``) before one reduce-scatter and one update.
        op: Average (default) or Sum.
        gradient_predivide_factor: Average only: ``1/f`` before the sum, ``f/size`` after.
        process_set: the members that average and share the state; other ranks apply the whole
            transformation to their own gradients.
        name: the base of the collectives' names (two optimizers in one program need two).
        clip_global_norm: (hora-only) clip the averaged gradients to this global norm before
            ``optimizer``, as ``optax.chain(optax.clip_by_global_norm(clip_global_norm),
            optimizer)`` under ``DistributedOptimizer``: the norm of every rank's leaves (one
            scalar allreduce). ``optax.clip_by_global_norm`` inside ``optimizer`` would see
            this rank's leaves only, so it is refused.

    Raises:
        ValueError: an op other than Average / Sum, invalid options, or ``optimizer`` holding
            an optax transformation that reads every leaf (``clip_by_global_norm``,
            ``apply_if_finite``, ...; :mod:`hora.jax.sharded_global`).
    """
    distopt.check_options(op, gradient_predivide_factor, backward_passes_per_step, 0, None)
    sharded_global.check_max_norm(clip_global_norm)
    sharded_global.check_transformation(optimizer)
    if ReduceOp(op) not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"ShardedOptimizer reduce-scatters gradients: op must be Average or "
                         f"Sum, not {ReduceOp(op).name}")
    prescale, postscale = distopt.scale_factors(op, gradient_predivide_factor)
    cache: dict[Any, _Layout] = {}

    def layout(leaves: list[Any]) -> _Layout:
        ranks = tuple(process_set.ranks or (0,))
        shard = sharding.shard_of(ranks, hora.rank())
        key = (ranks, shard, tuple((tuple(np.shape(x)), str(jnp.result_type(x)))
                                   for x in leaves))
        found = cache.get(key)
        if found is None:
            size = len(ranks) if shard is not None else 1
            dtypes = [jnp.result_type(x) for x in leaves]
            sizes = [int(np.prod(np.shape(x))) for x in leaves]
            the_plan = sharding.plan([n * d.itemsize for n, d in zip(sizes, dtypes)], size)
            buckets = sharding.layout(the_plan, sizes, [str(d) for d in dtypes])
            found = _Layout(the_plan, buckets, shard or 0, shard is not None and size > 1)
            cache[key] = found
        return found

    def owned(lay: _Layout, leaves: list[Any]) -> dict[str, Any]:
        return {_key(i): leaves[i] for i in lay.plan.owned(lay.shard)}

    def pack_rows(lay: _Layout, leaves: list[Any]) -> list[Any]:
        out = []
        for bucket in lay.buckets:
            dtype = jnp.result_type(leaves[bucket.slots[0].index])
            rows = []
            for s in range(lay.plan.size):
                parts = [jnp.ravel(leaves[slot.index]) for slot in bucket.row(s)]
                used = sum(slot.numel for slot in bucket.row(s))
                if used < bucket.width:
                    parts.append(jnp.zeros((bucket.width - used,), dtype))
                rows.append(jnp.concatenate(parts) if len(parts) > 1 else parts[0])
            out.append(jnp.stack(rows))
        return out

    def pack_mine(lay: _Layout, values: dict[str, Any], like: list[Any]) -> list[Any]:
        out = []
        for bucket in lay.buckets:
            dtype = jnp.result_type(like[bucket.slots[0].index])
            mine = bucket.row(lay.shard)
            parts = [jnp.ravel(values[_key(slot.index)]).astype(dtype) for slot in mine]
            used = sum(slot.numel for slot in mine)
            if used < bucket.width:
                parts.append(jnp.zeros((bucket.width - used,), dtype))
            out.append((jnp.concatenate(parts) if len(parts) > 1 else parts[0])[None, :])
        return out

    def init(params: Any) -> Any:
        leaves = jax.tree_util.tree_leaves(params)
        return optimizer.init(owned(layout(leaves), leaves))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        lay = layout(leaves)
        p_leaves = None if params is None else jax.tree_util.tree_leaves(params)
        if not lay.sharded:
            mine = owned(lay, leaves)
            if clip_global_norm is not None:
                mine = sharded_global.clip_by_global_norm(mine, clip_global_norm, False, name,
                                                          process_set)
            new, state = optimizer.update(mine, state,
                                          None if p_leaves is None else owned(lay, p_leaves))
            return jax.tree_util.tree_unflatten(
                treedef, [new[_key(i)] for i in range(len(leaves))]), state
        shares = grouped_reducescatter(pack_rows(lay, leaves), name=f"{name}.grads",
                                       compression=compression, op=op, process_set=process_set,
                                       prescale_factor=prescale, postscale_factor=postscale)
        grads: dict[str, Any] = {}
        for bucket, share in zip(lay.buckets, shares):
            row = share[0]
            for slot in bucket.row(lay.shard):
                leaf = leaves[slot.index]
                grads[_key(slot.index)] = jnp.reshape(
                    row[slot.offset:slot.offset + slot.numel], np.shape(leaf)).astype(
                        jnp.result_type(leaf))
        if clip_global_norm is not None:
            grads = sharded_global.clip_by_global_norm(grads, clip_global_norm, True, name,
                                                       process_set)
        new, state = optimizer.update(grads, state,
                                      None if p_leaves is None else owned(lay, p_leaves))
        gathered = grouped_allgather(pack_mine(lay, new, leaves), name=f"{name}.updates",
                                     process_set=process_set)
        out: list[Any] = list(leaves)
        for bucket, full in zip(lay.buckets, gathered):
            for slot in bucket.slots:
                out[slot.index] = jnp.reshape(full[slot.shard, slot.offset:slot.offset
                                                   + slot.numel], np.shape(leaves[slot.index]))
        return jax.tree_util.tree_unflatten(treedef, out), state

    def _is_param_key(entry: Any) -> bool:
        return isinstance(entry, jax.tree_util.DictKey) and isinstance(entry.key, str) \
            and len(entry.key) == 6 and entry.key.isdigit()

    def split_paths(tree: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """(leaves under a parameter key, other leaves), by key path."""
        per_param: dict[str, Any] = {}
        other: dict[str, Any] = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            target = per_param if any(_is_param_key(e) for e in path) else other
            target[jax.tree_util.keystr(path)] = np.asarray(leaf)
        return per_param, other

    def fill(template: Any, values: dict[str, Any]) -> Any:
        paths, treedef = jax.tree_util.tree_flatten_with_path(template)
        return jax.tree_util.tree_unflatten(
            treedef, [values[jax.tree_util.keystr(path)] for path, _ in paths])

    def gather(state: Any) -> Any:
        inner, rebuild = _inner(state)
        per_param, other = split_paths(inner)
        ranks = tuple(process_set.ranks or (0,))
        if sharding.shard_of(ranks, hora.rank()) is not None and len(ranks) > 1:
            parts = _objects.allgather_object(per_param, name=f"{name}.gather_state",
                                              process_set=process_set)
            for part in parts:
                per_param.update(part)
        return rebuild(_full_tree(per_param, other))

    def _full_tree(per_param: dict[str, Any], other: dict[str, Any]) -> Any:
        # the full state's template: the wrapped transformation's state over every leaf
        count = 1 + max((int(k) for p in per_param for k in _indices(p)), default=-1)
        template = jax.eval_shape(optimizer.init, {_key(i): _leaf_spec(per_param, i)
                                                    for i in range(count)})
        return fill(template, {**per_param, **other})

    def _indices(path_key: str) -> list[str]:
        return [part[:6] for part in path_key.split("['")[1:] if part[:6].isdigit()
                and part[6:8] == "']"]

    def _leaf_spec(per_param: dict[str, Any], i: int) -> Any:
        for path_key, value in per_param.items():
            if _key(i) in _indices(path_key):
                return jax.ShapeDtypeStruct(value.shape, value.dtype)
        raise ValueError(f"the full state has no entry for parameter {i}")

    def scatter(full: Any, params: Any) -> Any:
        inner_full, rebuild = _inner(full)
        leaves = jax.tree_util.tree_leaves(params)
        lay = layout(leaves)
        per_param, other = split_paths(inner_full)
        template = jax.eval_shape(optimizer.init, owned(lay, leaves))
        return rebuild(jax.tree_util.tree_map(jnp.asarray, fill(template,
                                                                {**per_param, **other})))

    def _inner(state: Any) -> tuple[Any, Callable[[Any], Any]]:
        if isinstance(state, optax.MultiStepsState):
            return state.inner_opt_state, lambda s: state._replace(inner_opt_state=s)
        return state, lambda s: s

    tx = optax.GradientTransformation(init, update)
    if backward_passes_per_step > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=backward_passes_per_step
                              ).gradient_transformation()
    out = ShardedTransformation(tx.init, tx.update)
    out._hora_gather = gather
    out._hora_scatter = scatter
    return out


__all__ = ["ShardedOptimizer", "ShardedTransformation"]
