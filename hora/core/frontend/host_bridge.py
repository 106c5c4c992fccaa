"""A :class:`~hora.core.frontend.gradients.GradientBridge` over numpy arrays, for adapters that run
the collectives on host copies of their tensors (JAX's host callbacks, TensorFlow's
``numpy_function``): arrays pass straight through to the core and back, and the gradient rules'
tensor math is numpy's. An adapter subclasses it to check its own dtype tables
(:meth:`HostBridge.check`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hora.core.frontend import op_forms as sp


class HostBridge:
    """numpy arrays in, numpy arrays out (see the module docstring)."""

    passthrough = True

    def check(self, array: np.ndarray, table: str) -> None:
        """Raise ValueError if ``array``'s dtype is not in table ``table`` (none here)."""

    def host(self, tensor: Any, table: str) -> sp.TensorView:
        array = tensor if isinstance(tensor, np.ndarray) else np.asarray(tensor)
        self.check(array, table)
        return sp.TensorView(array, "cpu", tensor)

    def hosts(self, tensors: Sequence[Any], table: str) -> tuple[list[sp.TensorView], str]:
        return [self.host(t, table) for t in tensors], "cpu"

    def result(self, like: sp.TensorView, out: Any) -> Any:
        return out

    def written(self, host: sp.TensorView, out: Any) -> Any:
        return out

    def splits(self, splits: Any) -> list[int] | None:
        return None if splits is None else [int(s) for s in np.asarray(splits).reshape(-1)]

    def received_splits(self, splits: Any, received: np.ndarray) -> Any:
        return received.astype(np.int32)

    # the tensor math of the gradient rules (hora.core.frontend.gradients)
    def rows(self, tensor: np.ndarray, start: int, count: int) -> np.ndarray:
        return tensor[start:start + count]

    def zeros_like(self, tensor: np.ndarray) -> np.ndarray:
        return np.zeros_like(tensor)

    def pad_rows(self, tensor: np.ndarray, rows: int) -> np.ndarray:
        if tensor.shape[0] >= rows:
            return tensor
        pad = np.zeros((rows - tensor.shape[0],) + tensor.shape[1:], tensor.dtype)
        return np.concatenate([tensor, pad])

    def scaled(self, tensor: np.ndarray, factor: float) -> np.ndarray:
        return (tensor * factor).astype(tensor.dtype, copy=False)


__all__ = ["HostBridge"]
