"""``SyncBatchNormalization``: batch normalization (Keras 3's, or tf-keras's when ``tf.keras`` is
Keras 2) whose training statistics are the whole job's batch (Horovod's
``horovod.tensorflow.SyncBatchNormalization``).

In training mode each rank reduces its own batch to three per-channel numbers, its count
``n``, ``n * mean`` and ``M2 + n * mean**2`` (``M2``: the sum of squared deviations from its
own mean), and one Sum-``allreduce`` (float64) adds them over the ranks. The job's mean is
``S1 / N`` and its variance ``S2 / N - mean**2``: exactly the statistics of the concatenated
batch, also when the ranks' batch sizes differ (Horovod's averages the ranks' means and mean
squares, which is exact only for equal batches). The allreduce is differentiable (its
gradient is the Sum-allreduce of the gradients, Horovod's rule), so each rank's gradients are
those of the concatenated batch. Everything else (moving statistics, renorm, masks,
inference) is Keras's ``BatchNormalization``; only the statistics hook differs between the two
Keras forms.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from hora.collectives.ops import ReduceOp
from hora.core.engine import context as _context
from hora.tensorflow.keras_flavor import legacy_keras
from hora.tensorflow.mpi_ops import allreduce


def _synchronized() -> bool:
    """Whether statistics are reduced: more than one rank, or an elastic worker (the world
    may grow after a trace), as :class:`~hora.tensorflow.gradients.GradientReducer` decides."""
    ctx = _context.get("SyncBatchNormalization")
    return ctx.size > 1 or bool(ctx.config.elastic)


def job_moments(inputs: Any, axes: Any, mask: Any, keepdims: bool) -> tuple[Any, Any]:
    """The mean and variance over ``axes`` of every rank's ``inputs`` (positions where ``mask``
    is False left out), per channel: one Sum-allreduce of each rank's count, ``n * mean`` and
    ``M2 + n * mean**2`` (float64). Shaped as a reduction with ``keepdims``."""
    axes = list(axes)
    x = tf.convert_to_tensor(inputs)
    if mask is None:
        weights = tf.ones_like(x)
    else:
        weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), x.dtype)
    count = tf.reduce_sum(weights, axes, keepdims=True)
    safe = tf.maximum(count, 1.0)
    mean = tf.reduce_sum(weights * x, axes, keepdims=True) / safe
    m2 = tf.reduce_sum(weights * tf.square(x - mean), axes, keepdims=True)
    kept = tf.shape(mean) if keepdims else tf.shape(tf.reduce_sum(mean, axes))
    n, mean, m2 = (tf.cast(tf.reshape(t, [-1]), tf.float64) for t in (count, mean, m2))
    local = tf.stack([n, n * mean, m2 + n * tf.square(mean)])
    total = allreduce(local, op=ReduceOp.Sum)
    big_n = tf.maximum(total[0], 1.0)
    job_mean = total[1] / big_n
    job_var = tf.maximum(total[2] / big_n - tf.square(job_mean), 0.0)
    return (tf.reshape(tf.cast(job_mean, x.dtype), kept),
            tf.reshape(tf.cast(job_var, x.dtype), kept))


def _check_fused(fused: bool | None) -> None:
    if fused in (True, None):
        raise ValueError("SyncBatchNormalization does not support fused=True.")


@keras.saving.register_keras_serializable(package="hora")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization with the batch statistics of every rank (Keras
    ``BatchNormalization``'s arguments).

    Args:
        fused: Horovod's argument; only ``False`` is accepted (Keras 3 has no fused kernel).

    Raises:
        ValueError: ``fused`` is True or None (Horovod's text).
    """

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        _check_fused(fused)
        if not kwargs.get("name"):
            kwargs["name"] = "sync_batch_normalization"
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        if not _synchronized():
            return super()._moments(inputs, mask)
        return job_moments(inputs, self._reduction_axes, mask, keepdims=False)


def _keras2_class() -> type:
    """The tf-keras (Keras 2) form: ``tf.keras.layers.BatchNormalization`` with its fused
    kernel off and ``_calculate_mean_and_var`` (Keras 2's statistics hook) reduced across
    ranks, as Horovod's class."""
    base: type = tf.keras.layers.BatchNormalization

    class SyncBatchNormalization(base):
        """Batch normalization with the batch statistics of every rank (tf-keras
        ``BatchNormalization``'s arguments; ``fused`` must be False)."""

        def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
            _check_fused(fused)
            if not kwargs.get("name"):
                kwargs["name"] = "sync_batch_normalization"
            super().__init__(fused=False, **kwargs)

        def _calculate_mean_and_var(self, inputs: Any, reduction_axes: Any, keep_dims: bool,
                                    mask: Any = None) -> tuple[Any, Any]:
            if not _synchronized():
                return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims,
                                                       mask=mask)
            return job_moments(inputs, reduction_axes, mask, keep_dims)

    SyncBatchNormalization.__module__ = __name__
    return SyncBatchNormalization


if legacy_keras():  # hvd.SyncBatchNormalization is a layer of whichever Keras tf.keras is, as
    SyncBatchNormalization = _keras2_class()  # type: ignore[misc,assignment]  # Horovod's is

__all__ = ["SyncBatchNormalization", "job_moments"]
