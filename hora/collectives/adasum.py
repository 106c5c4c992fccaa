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

When a vector is spread over several ranks (the hierarchical form,
:mod:`hora.collectives.hierarchical_adasum`: each rank of a host holds one shard), the caller
passes ``dot_sum``, which sums the three dot products over the ranks holding the other shards,
so the coefficients are those of the whole vector, as Horovod's reduction communicators do.

A rank count that is not a power of two is refused, as Horovod does (``NotImplementedError``).
Collective layer: works on one numpy buffer over the :class:`~hora.collectives.comm.Comm`
protocol; a fused buffer of several tensors passes their sizes (``counts``), and each tensor
keeps its own coefficients, as in Horovod's fused Adasum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hora.collectives.comm import Comm

NORM_FLOOR = 1e-8
"""Below this squared norm a vector's coefficient stays 1 (Horovod's threshold)."""

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
"""Dtypes Adasum accepts (a dot product of integers has no meaning here)."""

DotSum = Callable[[np.ndarray], None]
"""Sums a float64 array of dot products (3 per tensor), in place, over the ranks that share the
tensors."""


def check_size(size: int, *, hosts: bool = False) -> None:
    """Raise unless ``size`` ranks (or hosts, in the hierarchical form) can run Adasum.

    Raises:
        NotImplementedError: ``size`` is not a power of two (Horovod's exception type, with
            Horovod's words first).
    """
    if size >= 1 and not size & (size - 1):
        return
    if hosts:
        raise NotImplementedError(
            f"Running Adasum with non-power of 2 nodes is not supported yet: this process set "
            f"spans {size} hosts with several ranks on some of them, and hierarchical Adasum "
            "combines one vector per host. HINT: use 2^k hosts, set "
            "HOROVOD_HIERARCHICAL_ALLREDUCE=0 to run Adasum over every rank (2^k ranks), or "
            "use op=Average.")
    raise NotImplementedError(
        f"Running Adasum with non-power of 2 ranks is not supported yet: this process set has "
        f"{size} ranks. HINT: use op=Average, or a process set of 2^k ranks.")


def hierarchical_hosts(hostnames: Sequence[str], hierarchical: bool | None) -> int | None:
    """How many hosts a set whose rank ``i`` runs on ``hostnames[i]`` combines with Adasum
    when it runs hierarchically, or None when Adasum runs over every rank (flat).

    Hierarchical when the set spans several hosts and ``hierarchical`` (the
    ``HOROVOD_HIERARCHICAL_ALLREDUCE`` setting) is True, or None (automatic) with some host
    holding several of the set's ranks: the rule of :func:`hora.core.data.routing.build_route`.
    """
    hosts = len(set(hostnames))
    if hosts <= 1:
        return None
    on = hosts < len(hostnames) if hierarchical is None else hierarchical
    return hosts if on else None


def check_set(hostnames: Sequence[str], hierarchical: bool | None) -> None:
    """Raise unless a set whose rank ``i`` runs on ``hostnames[i]`` can run Adasum: 2^k hosts
    in the hierarchical form, else 2^k ranks (see :func:`hierarchical_hosts`).

    Raises:
        NotImplementedError: as :func:`check_size`.
    """
    hosts = hierarchical_hosts(hostnames, hierarchical)
    if hosts is None:
        check_size(len(hostnames))
    else:
        check_size(hosts, hosts=True)


def _dots(a64: np.ndarray, b64: np.ndarray, bounds: Sequence[int]) -> np.ndarray:
    """``[a.b, a.a, b.b]`` of every segment ``bounds[t]:bounds[t + 1]``: shape (k, 3).

    Products summed by numpy's pairwise summation, not ``np.dot``: OpenBLAS's ``ddot`` runs on
    its thread pool, which on a machine with more busy threads than cores took milliseconds
    (up to 30 ms) per call instead of microseconds."""
    out = np.zeros((len(bounds) - 1, 3), dtype=np.float64)
    longest = max((hi - lo for lo, hi in zip(bounds, bounds[1:])), default=0)
    scratch = np.empty(longest, dtype=np.float64)
    for t in range(len(bounds) - 1):
        lo, hi = bounds[t], bounds[t + 1]
        if hi > lo:
            a, b, tmp = a64[lo:hi], b64[lo:hi], scratch[:hi - lo]
            out[t] = [np.add.reduce(np.multiply(x, y, out=tmp)) for x, y in ((a, b), (a, a),
                                                                              (b, b))]
    return out


def _combine64(a64: np.ndarray, b64: np.ndarray, dots: np.ndarray,
               lengths: Sequence[int]) -> np.ndarray:
    """``adasum`` of every segment (``lengths[t]`` elements each) with its ``dots[t]``."""
    dot, anorm, bnorm = dots[:, 0], dots[:, 1], dots[:, 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        acoeff = np.where(anorm >= NORM_FLOOR, 1.0 - dot / anorm * 0.5, 1.0)
        bcoeff = np.where(bnorm >= NORM_FLOOR, 1.0 - dot / bnorm * 0.5, 1.0)
    if len(lengths) == 1:
        out: np.ndarray = float(acoeff[0]) * a64 + float(bcoeff[0]) * b64
        return out
    out = np.repeat(acoeff, lengths) * a64
    out += np.repeat(bcoeff, lengths) * b64
    return out


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``adasum(a, b)`` in float64 (see the module docstring)."""
    a64 = a.astype(np.float64, copy=False)
    b64 = b.astype(np.float64, copy=False)
    return _combine64(a64, b64, _dots(a64, b64, [0, a64.size]), [a64.size])


def adasum_allreduce(comm: Comm, buf: np.ndarray, *, counts: Sequence[int] | None = None,
                     dot_sum: DotSum | None = None) -> None:
    """Replace ``buf`` (1-D, the same length on every rank) by the Adasum of every rank's
    ``buf``, in place.

    Args:
        comm: the ranks whose vectors are combined (2^k of them).
        buf: this rank's vector (or its shard of a vector, with ``dot_sum``).
        counts: the lengths of the tensors packed one after another in ``buf`` (a fused
            buffer; zeros allowed); each is combined with its own coefficients. None: one.
        dot_sum: None for whole vectors; else called at every level with this shard's dot
            products (float64, ``[a.b, a.a, b.b]`` per tensor, flattened) and must sum them,
            in place and identically, over the ranks holding the tensors' other shards. Every
            such rank calls this function, even with an empty shard.

    Raises:
        NotImplementedError: the number of ranks is not a power of two.
        ValueError: ``counts`` that do not add up to ``buf.size``.
    """
    size, rank = comm.size, comm.rank
    check_size(size)
    lengths = [buf.size] if counts is None else [int(c) for c in counts]
    if sum(lengths) != buf.size or min(lengths, default=0) < 0:
        raise ValueError(f"Adasum counts {lengths} do not add up to the buffer's {buf.size} "
                         "elements")
    if size == 1 or (buf.size == 0 and dot_sum is None):
        return
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    other = np.empty_like(buf)
    d = 1
    while d < size:
        partner = rank ^ d
        if buf.size:  # partners hold shards of the same length
            comm.sendrecv(partner, buf, partner, other)
        low, high = (buf, other) if rank < partner else (other, buf)
        a64 = low.astype(np.float64, copy=False)
        b64 = high.astype(np.float64, copy=False)
        dots = _dots(a64, b64, bounds)
        if dot_sum is not None:
            flat = dots.reshape(-1)
            dot_sum(flat)
            dots = flat.reshape(-1, 3)
        buf[...] = _combine64(a64, b64, dots, lengths).astype(buf.dtype, copy=False)
        d <<= 1


def adasum_gathered(gather: Callable[[np.ndarray, np.ndarray], None], size: int,
                    buf: np.ndarray, *, counts: Sequence[int] | None = None,
                    barrier: Callable[[], None] | None = None) -> None:
    """:func:`adasum_allreduce` for ranks that can see each other's vectors (one host's shared
    memory): ``gather(buf, out)`` fills ``out`` (``size * buf.size`` elements) with every rank's
    ``buf`` in rank order, then every rank computes the same tree itself. The pairs, the
    float64 arithmetic and the rounding to the dtype after each level are the recursive
    exchange's, so the result is the same, bit for bit, on every rank; one gather replaces
    ``log2(size)`` exchanges (each a wait for a peer) at the cost of ``size - 1`` combinations.
    ``barrier`` (every rank of the group) runs once the result is computed, so that no rank
    finishes, and perhaps shuts down, while another still reads or computes.

    Raises:
        NotImplementedError, ValueError: as :func:`adasum_allreduce`.
    """
    check_size(size)
    lengths = [buf.size] if counts is None else [int(c) for c in counts]
    if sum(lengths) != buf.size or min(lengths, default=0) < 0:
        raise ValueError(f"Adasum counts {lengths} do not add up to the buffer's {buf.size} "
                         "elements")
    if size == 1 or buf.size == 0:
        return
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    out = np.empty(size * buf.size, dtype=buf.dtype)
    gather(buf, out)
    level = [out[r * buf.size:(r + 1) * buf.size] for r in range(size)]
    while len(level) > 1:
        nxt = []
        for low, high in zip(level[0::2], level[1::2]):
            a64 = low.astype(np.float64, copy=False)
            b64 = high.astype(np.float64, copy=False)
            nxt.append(_combine64(a64, b64, _dots(a64, b64, bounds),
                                  lengths).astype(buf.dtype, copy=False))
        level = nxt
    buf[...] = level[0]
    if barrier is not None:
        barrier()


__all__ = ["FLOAT_DTYPES", "NORM_FLOOR", "DotSum", "adasum_allreduce", "adasum_gathered",
           "check_set", "check_size", "combine", "hierarchical_hosts"]
