"""Keras 3 ``DistributedOptimizer(op=hvd.Adasum)``: Horovod's Adasum *delta* optimizer.

With Adasum the ranks do not combine gradients: each rank applies the wrapped optimizer to its
own gradients (so momentum and Adam's moments follow local gradients) and the ranks combine the
resulting changes of the weights with Adasum (:func:`hora.core.frontend.distopt.adasum_active`).
Horovod builds this optimizer for TensorFlow 1 optimizers (``tf.compat.v1.train``, its
``_DistributedAdasumOptimizer``: a ``delta_start`` slot per variable, ``var - start``
allreduced with Adasum, ``var = start + delta``) and refuses ``op=Adasum`` with Keras
optimizers; hora gives Keras 3 optimizers the same model. In every update (Keras 3's
``_backend_apply_gradients``, the hook of hora's Average optimizer):

1. ``start = v`` for every trainable variable (an optimizer slot ``adasum_start``);
2. the wrapped class's own update runs on this rank's gradients (clipping, weight decay);
3. ``delta = v - start`` is combined across ranks with Adasum, one tensor at a time (one host
   call for all of them, :class:`~hora.tensorflow.gradients.GradientReducer`);
4. ``v = start + adasum(delta)``, identical on every rank (variables passed to
   ``register_local_var`` keep this rank's own update).

``backward_passes_per_step=N`` uses Keras's gradient accumulation, as the Average optimizer
does: the update, and so steps 3-4, happen on every N-th pass only. An exponential moving
average of the weights (``use_ema``) follows the local update of step 2.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from hora.tensorflow.gradients import GradientReducer


class _DistributedAdasumOptimizer(keras.optimizers.Optimizer):
    """Methods mixed into the runtime subclass of the wrapped optimizer's class (Adasum)."""

    _hora_base: Any = keras.optimizers.Optimizer
    _hora_reducer: GradientReducer
    _hora_sum_factor: float = 1.0
    _hora_starts: list[Any]

    def build(self, variables: Any) -> None:
        self._hora_base.build(self, variables)
        self._hora_starts = [self.add_variable_from_reference(v, name="adasum_start")
                             for v in variables]

    def _clip_gradients(self, grads: Any) -> Any:
        if self._hora_sum_factor != 1.0:  # accumulated gradients summed, as Horovod's default
            grads = [g if g is None else g * self._hora_sum_factor for g in grads]
        return self._hora_base._clip_gradients(self, grads)

    def _backend_apply_gradients(self, grads: Any, trainable_variables: Any) -> Any:
        variables = list(trainable_variables)
        starts = [self._hora_starts[self._get_variable_index(v)] for v in variables]
        for start, var in zip(starts, variables):
            start.assign(var)
        result = self._hora_base._backend_apply_gradients(self, grads, variables)

        local = self._hora_local_ids()
        shared = [(var, start) for var, start in zip(variables, starts) if id(var) not in local]

        def combine() -> None:
            deltas = [var - start for var, start in shared]
            combined = self._hora_reducer(deltas, [var for var, _ in shared])
            for (var, start), delta in zip(shared, combined):
                var.assign(start + delta)

        steps = self.gradient_accumulation_steps
        if steps:
            tf.cond((self._iterations + 1) % steps == 0, combine, lambda: None)
        else:
            combine()
        return result

    def _hora_local_ids(self) -> set[int]:
        local: set[int] = self.__dict__.setdefault("_hora_local", set())
        return local

    def register_local_var(self, var: Any) -> None:
        """Leave ``var`` out of the combination: it keeps this rank's own update."""
        self._hora_local_ids().add(id(var))


__all__: list[str] = []
