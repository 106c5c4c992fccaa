"""Adasum: an allreduce that adds gradients where they are orthogonal and averages them where
they agree (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021).

Two ranks' vectors ``a`` and ``b`` combine as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient stays 1 when its vector's squared norm is below 1e-8, as Horovod's). Over
``n = 2^k`` ranks the combination is applied recursively: at level ``d = 1, 2, 4, ...`` every
rank exchanges its current vector with rank ``r xor d`` and both compute the same combination,
with the lower rank's vector as ``a`` so that the two results are bitwise equal. After ``k``
levels every rank holds the same result. Dot products and the combination are computed in
float64 and rounded once to the buffer's dtype. Each exchange moves the whole vector (Horovod's
MPI version halves it per level instead: fewer bytes, the same result up to rounding).

A rank count that is not a power of two is refused, as Horovod does. Collective layer: works on
one numpy buffer over the :class:`~hora.collectives.comm.Comm` protocol.
"""

from __future__ import annotations

import numpy as np

from hora.collectives.comm import Comm

NORM_FLOOR = 1e-8
"""Below this squared norm a vector's coefficient stays 1 (Horovod's threshold)."""

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
"""Dtypes Adasum accepts (a dot product of integers has no meaning here)."""


def check_size(size: int) -> None:
    """Raise ValueError unless ``size`` ranks can run Adasum (a power of two)."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"Adasum needs a number of ranks that is a power of two; this process "
                         f"set has {size}. HINT: use op=Average, or a process set of 2^k ranks.")


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``adasum(a, b)`` in float64 (see the module docstring)."""
    a64 = a.astype(np.float64, copy=False)
    b64 = b.astype(np.float64, copy=False)
    dot = float(np.dot(a64, b64))
    anorm = float(np.dot(a64, a64))
    bnorm = float(np.dot(b64, b64))
    acoeff = 1.0 - dot / anorm * 0.5 if anorm >= NORM_FLOOR else 1.0
    bcoeff = 1.0 - dot / bnorm * 0.5 if bnorm >= NORM_FLOOR else 1.0
    out: np.ndarray = acoeff * a64 + bcoeff * b64
    return out


def adasum_allreduce(comm: Comm, buf: np.ndarray) -> None:
    """Replace ``buf`` (1-D, the same length on every rank) by the Adasum of every rank's
    ``buf``, in place.

    Raises:
        ValueError: the number of ranks is not a power of two.
    """
    size, rank = comm.size, comm.rank
    check_size(size)
    if size == 1 or buf.size == 0:
        return
    other = np.empty_like(buf)
    d = 1
    while d < size:
        partner = rank ^ d
        comm.sendrecv(partner, buf, partner, other)
        low, high = (buf, other) if rank < partner else (other, buf)
        buf[...] = combine(low, high).astype(buf.dtype, copy=False)
        d <<= 1


__all__ = ["FLOAT_DTYPES", "NORM_FLOOR", "adasum_allreduce", "check_size", "combine"]
