"""Keras 3 ``DistributedOptimizer``: gradients averaged across ranks before every update.

As in Horovod, :func:`DistributedOptimizer` builds a class at runtime that inherits from the
wrapped optimizer's class **under the same name and module** (so a saved model reloads without
hora) and instantiates it from the wrapped optimizer's config (fresh slots). Keras 3 runs every
update through ``BaseOptimizer._backend_apply_gradients``, which clips the gradients
(``_clip_gradients``) exactly once per update, right before the update step: the runtime class
reduces the gradients there, with a :class:`~hora.tensorflow.gradients.GradientReducer` (one
fused host call; in ``model.fit`` one ``tf.numpy_function`` op in the train step).

``backward_passes_per_step=N`` uses Keras 3's own gradient accumulation
(``gradient_accumulation_steps``): ranks accumulate locally and allreduce only on every N-th
step. Keras averages the accumulated gradients; with ``average_aggregated_gradients=False``
(Horovod's default) the reduced sum is restored by a factor N.

These are Keras 3 internals (``_backend_apply_gradients``, ``_clip_gradients``): hora checks
that they exist when it wraps an optimizer.

A tf-keras (Keras 2) optimizer is wrapped by :mod:`hora.tensorflow.keras.keras2_optimizer`
(Horovod's Keras 2 wrapper) with the same checked options and the same kind of runtime class
(:mod:`hora.tensorflow.keras.wrapping`).
"""

from __future__ import annotations

from typing import Any

import keras

from hora.collectives.ops import ReduceOp
from hora.core.frontend import distopt
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.tensorflow.compression import Compression, Compressor
from hora.tensorflow.gradients import GradientReducer
from hora.tensorflow.keras.wrapping import Options, runtime_class
from hora.tensorflow.keras_flavor import is_keras2

_HOOKS = ("_backend_apply_gradients", "_clip_gradients")


class _DistributedOptimizer(keras.optimizers.Optimizer):
    """Methods mixed into the runtime subclass of the wrapped optimizer's class."""

    _hora_base: Any = keras.optimizers.Optimizer
    _hora_reducer: GradientReducer
    _hora_sum_factor: float = 1.0
    _hora_variables: list[Any]

    def _backend_apply_gradients(self, grads: Any, trainable_variables: Any) -> Any:
        # object.__setattr__: Keras tracks variables in lists assigned to an optimizer, so a
        # plain assignment made the model's weights part of optimizer.variables (and of its
        # checkpoints, which a plain optimizer then could not load).
        object.__setattr__(self, "_hora_variables", list(trainable_variables))
        return self._hora_base._backend_apply_gradients(self, grads, trainable_variables)

    def _clip_gradients(self, grads: Any) -> Any:
        # (the sum factor of backward_passes_per_step: in the allreduce's postscale)
        reduced = self._hora_reducer(list(grads), self._hora_variables, self._hora_sum_factor)
        return self._hora_base._clip_gradients(self, reduced)

    def register_local_var(self, var: Any) -> None:
        """Leave ``var``'s gradient out of the allreduce (divided by the set size instead, when
        ``scale_local_gradients``)."""
        self._hora_reducer.register_local(var)


def _build(optimizer: Any, options: Options, mixin: type = _DistributedOptimizer) -> Any:
    base = optimizer.__class__
    missing = [h for h in _HOOKS if not hasattr(base, h)]
    if missing:
        raise TypeError(f"DistributedOptimizer needs a Keras 3 optimizer (or a tf-keras one); "
                        f"{base.__name__} has no {', '.join(missing)} "
                        f"(keras {keras.__version__}).")
    cls = runtime_class(base, mixin)
    passes = options.backward_passes_per_step
    config = optimizer.get_config()
    if passes > 1:
        config["gradient_accumulation_steps"] = passes
    opt = cls.from_config(config)
    opt._hora_reducer = options.reducer()
    object.__setattr__(opt, "_hora_variables", [])
    if passes > 1 and not options.average_aggregated_gradients:
        opt._hora_sum_factor = float(passes)
    return opt


def DistributedOptimizer(optimizer: Any, name: str | None = None,  # noqa: N802 - Horovod's
                         device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: int = ReduceOp.Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap a Keras optimizer so that gradients are averaged (``op``) across ``process_set``
    before each update.

    Args:
        optimizer: any Keras 3 optimizer, or a tf-keras (Keras 2) one, new or legacy
            (:mod:`hora.tensorflow.keras.keras2_optimizer`); the result is a fresh instance of
            its class (same name) built from its config.
        name: prefix of the allreduce names (default ``Distributed<class name>``).
        compression: ``Compression.none`` or ``Compression.fp16`` (or your own compressor).
        sparse_as_dense: allreduce ``tf.IndexedSlices`` gradients as dense tensors.
        gradient_predivide_factor: Average is done as ``1/f`` before and ``f/size`` after.
        op: ``Average`` (default), ``Sum``, or ``Adasum``: Horovod's Adasum delta optimizer
            (each rank updates locally, the weight changes are combined with Adasum; global
            process set, 2^k ranks or hosts; :mod:`hora.tensorflow.keras.adasum_optimizer`;
            Horovod refuses Adasum with Keras optimizers).
        backward_passes_per_step: steps accumulated locally before each allreduce and update.
        average_aggregated_gradients: average (True) or sum (False, Horovod's default) the
            locally accumulated gradients.
        num_groups: deprecated, use ``groups``.
        groups: an int k (k grouped allreduces) or a list of lists of variables.
        scale_local_gradients: divide gradients of ``register_local_var`` variables by the
            set size.

    Raises:
        ValueError: an op other than Average/Sum/Adasum (Average/Sum for tf-keras), or
            invalid options (see :mod:`hora.core.frontend.distopt`).
        NotImplementedError: ``op=Adasum`` with a process set other than the global one, or
            ranks (hosts, when hierarchical) that are not a power of two.
    """
    if ReduceOp(op) not in (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum):
        raise ValueError(f"DistributedOptimizer supports op=Average, op=Sum or op=Adasum, not "
                         f"{ReduceOp(op).name}.")
    groups = distopt.check_options(op, gradient_predivide_factor, backward_passes_per_step,
                                   num_groups, groups)
    if isinstance(groups, list):
        distopt.check_explicit_groups(groups, lambda v: hasattr(v, "shape"), "Keras variables")
    keras2 = is_keras2(optimizer)
    if keras2 and ReduceOp(op) is ReduceOp.Adasum:
        raise ValueError("op=Adasum (hora's delta optimizer) needs a Keras 3 optimizer; with "
                         "tf-keras, DistributedOptimizer supports op=Average or op=Sum, as "
                         "Horovod's does.")
    delta = distopt.adasum_active(op, process_set)
    kind = "DistributedDelta" if delta else "Distributed"  # Horovod's TF1 prefixes
    options = Options(name or f"{kind}{type(optimizer).__name__}", compression,
                      sparse_as_dense, op, gradient_predivide_factor, groups, process_set,
                      scale_local_gradients, backward_passes_per_step,
                      average_aggregated_gradients)
    if keras2:
        from hora.tensorflow.keras.keras2_optimizer import build as build_keras2

        return build_keras2(optimizer, options)
    if delta:
        from hora.tensorflow.keras.adasum_optimizer import _DistributedAdasumOptimizer

        return _build(optimizer, options, _DistributedAdasumOptimizer)
    return _build(optimizer, options)


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None,  # noqa: N802
                                device_dense: str = "", device_sparse: str = "",
                                compression: type[Compressor] = Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0,
                                op: int = ReduceOp.Average, backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False, groups: Any = None,
                                process_set: ProcessSet = global_process_set,
                                local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """:func:`DistributedOptimizer` whose gradients for the trainable weights of
    ``local_layers`` (a Keras layer or a list of them) stay local."""
    opt = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                               sparse_as_dense, gradient_predivide_factor, op,
                               backward_passes_per_step, average_aggregated_gradients, 0,
                               groups, process_set, scale_local_gradients)
    layers = [] if local_layers is None else (
        local_layers if isinstance(local_layers, (list, tuple)) else [local_layers])
    for layer in layers:
        for var in layer.trainable_weights:
            opt.register_local_var(var)
    return opt


__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer"]
