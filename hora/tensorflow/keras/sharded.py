"""Keras ``ShardedOptimizer`` (hora-only): ZeRO-style sharded optimizer state for ``fit``.

:func:`ShardedOptimizer` builds a runtime subclass of the wrapped optimizer's class (same name
and module, as ``DistributedOptimizer`` does) from its config. Every trainable variable is owned
by one member of the process set (the plan of :mod:`hora.core.frontend.sharding`, balanced by
bytes). Its ``apply_gradients``:

1. packs the gradients into one ``[size, width]`` tensor per dtype (row ``s``: the gradients of
   the variables shard ``s`` owns) and reduce-scatters it (one host call; ``op``, predivide
   factor and compression as ``DistributedOptimizer``);
2. applies the wrapped optimizer to this rank's variables only, so its slot variables exist for
   them only (about ``1/size`` of the unsharded slots' bytes);
3. allgathers the owners' new values into every rank's variables (one host call).

``backward_passes_per_step=N`` accumulates the gradients locally (one accumulator per
trainable variable, as ``DistributedOptimizer``'s) and reduce-scatters and applies the sums on
every N-th pass only.

Keras 3 and tf-keras (Keras 2, ``TF_USE_LEGACY_KERAS=1``) optimizers both work (both build
their slots for the variables they are given). :meth:`gather_state` / :meth:`scatter_state`
(Keras 3) give and take the full state, keyed by each variable's position, at any size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

import hora
from hora.collectives.ops import ReduceOp
from hora.core.frontend import distopt, grouped, sharding
from hora.core.frontend import objects as _objects
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.tensorflow.bridge import host_call
from hora.tensorflow.compression import Compression, Compressor
from hora.tensorflow.keras.wrapping import runtime_class
from hora.tensorflow.keras_flavor import is_keras2


class _Layout(NamedTuple):
    plan: sharding.Plan
    buckets: list[sharding.Bucket]
    shard: int
    sharded: bool


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in v.shape)


def _numel(v: Any) -> int:
    return int(np.prod(_shape(v), dtype=np.int64))


def _dtype(v: Any) -> tf.DType:
    return tf.as_dtype(v.dtype)


@dataclass
class _Hora:
    """The wrapper's own settings, in one plain object (Keras' attribute tracker would adopt
    a list of variables assigned to the optimizer as its own)."""

    name: str
    compression: type[Compressor]
    op: ReduceOp
    scale: tuple[float, float]
    process_set: ProcessSet
    passes: int = 1
    average_passes: bool = False
    keras2: bool = False
    layouts: dict[Any, _Layout] = field(default_factory=dict)
    variables: list[Any] = field(default_factory=list)
    counter: Any = None
    accumulators: list[Any] = field(default_factory=list)


class _ShardedOptimizer:
    """Methods mixed into the runtime subclass of the wrapped optimizer's class."""

    _hora_base: Any
    _hora: _Hora
    # the wrapped Keras optimizer's (annotations only: the base class provides them)
    variables: Any
    iterations: Any
    built: bool
    build: Any

    def _hora_layout(self, variables: Sequence[Any]) -> _Layout:
        ranks = tuple(self._hora.process_set.ranks or (0,))
        shard = sharding.shard_of(ranks, hora.rank())
        key = (ranks, shard, tuple(id(v) for v in variables))
        found = self._hora.layouts.get(key)
        if found is None:
            size = len(ranks) if shard is not None else 1
            the_plan = sharding.plan([_numel(v) * _dtype(v).size for v in variables], size)
            buckets = sharding.layout(the_plan, [_numel(v) for v in variables],
                                      [_dtype(v).name for v in variables])
            found = _Layout(the_plan, buckets, shard or 0, shard is not None and size > 1)
            self._hora.layouts[key] = found
        return found

    def owned_variables(self) -> list[Any]:
        """The variables whose optimizer slots live on this rank (after the first update)."""
        if not self._hora.variables:
            return []
        lay = self._hora_layout(self._hora.variables)
        return [self._hora.variables[i] for i in lay.plan.owned(lay.shard)]

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        pairs = list(grads_and_vars)
        variables = [v for _, v in pairs]
        self._hora.variables = variables
        lay = self._hora_layout(variables)
        if self._hora.passes == 1:
            return self._hora_apply(lay, [g for g, _ in pairs], variables, args, kwargs)
        return self._hora_aggregate(lay, [g for g, _ in pairs], variables, args, kwargs)

    def _hora_apply(self, lay: _Layout, grads: list[Any], variables: list[Any],
                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not lay.sharded:
            return self._hora_base.apply_gradients(self, list(zip(grads, variables)), *args,
                                                   **kwargs)
        reduced = self._hora_reduce_scatter(lay, grads, variables)
        mine = lay.plan.owned(lay.shard)
        result = self._hora_base.apply_gradients(
            self, [(reduced[i], variables[i]) for i in mine], *args, **kwargs)
        self._hora_allgather(lay, variables)
        return result

    def _hora_aggregate(self, lay: _Layout, grads: list[Any], variables: list[Any],
                        args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``backward_passes_per_step=N``: every pass adds its gradients to local accumulators;
        the N-th reduce-scatters the sums (over N with ``average_aggregated_gradients``) and
        applies them, as ``DistributedOptimizer`` does. The other passes apply nothing; with
        tf-keras ``iterations`` still advances (Horovod's helper), with Keras 3 it counts
        updates (Keras 3's ``gradient_accumulation_steps``, which its wrapper uses)."""
        h = self._hora
        mine = lay.plan.owned(lay.shard) if lay.sharded else list(range(len(variables)))
        with tf.init_scope():  # the slots and accumulators, created once, outside any branch
            iterations = self.iterations
            if not h.keras2 and not self.built:  # Keras 3 builds in apply_gradients
                self.build([variables[i] for i in mine])
            if h.counter is None:
                h.counter = tf.Variable(0, dtype=tf.int32, trainable=False,
                                        name="sharded_aggregation_counter")
                h.accumulators = [tf.Variable(tf.zeros(_shape(v), _dtype(v)), trainable=False,
                                              name=f"sharded_aggregation_{i}")
                                  for i, v in enumerate(variables)]
        if len(h.accumulators) != len(variables):
            raise ValueError(f"backward_passes_per_step: this pass has {len(variables)} "
                             f"gradients, the accumulated ones {len(h.accumulators)}; every "
                             "pass must compute gradients for the same variables.")
        for acc, g in zip(h.accumulators, grads):
            if g is not None:
                acc.assign_add(tf.cast(tf.convert_to_tensor(g), acc.dtype))
        h.counter.assign((h.counter + 1) % h.passes)

        def applied() -> Any:
            sums = [tf.convert_to_tensor(acc) for acc in h.accumulators]
            if h.average_passes:
                sums = [s / tf.cast(h.passes, s.dtype) for s in sums]
            self._hora_apply(lay, sums, variables, args, kwargs)
            for acc in h.accumulators:
                acc.assign(tf.zeros_like(acc))
            return tf.constant(True)

        def skipped() -> Any:
            if h.keras2:
                iterations.assign_add(tf.constant(1, iterations.dtype))
            return tf.constant(False)

        return tf.cond(tf.equal(h.counter, 0), applied, skipped)

    def _hora_reduce_scatter(self, lay: _Layout, grads: list[Any], variables: list[Any]
                             ) -> dict[int, Any]:
        buffers, ctxs = [], []
        for bucket in lay.buckets:
            dtype = _dtype(variables[bucket.slots[0].index])
            rows = []
            for s in range(lay.plan.size):
                parts = []
                for slot in bucket.row(s):
                    g = grads[slot.index]
                    g = tf.zeros(_shape(variables[slot.index]), dtype) if g is None else \
                        tf.convert_to_tensor(g)
                    parts.append(tf.reshape(tf.cast(g, dtype), [-1]))
                used = sum(slot.numel for slot in bucket.row(s))
                if used < bucket.width:
                    parts.append(tf.zeros([bucket.width - used], dtype))
                rows.append(tf.concat(parts, 0) if len(parts) > 1 else parts[0])
            compressed, ctx = self._hora.compression.compress(tf.stack(rows))
            buffers.append(compressed)
            ctxs.append(ctx)
        pre, post = self._hora.scale
        name, op, process_set = f"{self._hora.name}.grads", self._hora.op, self._hora.process_set

        def reduce_scatter(*arrays: np.ndarray) -> list[np.ndarray]:
            out: list[np.ndarray] = grouped.grouped_reducescatter_async(
                list(arrays), name=name, op=op, prescale_factor=pre, postscale_factor=post,
                process_set=process_set).wait()
            return out

        shares = host_call(reduce_scatter, buffers, [b.dtype for b in buffers], name=name)
        out: dict[int, Any] = {}
        for bucket, share, ctx in zip(lay.buckets, shares, ctxs):
            row = tf.reshape(self._hora.compression.decompress(share, ctx), [-1])
            for slot in bucket.row(lay.shard):
                out[slot.index] = tf.reshape(row[slot.offset:slot.offset + slot.numel],
                                             _shape(variables[slot.index]))
        return out

    def _hora_allgather(self, lay: _Layout, variables: list[Any]) -> None:
        rows = []
        for bucket in lay.buckets:
            dtype = _dtype(variables[bucket.slots[0].index])
            mine = bucket.row(lay.shard)
            parts = [tf.reshape(tf.convert_to_tensor(variables[slot.index]), [-1])
                     for slot in mine]
            used = sum(slot.numel for slot in mine)
            if used < bucket.width:
                parts.append(tf.zeros([bucket.width - used], dtype))
            rows.append(tf.reshape(tf.concat(parts, 0) if len(parts) > 1 else parts[0],
                                   [1, bucket.width]))
        name, process_set = f"{self._hora.name}.values", self._hora.process_set

        def allgather(*arrays: np.ndarray) -> list[np.ndarray]:
            out: list[np.ndarray] = grouped.grouped_allgather_async(
                list(arrays), name=name, process_set=process_set).wait()
            return out

        fulls = host_call(allgather, rows, [r.dtype for r in rows], name=name)
        for bucket, full in zip(lay.buckets, fulls):
            full = tf.reshape(full, [lay.plan.size, bucket.width])
            for slot in bucket.slots:
                if slot.shard != lay.shard:
                    v = variables[slot.index]
                    v.assign(tf.reshape(full[slot.shard, slot.offset:slot.offset + slot.numel],
                                        _shape(v)))

    # ---- the full state (Keras 3) --------------------------------------------------------------
    def _hora_slots(self, variables: Sequence[Any], indices: Sequence[int]
                    ) -> dict[int, dict[str, Any]]:
        mine: dict[int, dict[str, Any]] = {}
        own = [v for v in self.variables if v is not self.iterations]
        for i in indices:
            prefix = variables[i].path.replace("/", "_") + "_"
            found = {s.name[len(prefix):]: s for s in own if s.name.startswith(prefix)}
            if found:
                mine[i] = found
        return mine

    def _hora_build_shard(self, mine: list[Any]) -> None:
        """Slots for exactly ``mine`` (this rank's variables): built now if the optimizer is
        not; built again (the old slots dropped) if a new plan gave this rank other
        variables."""
        if self.built:
            built_for = getattr(self, "_trainable_variables", None)
            if built_for is None or {id(v) for v in built_for} == {id(v) for v in mine}:
                return
            base: Any = self
            keep = {id(v) for v in (getattr(base, "_iterations", None),
                                    getattr(base, "_learning_rate", None)) if v is not None}
            base._variables[:] = [v for v in base._variables if id(v) in keep]
            base._trainable_variables_indices = {}
            self.built = False
        self.build(mine)

    def _hora_elastic_handler(self, model: Any) -> Any:
        """The elastic state of this optimizer for ``TensorFlowKerasState`` / ``KerasState``
        (:class:`~hora.tensorflow.keras.sharded_elastic.ShardedKerasStateHandler`)."""
        from hora.tensorflow.keras.sharded_elastic import ShardedKerasStateHandler

        return ShardedKerasStateHandler(self, model)

    def gather_state(self) -> dict[str, Any]:
        """The full state (Keras 3): ``{"iterations": n, "slots": {index: {slot name: array}}}``
        with ``index`` the variable's position in the trainable variables. Collective."""
        variables = self._hora.variables
        lay = self._hora_layout(variables)
        mine = {i: {k: np.asarray(s.numpy()) for k, s in slots.items()}
                for i, slots in self._hora_slots(variables, lay.plan.owned(lay.shard)).items()}
        if lay.sharded:
            parts = _objects.allgather_object(mine, name=f"{self._hora.name}.gather_state",
                                              process_set=self._hora.process_set)
            mine = sharding.merge_states(parts)
        return {"iterations": int(self.iterations.numpy()), "slots": mine}

    def scatter_state(self, full: dict[str, Any], variables: Sequence[Any]) -> None:
        """Load this rank's shard of a full state (from :meth:`gather_state`, any size) for
        ``variables`` (the model's trainable variables, in the order ``fit`` uses)."""
        variables = list(variables)
        self._hora.variables = variables
        lay = self._hora_layout(variables)
        mine = lay.plan.owned(lay.shard)
        self._hora_build_shard([variables[i] for i in mine])
        slots = self._hora_slots(variables, mine)
        for i, wanted in sharding.select_states(full["slots"], mine).items():
            for name, value in wanted.items():
                slots[int(i)][name].assign(value)
        self.iterations.assign(full["iterations"])


def _check_global_clipnorm(optimizer: Any) -> None:
    """Keras 3 and tf-keras (v2.11+ and legacy) keep ``global_clipnorm`` in their config and
    as an attribute; the sharded optimizer hands Keras this rank's gradients only."""
    value = optimizer.get_config().get("global_clipnorm")
    if value is None:
        value = getattr(optimizer, "global_clipnorm", None)
    if value is not None:
        raise ValueError(f"ShardedOptimizer applies {type(optimizer).__name__} to this rank's "
                         f"variables only, so global_clipnorm={value} would be the norm of this "
                         f"rank's gradients, not of all: build the optimizer with clipnorm= "
                         f"(per variable, exact under sharding) or without clipping, or use "
                         f"DistributedOptimizer for global_clipnorm")


def ShardedOptimizer(optimizer: Any, name: str | None = None,  # noqa: N802 - Horovod-style
                     compression: type[Compressor] = Compression.none,
                     gradient_predivide_factor: float = 1.0, op: int = ReduceOp.Average,
                     process_set: ProcessSet = global_process_set,
                     backward_passes_per_step: int = 1,
                     average_aggregated_gradients: bool = False) -> Any:
    """Wrap a Keras optimizer (hora-only): gradients averaged across the process set as
    ``DistributedOptimizer`` does, slot variables sharded across its members.

    Args:
        optimizer: a Keras 3 optimizer or a tf-keras one; the result is a fresh instance of its
            class (same name), built from its config.
        name: prefix of the collectives' names (default ``Sharded<class name>``).
        compression: ``Compression.none`` or ``Compression.fp16`` (gradients only).
        gradient_predivide_factor: Average is done as ``1/f`` before and ``f/size`` after.
        op: Average (default) or Sum.
        process_set: the members that average and share the slots; other ranks apply the whole
            optimizer to their own gradients.
        backward_passes_per_step: passes accumulated locally before each reduce-scatter and
            update (``DistributedOptimizer``'s local aggregation).
        average_aggregated_gradients: average (True) or sum (False, Horovod's default) the
            locally accumulated gradients.

    Raises:
        ValueError: an op other than Average / Sum, invalid options, or an optimizer built with
            ``global_clipnorm`` (Keras would compute the norm over this rank's gradients only;
            ``clipnorm`` and ``clipvalue``, per variable, are exact).
    """
    distopt.check_options(op, gradient_predivide_factor, backward_passes_per_step, 0, None)
    _check_global_clipnorm(optimizer)
    if ReduceOp(op) not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"ShardedOptimizer reduce-scatters gradients: op must be Average or "
                         f"Sum, not {ReduceOp(op).name}")
    base = optimizer.__class__
    cls = runtime_class(base, _ShardedOptimizer)
    opt = cls.from_config(optimizer.get_config())
    opt._hora = _Hora(name or f"Sharded{base.__name__}", compression, ReduceOp(op),
                      distopt.scale_factors(op, gradient_predivide_factor), process_set,
                      backward_passes_per_step, average_aggregated_gradients,
                      is_keras2(optimizer))
    return opt


__all__ = ["ShardedOptimizer"]
