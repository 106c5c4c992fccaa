"""Result arrays aligned to 64 bytes, so that frameworks adopt them without a copy.

numpy aligns its allocations to 16 bytes only. TensorFlow (``tf.numpy_function``'s results)
and XLA (``jax.device_put(..., may_alias=True)`` on the CPU) take a host array over as a tensor
without copying it only when its data address is a multiple of 64 bytes; otherwise they
allocate and copy. The core allocates every collective's fresh result with :func:`empty`, so
each adapter can hand it to its framework as it is (torch's ``from_numpy`` needs no alignment).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

ALIGN = 64
"""Bytes: the data address of every array :func:`empty` returns is a multiple of this."""


def empty(shape: int | tuple[int, ...] | list[int], dtype: Any) -> np.ndarray:
    """An uninitialized C-contiguous array of ``shape`` and ``dtype`` whose data address is a
    multiple of :data:`ALIGN` (a view into a slightly larger byte buffer, its ``base``)."""
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    dt = np.dtype(dtype)
    nbytes = math.prod(dims) * dt.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.__array_interface__["data"][0] % ALIGN  # (.ctypes costs two Python calls)
    out: np.ndarray = raw[start:start + nbytes].view(dt).reshape(dims)
    return out


def empty_like(array: np.ndarray) -> np.ndarray:
    """:func:`empty` with ``array``'s shape and dtype."""
    return empty(array.shape, array.dtype)


__all__ = ["ALIGN", "empty", "empty_like"]
