"""The JAX array factory for the framework-neutral collective suite (tests/torch)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax_case_ids import MOVE, REDUCE, REJECTED


class JaxFactory:
    """float64 numpy values <-> jax arrays of a named dtype (the job runs with x64 on)."""

    reduce_dtypes = list(REDUCE)
    move_dtypes = list(MOVE)
    rejected = dict(REJECTED)

    def make(self, values: np.ndarray, dtype: str) -> Any:
        return jnp.asarray(np.asarray(values), dtype=jnp.dtype(dtype))

    def values(self, tensor: Any) -> np.ndarray:
        return np.asarray(tensor).astype(np.float64)

    def dtype(self, tensor: Any) -> str:
        return str(np.dtype(tensor.dtype))
