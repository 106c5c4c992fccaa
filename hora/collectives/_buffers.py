"""Shared argument checks and buffer layout helpers for the collective algorithms.

Private to :mod:`hora.collectives`. The algorithms move raw bytes, so everything here is about
turning typed 1-D arrays into byte views, segment offsets and reusable scratch space, and about
rejecting bad arguments with messages that say what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from hora.collectives.ops import ReduceOp, check_dtype

Array = npt.NDArray[Any]


def check_array(arr: object, name: str, *, writable: bool) -> None:
    """Raise unless ``arr`` is a 1-D C-contiguous numpy array (writable if asked).

    Raises:
        TypeError: ``arr`` is not a numpy array.
        ValueError: it is not 1-D, not C-contiguous, or read-only where it must be written.
    """
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if arr.ndim != 1:
        raise ValueError(
            f"{name} must be a 1-D array, got shape {arr.shape}; HINT: collectives work on flat "
            "buffers, pass arr.reshape(-1) of a C-contiguous array"
        )
    if not arr.flags.c_contiguous:
        raise ValueError(
            f"{name} must be C-contiguous (got strides {arr.strides} for itemsize "
            f"{arr.itemsize}); HINT: pass np.ascontiguousarray(arr)"
        )
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name} is read-only but the collective writes into it")


def check_same_dtype(a: Array, a_name: str, b: Array, b_name: str) -> None:
    """Raise TypeError unless ``a`` and ``b`` have the same dtype."""
    if a.dtype != b.dtype:
        raise TypeError(f"{a_name} has dtype {a.dtype} but {b_name} has dtype {b.dtype}")


def check_reducible(buf: Array, name: str) -> None:
    """Raise TypeError unless ``buf``'s dtype is one hora can reduce."""
    check_dtype(buf.dtype, name)


def elementwise_op(op: ReduceOp | int) -> ReduceOp:
    """The element-wise op the algorithms apply for ``op``.

    Average is reduced as Sum (the caller applies the ``1/size`` postscale).

    Raises:
        NotImplementedError: ``op`` is Adasum, which is not an element-wise reduction.
        ValueError: ``op`` is not a ReduceOp value.
    """
    if type(op) is not ReduceOp:
        op = ReduceOp(op)
    if op == ReduceOp.Adasum:
        raise NotImplementedError(
            "Adasum is not an element-wise reduction and is not implemented by the ring/star/"
            "small allreduce algorithms; HINT: use op=Sum or op=Average"
        )
    return ReduceOp.Sum if op == ReduceOp.Average else op


def check_counts(counts: Sequence[int], size: int, name: str) -> list[int]:
    """``counts`` as a list of ``size`` non-negative ints, or ValueError."""
    values = [int(c) for c in counts]
    if len(values) != size:
        raise ValueError(f"{name} has {len(values)} entries but the group has {size} ranks")
    negative = [i for i, c in enumerate(values) if c < 0]
    if negative:
        raise ValueError(f"{name} has negative entries at ranks {negative}: {values}")
    return values


def offsets(counts: Sequence[int]) -> list[int]:
    """Prefix sums: segment ``i`` is ``[offsets[i], offsets[i + 1])``; ``len(counts) + 1`` items."""
    result = [0]
    for count in counts:
        result.append(result[-1] + count)
    return result


def even_counts(n: int, parts: int) -> list[int]:
    """Split ``n`` elements into ``parts`` counts differing by at most one (larger ones first)."""
    base, extra = divmod(n, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def as_bytes(arr: Array) -> npt.NDArray[np.uint8]:
    """A uint8 view of a 1-D contiguous array (works for bool and bfloat16 too)."""
    return arr.view(np.uint8)


def scratch_array(scratch: Array | None, count: int, dtype: np.dtype[Any]) -> Array:
    """A ``count``-element array of ``dtype`` carved from ``scratch``, or a new one.

    ``scratch`` is a caller-owned uint8 buffer reused across calls so that steady-state
    collectives allocate nothing large; when it is None or too small a fresh array is allocated.

    Raises:
        ValueError: ``scratch`` is not a writable 1-D C-contiguous uint8 array.
    """
    nbytes = count * dtype.itemsize
    if scratch is not None:
        check_scratch(scratch)
        if scratch.nbytes >= nbytes:
            return scratch[:nbytes].view(dtype)
    return np.empty(count, dtype=dtype)


def check_scratch(scratch: Array | None) -> None:
    """Raise ValueError unless ``scratch`` is None or a writable 1-D C-contiguous uint8 array."""
    if scratch is not None:
        check_array(scratch, "scratch", writable=True)
        if scratch.dtype != np.uint8:
            raise ValueError(f"scratch must be a uint8 array, got dtype {scratch.dtype}")


def check_allreduce_args(buf: Array, op: ReduceOp | int, scratch: Array | None) -> ReduceOp:
    """The argument checks every allreduce algorithm starts with; returns the element-wise op."""
    check_array(buf, "allreduce buffer", writable=True)
    check_reducible(buf, "allreduce buffer")
    check_scratch(scratch)
    return elementwise_op(op)
