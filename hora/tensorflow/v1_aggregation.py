"""``backward_passes_per_step`` for ``tf.compat.v1.train`` optimizers in a TF1 graph (Horovod's
``LocalGradientAggregationHelper``, graph mode only, as Horovod's).

Each run of the training op adds this pass's gradients to one accumulator variable per
gradient (``tf.compat.v1.GraphKeys.LOCAL_VARIABLES``, under ``aggregation_variables_<name>``:
run ``tf.compat.v1.local_variables_initializer()``, which ``MonitoredTrainingSession`` does) and
counts the pass. On the N-th pass the accumulated gradients are reduced across ranks (divided by
N with ``average_aggregated_gradients``), the count starts again, and the wrapped optimizer
applies them; on the other passes nothing is applied and ``global_step`` (if given) still
advances, so it counts passes as in Horovod.

:func:`reduce_in_order` runs a reduction of several host calls (sparse gradients) in one order on
every rank of a TF1 graph (the optimizers of :mod:`hora.tensorflow.v1_optimizer` and tf-keras's,
:mod:`hora.tensorflow.keras.keras2_optimizer`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from hora.tensorflow.gradients import GradientReducer


def reduce_in_order(reducer: GradientReducer, grads: list[Any], variables: list[Any]) -> list[Any]:
    """``reducer(grads, variables)``; in a TF1 graph with sparse gradients (several host
    calls) inside one ``tf.function`` call, so that every rank runs them in the same order."""
    sparse = any(isinstance(g, tf.IndexedSlices) for g in grads)
    if not sparse or tf.executing_eagerly() or tf.inside_function():
        return reducer(grads, variables)
    live = [i for i, g in enumerate(grads) if g is not None]
    live_vars = [variables[i] for i in live]
    reduced = tf.function(lambda gs: reducer(gs, live_vars), autograph=False)(
        [grads[i] for i in live])
    out = list(grads)
    for i, r in zip(live, reduced):
        out[i] = r
    return out


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


class LocalAggregation:
    """Accumulate ``passes`` gradients locally, reduce and apply on the last (see the
    module docstring). ``reduce_fn(grads, variables)`` reduces a list of dense gradients."""

    def __init__(self, passes: int, average: bool, sparse_as_dense: bool,
                 reduce_fn: Callable[[list[Any], list[Any]], list[Any]], name: str) -> None:
        self.passes = passes
        self.average = average
        self.sparse_as_dense = sparse_as_dense
        self.reduce_fn = reduce_fn
        self.scope = f"aggregation_variables_{name}"
        self.counter: Any = None

    def _dense(self, grad: Any) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            if not self.sparse_as_dense:
                raise ValueError("IndexedSlices are not supported when `backward_passes_per_step`"
                                 " > 1 and `sparse_as_dense` is False.")
            return tf.convert_to_tensor(grad)
        return grad

    def _variables(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        """The counter and one accumulator per gradient (``variables``: the gradients'
        variables, for subclasses that shape accumulators after them)."""
        local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
        with tf.compat.v1.variable_scope(self.scope, reuse=tf.compat.v1.AUTO_REUSE):
            self.counter = tf.compat.v1.get_variable(
                "aggregation_counter", shape=(), dtype=tf.int32, trainable=False,
                initializer=tf.compat.v1.zeros_initializer(), collections=local)
            return [tf.compat.v1.get_variable(
                str(i), initializer=tf.zeros(g.shape.as_list(), g.dtype), trainable=False,
                collections=local) for i, g in enumerate(grads)]

    def compute_gradients(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        """This pass's gradients added to the accumulators; on the last pass the reduced
        accumulated gradients (else this pass's own, which are not applied). ``None`` stays
        ``None``."""
        live = [i for i, g in enumerate(grads) if g is not None]
        dense = [self._dense(grads[i]) for i in live]
        live_vars = [variables[i] for i in live]
        accs = self._variables(dense, live_vars)
        counter = self.counter
        clear = tf.cond(tf.equal(counter, 0),
                        lambda: tf.group(*[a.assign(tf.zeros_like(a)) for a in accs]), tf.no_op)
        with tf.control_dependencies([clear]):
            adds = [a.assign_add(g) for a, g in zip(accs, dense)]
        with tf.control_dependencies(adds):
            bump = counter.assign_add(1)

        def reduce() -> list[Any]:
            reduced = self.reduce_fn([a.read_value() for a in accs], live_vars)
            with tf.control_dependencies(reduced):
                reset = counter.assign(0)
            with tf.control_dependencies([reset]):
                return [r / self.passes if self.average else tf.identity(r) for r in reduced]

        with tf.control_dependencies([bump]):
            out = _as_list(tf.cond(tf.equal(counter.read_value(), self.passes), reduce,
                                   lambda: [tf.identity(g) for g in dense])) if live else []
        result: list[Any] = [None] * len(grads)
        for i, r in zip(live, out):
            result[i] = r
        return result

    def apply_gradients(self, apply: Callable[[], Any], grads: list[Any],
                        global_step: Any) -> Any:
        """``apply()`` on the passes whose gradients were reduced (the count is back at 0);
        on the others only ``global_step`` advances."""
        def step_only() -> Any:
            if global_step is None:
                return tf.no_op()
            return global_step.assign_add(tf.constant(1, global_step.dtype.base_dtype),
                                          read_value=False)

        with tf.control_dependencies([g for g in grads if g is not None]):
            train = tf.cond(tf.equal(self.counter.read_value(), 0), apply, step_only)
        return train


__all__ = ["LocalAggregation", "reduce_in_order"]
