"""The TensorFlow tensor factory for the framework-neutral collective suite."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
from tf_case_ids import MOVE, REDUCE, REJECTED


class TFFactory:
    """float64 numpy values <-> TensorFlow tensors of a named dtype."""

    reduce_dtypes = list(REDUCE)
    move_dtypes = list(MOVE)
    rejected = dict(REJECTED)

    def make(self, values: np.ndarray, dtype: str) -> tf.Tensor:
        if dtype == "string":
            return tf.constant(np.asarray(values).astype(str))
        return tf.constant(np.asarray(values), dtype=tf.as_dtype(dtype))

    def values(self, tensor: Any) -> np.ndarray:
        return np.asarray(tf.convert_to_tensor(tensor).numpy()).astype(np.float64)

    def dtype(self, tensor: Any) -> str:
        return str(tf.convert_to_tensor(tensor).dtype.name)
