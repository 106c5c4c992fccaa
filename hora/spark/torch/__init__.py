"""Horovod's ``horovod.spark.torch``: ``TorchEstimator`` and ``TorchModel``
(``import hora.spark.torch as hvd``; ``hvd.TorchEstimator(...)``). Imports pyspark and torch;
the engine runs only in the ranks. See docs/spark.md."""

from __future__ import annotations

from hora.spark.torch.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
