"""Allreduce entry point: dispatch by algorithm name to the ring, star or small algorithm.

The engine picks the name with :func:`hora.collectives.select.select_allreduce` and calls
:func:`allreduce`. The algorithms themselves live in :mod:`hora.collectives.ring`,
:mod:`hora.collectives.star` and :mod:`hora.collectives.small` and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable

from hora.collectives._buffers import Array
from hora.collectives.comm import Comm
from hora.collectives.ops import ReduceOp
from hora.collectives.ring import ring_allreduce
from hora.collectives.small import small_allreduce
from hora.collectives.star import star_allreduce

AllreduceFn = Callable[[Comm, Array, ReduceOp, "Array | None"], None]

ALGORITHMS: dict[str, AllreduceFn] = {
    "ring": ring_allreduce,
    "star": star_allreduce,
    "small": small_allreduce,
}
"""Allreduce implementations by the name :func:`allreduce` accepts."""


def allreduce(comm: Comm, buf: Array, op: ReduceOp, algorithm: str,
              scratch: Array | None = None) -> None:
    """Reduce ``buf`` element-wise across the ranks of ``comm``, in place.

    Every rank of ``comm`` must call this in the same order with a buffer of the same length and
    dtype, the same ``op`` and the same ``algorithm``. Every rank ends with identical bytes.

    Args:
        comm: the group.
        buf: 1-D C-contiguous array of a supported dtype; replaced by the reduction in place.
        op: Sum, Average (reduced as Sum; the caller scales by ``1/size``), Min, Max or Product.
        algorithm: ``"ring"``, ``"star"`` or ``"small"`` (see :data:`ALGORITHMS`).
        scratch: optional reusable uint8 array; ``buf.nbytes`` bytes suffice for every
            algorithm. Allocated if None or too small.

    Raises:
        ValueError: unknown ``algorithm``; ``buf`` not 1-D, not contiguous or read-only.
        TypeError: ``buf`` has an unsupported dtype.
        NotImplementedError: ``op`` is Adasum.
        PeerLostError, HoraTimeoutError: from the transport, naming the peer.
    """
    try:
        fn = ALGORITHMS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown allreduce algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)} "
            "(HINT: resolve 'auto' with hora.collectives.select.select_allreduce first)"
        ) from None
    fn(comm, buf, op, scratch)


__all__ = ["ALGORITHMS", "allreduce", "ring_allreduce", "small_allreduce", "star_allreduce"]
