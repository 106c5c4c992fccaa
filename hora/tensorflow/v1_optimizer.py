"""``hora.tensorflow.DistributedOptimizer``: Horovod's optimizer wrapper for
``tf.compat.v1.train.Optimizer`` subclasses (TF1 graphs and sessions, and TF2 eagerly or in
``tf.function``); Keras optimizers are handed to :func:`hora.tensorflow.keras.DistributedOptimizer`.

* :class:`_DistributedOptimizer` overrides ``compute_gradients``: the wrapped optimizer's
  gradients are reduced (``op``, default Average) by the
  :class:`~hora.tensorflow.gradients.GradientReducer` that the tape and the Keras optimizers use
  (one fused host call for the dense gradients; groups, compression, sparse allgathers, local
  variables). ``apply_gradients`` is the wrapped optimizer's. ``backward_passes_per_step > 1``
  accumulates locally in a TF1 graph (:mod:`hora.tensorflow.v1_aggregation`).
* :class:`_DistributedAdasumOptimizer` (``op=hvd.Adasum``) is Horovod's delta optimizer: each
  rank applies the wrapped optimizer to its own gradients; every ``backward_passes_per_step``
  updates the change of every variable since the last combination (``var - delta_start``) is
  combined with Adasum through the same reducer, and ``var = delta_start = delta_start +
  adasum(delta)`` on every rank (the model of the Keras delta optimizer,
  :mod:`hora.tensorflow.keras.adasum_optimizer`).

In a TF1 graph nothing orders ops that do not depend on each other: a reduction that needs more
than one host call (sparse gradients) runs inside one ``tf.function`` call, whose stateful ops
run in program order on every rank.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from hora.collectives.ops import ReduceOp
from hora.core.frontend import distopt
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.tensorflow.compression import Compression, Compressor
from hora.tensorflow.gradients import GradientReducer
from hora.tensorflow.keras_flavor import is_keras2
from hora.tensorflow.v1_aggregation import LocalAggregation, reduce_in_order

_LegacyOptimizer = tf.compat.v1.train.Optimizer


class _DistributedOptimizer(_LegacyOptimizer):  # type: ignore[misc,valid-type]
    """A ``tf.compat.v1.train.Optimizer`` whose ``compute_gradients`` reduces across ranks."""

    def __init__(self, optimizer: Any, name: str, use_locking: bool, reducer: GradientReducer,
                 backward_passes_per_step: int, average_aggregated_gradients: bool,
                 sparse_as_dense: bool) -> None:
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._reducer = reducer
        self._agg: LocalAggregation | None = None
        if backward_passes_per_step > 1:
            if tf.executing_eagerly():
                raise ValueError("backward_passes_per_step > 1 is not yet supported for "
                                 "_LegacyOptimizer with eager execution.")
            self._agg = LocalAggregation(
                backward_passes_per_step, average_aggregated_gradients, sparse_as_dense,
                lambda g, v: reduce_in_order(reducer, g, v), name)

    def register_local_var(self, var: Any) -> None:
        """Leave ``var``'s gradient out of the reduction (divided by the set size instead, when
        ``scale_local_gradients``)."""
        self._reducer.register_local(var)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's ``(gradient, variable)`` pairs, gradients reduced across
        the process set (``None`` stays ``None``)."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        if self._agg is not None:
            reduced = self._agg.compute_gradients(grads, variables)
        else:
            reduced = reduce_in_order(self._reducer, grads, variables)
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                        name: str | None = None) -> Any:
        """The wrapped optimizer's ``apply_gradients`` (every N-th pass only, with
        ``backward_passes_per_step=N``)."""
        pairs = list(grads_and_vars)

        def apply() -> Any:
            return self._optimizer.apply_gradients(pairs, global_step=global_step, name=name)
        if self._agg is not None:
            return self._agg.apply_gradients(apply, [g for g, _ in pairs], global_step)
        return apply()

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's slot."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's slot names."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's variables."""
        return self._optimizer.variables(*args, **kwargs)


class _DistributedAdasumOptimizer(_LegacyOptimizer):  # type: ignore[misc,valid-type]
    """Horovod's Adasum delta optimizer for ``tf.compat.v1.train`` optimizers."""

    def __init__(self, optimizer: Any, name: str, use_locking: bool, reducer: GradientReducer,
                 backward_passes_per_step: int) -> None:
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._reducer = reducer
        self._passes = backward_passes_per_step
        self._local: set[int] = set()

    def register_local_var(self, var: Any) -> None:
        """Leave ``var`` out of the combination: it keeps this rank's own updates (hora-only:
        Horovod's TF1 delta optimizer has no local variables)."""
        self._local.add(id(var))

    def compute_gradients(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's local gradients (the deltas are combined, not these)."""
        return self._optimizer.compute_gradients(*args, **kwargs)

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                        name: str | None = None) -> Any:
        """Apply the local gradients with the wrapped optimizer, then, on every N-th call,
        combine each variable's change since the last combination with Adasum."""
        pairs = list(grads_and_vars)
        variables = [v for g, v in pairs if g is not None]
        with tf.init_scope():
            starts = [self._zeros_slot(v, "delta_start", self._name) for v in variables]
            first = variables[0] if variables else None
            self._create_non_slot_variable(tf.constant(0, tf.int64), "delta_step", first)
        step = self._get_non_slot_variable("delta_step", None if tf.executing_eagerly()
                                           else tf.compat.v1.get_default_graph())

        def take_starts() -> Any:
            return tf.group(*[s.assign(v) for s, v in zip(starts, variables)])
        init = tf.cond(tf.equal(step, 0), take_starts, tf.no_op)
        with tf.control_dependencies([init]):
            update = self._optimizer.apply_gradients(pairs, global_step=global_step, name=name)
        shared = [(v, s) for v, s in zip(variables, starts) if id(v) not in self._local]

        def combine() -> Any:
            deltas = [v - s for v, s in shared]
            combined = reduce_in_order(self._reducer, deltas, [v for v, _ in shared])
            assigns = []
            for (v, s), d in zip(shared, combined):
                new_start = s.assign_add(d)
                assigns.append(v.assign(new_start))
            return tf.group(*assigns)
        with tf.control_dependencies([update] if update is not None else []):
            sync = tf.cond(tf.equal(step % self._passes, self._passes - 1), combine, tf.no_op)
        with tf.control_dependencies([sync] if sync is not None else []):
            return step.assign_add(1)

    def get_slot(self, var: Any, name: str) -> Any:
        """This optimizer's ``delta_start`` slot, or the wrapped optimizer's slot."""
        own = super().get_slot(var, name)
        return own if own is not None else self._optimizer.get_slot(var, name)

    def get_slot_names(self) -> list[str]:
        """``delta_start`` and the wrapped optimizer's slot names."""
        return list(super().get_slot_names()) + list(self._optimizer.get_slot_names())

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's variables."""
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer: Any, name: str | None = None,  # noqa: N802 - Horovod's
                         use_locking: bool = False, device_dense: str = "",
                         device_sparse: str = "",
                         compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                         op: int = ReduceOp.Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap ``optimizer`` so that gradients are reduced (``op``) across ``process_set`` before
    they are applied (Horovod's ``horovod.tensorflow.DistributedOptimizer``).

    A ``tf.compat.v1.train.Optimizer`` is wrapped here (``op=Adasum``: the delta optimizer);
    a Keras optimizer (Keras 3, or tf-keras's Keras 2) goes to
    :func:`hora.tensorflow.keras.DistributedOptimizer` with every argument it takes (Horovod
    passes neither ``op`` nor ``groups`` on and refuses Adasum there; hora passes both, and
    Keras 3 Adasum is the delta optimizer too).

    Args:
        name: prefix of the reduction names (default ``Distributed<class name>``, with Adasum
            ``DistributedDelta<class name>``).
        use_locking: the wrapped optimizer's locking flag for this wrapper's own updates.
        backward_passes_per_step: passes accumulated locally before each reduction and
            update (TF1 graphs only for the Average/Sum optimizer, as in Horovod).
        average_aggregated_gradients: average (True) or sum (False) the accumulated passes.
        groups, num_groups, compression, sparse_as_dense, gradient_predivide_factor,
            process_set, scale_local_gradients: as for ``DistributedGradientTape``.

    ``device_dense`` / ``device_sparse`` are accepted for Horovod compatibility.

    Raises:
        ValueError: invalid options (Horovod's texts), Adasum with
            ``average_aggregated_gradients``, ``backward_passes_per_step > 1`` eagerly with a
            TF1 optimizer, or an object that is neither kind of optimizer.
        NotImplementedError: Adasum with a non-global process set, or on a number of ranks
            (hosts, when hierarchical) that is not a power of two.
    """
    if ReduceOp(op) is ReduceOp.Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    if isinstance(optimizer, keras.optimizers.Optimizer) or is_keras2(optimizer):
        from hora.tensorflow import keras as hora_keras

        return hora_keras.DistributedOptimizer(
            optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
            compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
            groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)
    if not isinstance(optimizer, _LegacyOptimizer):
        raise ValueError("Provided optimizer doesn't inherit from either legacy TensorFlow or "
                         f"Keras optimizer: {optimizer}")
    groups = distopt.check_options(op, gradient_predivide_factor, backward_passes_per_step,
                                   num_groups, groups)
    if isinstance(groups, list):
        distopt.check_explicit_groups(groups, lambda v: hasattr(v, "shape"), "tf.Variable")
    delta = distopt.adasum_active(op, process_set)
    prefix = name or f"{'DistributedDelta' if delta else 'Distributed'}{type(optimizer).__name__}"
    reducer = GradientReducer(prefix, compression, sparse_as_dense, op,
                              gradient_predivide_factor, groups, process_set,
                              scale_local_gradients)
    if delta:
        return _DistributedAdasumOptimizer(optimizer, prefix, use_locking, reducer,
                                           backward_passes_per_step)
    return _DistributedOptimizer(optimizer, prefix, use_locking, reducer,
                                 backward_passes_per_step, average_aggregated_gradients,
                                 sparse_as_dense)


__all__ = ["DistributedOptimizer", "reduce_in_order"]
