"""Horovod's ``horovod.spark.keras``: ``KerasEstimator`` and ``KerasModel`` for Keras 3
(``import hora.spark.keras as hvd``; ``hvd.KerasEstimator(...)``). Imports pyspark and Keras;
the engine runs only in the ranks. See docs/spark.md."""

from __future__ import annotations

from hora.spark.keras.estimator import KerasEstimator, KerasModel

__all__ = ["KerasEstimator", "KerasModel"]
