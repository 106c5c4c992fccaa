"""Horovod's ``horovod.spark.torch``: ``TorchEstimator`` and ``TorchModel`` (PyTorch; ``import
hora.spark.torch as hvd``, then ``hvd.TorchEstimator(...)``). See docs/spark.md.

The names load on first use (PEP 562): the ranks import :mod:`hora.spark.torch.remote` without
pyspark's ML modules; the driver's first ``hvd.TorchEstimator`` imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hora.spark.torch.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hora.spark.torch import estimator

        return getattr(estimator, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
