"""Result buffers that TensorFlow takes over without a copy, reused once it lets go of them.

A ``tf.numpy_function`` hands its inputs to Python as arrays aliasing the tensors' memory, and
turns each returned array into a tensor **without a copy when the array's data is aligned to
64 bytes** (TensorFlow's allocator alignment, ``EIGEN_MAX_ALIGN_BYTES`` of its CPU builds);
otherwise it allocates a tensor and copies. numpy aligns its allocations to 16 bytes only;
:mod:`hora.core.data.aligned` gives arrays TensorFlow can adopt (the core's own fresh results are
such arrays too), and the pool below also saves a fresh allocation of every gradient per step.

A tensor that adopted an array keeps a reference to it until the tensor's memory is freed (the
reference is dropped from Python, via TensorFlow's delayed-decref cache). So an array whose only
reference is the pool's own is free: no tensor, view or caller can still see it.
:class:`OutputPool` reuses such arrays for the next step's results (a training step's
gradients have the same names and shapes every step), and allocates a new one whenever every
pooled array is still held (a caller who keeps the gradients keeps them intact).

Inside ``tf.function`` the :class:`~hora.tensorflow.gradients.GradientReducer` needs no pool: it
reduces in place, in the unshared buffers TensorFlow hands over, and returns those. The pool
serves the results of eager calls and of TF1 graphs.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

from hora.core.data import aligned

DEPTH = 2
"""Arrays kept per name. One is normally enough (Keras ``fit``: TensorFlow has let go of a
step's results before the next step's host call); two when its release of them is still pending
then (a bare ``tf.function``). Results held longer get new arrays, which are not kept."""


def _allocate(shape: tuple[int, ...], dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """An aligned array (:func:`hora.core.data.aligned.empty`) and the byte buffer it views."""
    out = aligned.empty(shape, dtype)
    base = out.base
    assert isinstance(base, np.ndarray)
    return out, base


class OutputPool:
    """Aligned result arrays by name, reused when nobody but the pool holds them.

    Thread-safe; :meth:`take` costs a few microseconds.
    """

    def __init__(self, depth: int = DEPTH) -> None:
        self._depth = depth
        self._lock = threading.Lock()
        self._arrays: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}  # (array, its base)

    def take(self, name: str, like: np.ndarray) -> np.ndarray:
        """An aligned array shaped and typed like ``like`` (contents undefined) that nothing
        else references: a pooled one if one is free, else a new one (pooled while fewer than
        ``depth`` arrays are kept for ``name``; a changed shape or dtype replaces them)."""
        with self._lock:
            arrays = self._arrays.get(name)
            if arrays and (arrays[0][0].shape != like.shape or arrays[0][0].dtype != like.dtype):
                arrays = None
            if arrays is None:
                arrays = self._arrays[name] = []
            for pair in arrays:
                # References to the array: the pair's and getrefcount's argument. To its base:
                # those two and the array's own. numpy makes every view of the array a view
                # of the base, so any other reference to either is a holder.
                if sys.getrefcount(pair[0]) == 2 and sys.getrefcount(pair[1]) == 3:
                    return pair[0]
            pair = _allocate(like.shape, like.dtype)
            if len(arrays) < self._depth:
                arrays.append(pair)
            return pair[0]

    def arrays(self) -> list[np.ndarray]:
        """Every pooled array (diagnostics and tests)."""
        with self._lock:
            return [pair[0] for pairs in self._arrays.values() for pair in pairs]

    def clear(self) -> None:
        """Forget every pooled array (those still held stay valid for their holders)."""
        with self._lock:
            self._arrays.clear()


__all__ = ["DEPTH", "OutputPool"]
