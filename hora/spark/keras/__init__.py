"""Horovod's ``horovod.spark.keras``: ``KerasEstimator`` and ``KerasModel`` (Keras 3; ``import
hora.spark.keras as hvd``, then ``hvd.KerasEstimator(...)``). See docs/spark.md.

The names load on first use (PEP 562): the ranks import :mod:`hora.spark.keras.remote` without
pyspark's ML modules; the driver's first ``hvd.KerasEstimator`` imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hora.spark.keras.estimator import KerasEstimator, KerasModel

__all__ = ["KerasEstimator", "KerasModel"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hora.spark.keras import estimator

        return getattr(estimator, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
