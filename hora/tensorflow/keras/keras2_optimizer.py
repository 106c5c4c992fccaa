"""Keras 2 (tf-keras) ``DistributedOptimizer``: Horovod's Keras 2 wrapper semantics.

With ``TF_USE_LEGACY_KERAS=1`` (``pip install tf-keras``) ``tf.keras`` is Keras 2, and its
optimizers (``tf.keras.optimizers.*``, the v2.11+ ones, and ``tf.keras.optimizers.legacy.*``)
are wrapped here, as Horovod 0.28 wraps them:

* a runtime subclass of the optimizer's class under its name and module
  (:func:`~hora.tensorflow.keras.wrapping.runtime_class`), created with ``from_config`` of the
  optimizer's config: ``get_config`` / ``from_config`` round-trip, and every instance the class
  makes (``opt.from_config(cfg)``, a loaded model's optimizer) reduces too;
* the gradients are reduced where Keras 2 computes them: ``_compute_gradients`` (what
  ``minimize`` and ``model.fit`` call on a legacy optimizer; Horovod's entry point, on both
  kinds here), ``compute_gradients`` (``minimize`` of a v2.11+ optimizer) and ``get_gradients``
  (TF1 graph-mode Keras), with a :class:`~hora.tensorflow.gradients.GradientReducer` (one fused
  host call per step); ``apply_gradients`` with gradients computed elsewhere does not reduce,
  as in Horovod (use ``hvd.DistributedGradientTape`` for those);
* ``backward_passes_per_step=N``: :class:`KerasAggregation`, Horovod's local gradient
  aggregation helper (``opt._agg_helper``; its ``counter`` is a ``tf.Variable``): every pass adds
  its gradients to local accumulators; on the N-th the accumulated sums are reduced (divided by N
  with ``average_aggregated_gradients``) and applied; on the other passes nothing is applied and
  ``iterations`` still advances. Sparse gradients need ``sparse_as_dense=True`` there (Horovod's
  ``ValueError`` otherwise);
* ``register_local_var(var)``: ``var``'s gradient stays local (divided by the set size with
  ``scale_local_gradients``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from hora.tensorflow.gradients import GradientReducer
from hora.tensorflow.keras.wrapping import Options, loading_class, runtime_class
from hora.tensorflow.v1_aggregation import LocalAggregation, reduce_in_order

log = logging.getLogger(__name__)


class KerasAggregation(LocalAggregation):
    """``backward_passes_per_step`` for a Keras 2 optimizer, eagerly and in ``tf.function``
    (Horovod's ``LocalGradientAggregationHelper``): the TF1 helper's arithmetic over TensorFlow 2
    variables (in TF1 graph-mode Keras over its graph variables, initialized in Keras's session,
    as Horovod does). ``counter`` (int32) counts the passes since the last reduction."""

    def __init__(self, passes: int, average: bool, sparse_as_dense: bool,
                 reduce_fn: Callable[[list[Any], list[Any]], list[Any]], name: str) -> None:
        super().__init__(passes, average, sparse_as_dense, reduce_fn, name)
        self.graph_mode = not tf.compat.v1.executing_eagerly_outside_functions()
        if not self.graph_mode:
            with tf.init_scope():
                self.counter = tf.Variable(0, dtype=tf.int32, trainable=False,
                                           name="aggregation_counter")
        self.accumulators: list[Any] = []

    def _variables(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        if self.graph_mode:  # TF1 graph-mode Keras: the TF1 helper's local variables,
            accs = super()._variables(grads, variables)  # initialized in Keras's session
            session = tf.compat.v1.keras.backend.get_session(op_input_list=())
            session.run(tf.compat.v1.variables_initializer([self.counter, *accs]))
            return accs
        if not self.accumulators:
            with tf.init_scope():  # created once, eagerly, also when first called in a trace
                self.accumulators = [
                    tf.Variable(tf.zeros(g.shape if g.shape.is_fully_defined() else v.shape,
                                         g.dtype), trainable=False, name=f"aggregation_{i}")
                    for i, (g, v) in enumerate(zip(grads, variables))]
        elif len(self.accumulators) != len(grads):
            raise ValueError(f"backward_passes_per_step: this pass has {len(grads)} gradients, "
                             f"the accumulated ones {len(self.accumulators)}; every pass must "
                             "compute gradients for the same variables.")
        return self.accumulators

    def apply_keras(self, apply: Callable[[], Any], optimizer: Any, grads: list[Any]) -> Any:
        """``apply()`` on the passes whose gradients were reduced (the count is back at 0);
        on the others ``optimizer.iterations`` advances by one. Returns whether it applied.
        ``grads`` (this pass's, from :meth:`compute_gradients`) order a TF1 graph: the count
        is read after they were computed."""
        with tf.init_scope():  # a legacy optimizer creates `iterations` on first access
            iterations = optimizer.iterations

        def after(op: Any, value: bool) -> Any:  # in a TF1 graph a branch runs only what
            deps = [] if op is None or tf.executing_eagerly() else [op]  # its output needs
            with tf.control_dependencies(deps):
                return tf.identity(tf.constant(value))

        def applied() -> Any:
            return after(apply(), True)

        def skipped() -> Any:
            return after(iterations.assign_add(tf.constant(1, iterations.dtype)), False)

        deps = [] if tf.executing_eagerly() else [g for g in grads if g is not None]
        with tf.control_dependencies(deps):
            return tf.cond(tf.equal(self.counter, 0), applied, skipped)


class _Keras2DistributedOptimizer:
    """Methods mixed into the runtime subclass of a tf-keras optimizer's class."""

    _hora_base: Any
    _hora_options: Options
    _hora_reducer: GradientReducer
    _agg_helper: KerasAggregation | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._hora_base.__init__(self, *args, **kwargs)
        options = type(self)._hora_options
        reducer = options.reducer()
        self._hora_reducer = reducer
        self._agg_helper = None
        if options.backward_passes_per_step > 1:
            self._agg_helper = KerasAggregation(
                options.backward_passes_per_step, options.average_aggregated_gradients,
                options.sparse_as_dense, lambda g, v: reduce_in_order(reducer, g, v),
                options.prefix)

    def register_local_var(self, var: Any) -> None:
        """Leave ``var``'s gradient out of the allreduce (divided by the set size instead, when
        ``scale_local_gradients``)."""
        self._hora_reducer.register_local(var)

    def _hora_allreduce(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        if self._agg_helper is not None:
            return self._agg_helper.compute_gradients(grads, variables)
        return reduce_in_order(self._hora_reducer, grads, variables)

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None,
                           tape: Any = None) -> list[tuple[Any, Any]]:
        """The wrapped class's ``(gradient, variable)`` pairs, gradients reduced across the
        process set (accumulated first with ``backward_passes_per_step``)."""
        base = self._hora_base
        if hasattr(base, "_compute_gradients"):  # legacy optimizer_v2
            pairs = base._compute_gradients(self, loss, var_list, grad_loss=grad_loss, tape=tape)
        else:
            if grad_loss is not None:
                raise ValueError("grad_loss is only supported by tf-keras legacy optimizers "
                                 "(tf.keras.optimizers.legacy.*)")
            pairs = base.compute_gradients(self, loss, var_list, tape=tape)
        pairs = list(pairs)
        if not pairs:
            return pairs
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        return list(zip(self._hora_allreduce(grads, variables), variables))

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None
                          ) -> list[tuple[Any, Any]]:
        """``minimize``'s gradients (v2.11+ optimizers), reduced: :meth:`_compute_gradients`."""
        return self._compute_gradients(loss, var_list, tape=tape)

    def get_gradients(self, loss: Any, params: Any) -> list[Any]:
        """The gradients of TF1 graph-mode Keras (legacy optimizers), reduced."""
        params = list(params)
        grads = list(self._hora_base.get_gradients(self, loss, params))
        return self._hora_allreduce(grads, params)

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        """The wrapped class's ``apply_gradients``; with ``backward_passes_per_step=N`` only on
        every N-th pass (``iterations`` advances on the others)."""
        if self._agg_helper is None:
            return self._hora_base.apply_gradients(self, grads_and_vars, *args, **kwargs)
        pairs = list(grads_and_vars)
        return self._agg_helper.apply_keras(
            lambda: self._hora_base.apply_gradients(self, pairs, *args, **kwargs), self,
            [g for g, _ in pairs])


_ONLY_IF_BASE_HAS = ("compute_gradients", "get_gradients")


def build(optimizer: Any, options: Options) -> Any:
    """The distributed optimizer for the tf-keras ``optimizer`` (see the module docstring)."""
    base = type(optimizer)
    cls = runtime_class(base, _Keras2DistributedOptimizer,
                        tuple(k for k in _ONLY_IF_BASE_HAS if not hasattr(base, k)),
                        _hora_options=options)
    log.debug("DistributedOptimizer: tf-keras %s.%s (%s)", base.__module__, base.__name__,
              options.prefix)
    return cls.from_config(optimizer.get_config())


def _classes(namespace: Any, root: type) -> dict[str, Any]:
    return {c.__name__: c for c in vars(namespace).values()
            if isinstance(c, type) and issubclass(c, root) and c is not root}


def load_objects(keras: Any, custom_optimizers: Any, wrap: Callable[[Any], Any],
                 legacy_opts: bool) -> dict[str, Any]:
    """``load_model``'s custom objects for tf-keras (``keras``: the ``tf.keras`` module): every
    built-in optimizer name (as saved, and lower-case: tf-keras looks built-ins up that way) and
    each of ``custom_optimizers``, loading the optimizer wrapped by ``wrap``
    (``DistributedOptimizer``). A built-in name loads the legacy class when ``legacy_opts`` or
    when the saved config is a legacy optimizer's (no ``is_legacy_optimizer: False``), as
    tf-keras decides."""
    new = _classes(keras.optimizers, keras.optimizers.Optimizer)
    legacy = _classes(keras.optimizers.legacy, keras.optimizers.legacy.Optimizer)
    objects: dict[str, Any] = {}
    for name in sorted(set(new) | set(legacy)):
        def make(config: dict[str, Any], name: str = name) -> Any:
            use_legacy = name in legacy and (
                legacy_opts or name not in new or config.get("is_legacy_optimizer", True))
            if use_legacy:
                config.pop("is_legacy_optimizer", None)
            cls = legacy[name] if use_legacy else new[name]
            return wrap(cls.from_config(config))
        objects[name] = objects[name.lower()] = loading_class(new.get(name) or legacy[name], make)
    for cls in custom_optimizers or []:
        def make_custom(config: dict[str, Any], cls: Any = cls) -> Any:
            return wrap(cls.from_config(config))
        objects[cls.__name__] = loading_class(cls, make_custom)
    return objects


__all__ = ["KerasAggregation", "build", "load_objects"]
