"""Reduce-scatter with per-rank counts (ring algorithm).

Every rank holds the whole buffer; rank ``i`` ends with the element-wise reduction over ranks
of segment ``i``. Uses the shared ring primitive of :mod:`hora.collectives.ring`: ``size - 1``
steps, each one ``sendrecv`` to the right neighbour and from the left one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hora.collectives._buffers import (
    Array,
    check_array,
    check_counts,
    check_reducible,
    check_same_dtype,
    check_scratch,
    elementwise_op,
    offsets,
    scratch_array,
)
from hora.collectives.comm import Comm
from hora.collectives.ops import ReduceOp
from hora.collectives.ring import ring_reduce_scatter_inplace


def reducescatter(comm: Comm, buf: Array, counts: Sequence[int], op: ReduceOp, out: Array,
                  scratch: Array | None = None) -> None:
    """Reduce ``buf`` across ranks and leave segment ``comm.rank`` of the result in ``out``.

    Every rank of ``comm`` must call this in the same order with the same ``counts``, dtype and
    ``op``. Segment ``i`` is ``buf[sum(counts[:i]) : sum(counts[:i + 1])]``. ``buf`` is used as
    working space and is clobbered (its segment ``comm.rank`` holds the result too).
    ``out`` may be that segment of ``buf``.

    Args:
        comm: the group.
        buf: 1-D C-contiguous writable array of ``sum(counts)`` elements of a supported dtype.
        counts: elements of the result each rank receives (``comm.size`` non-negative ints).
        op: Sum, Average (reduced as Sum; the caller scales by ``1/size``), Min, Max or Product.
        out: 1-D C-contiguous writable array of ``counts[comm.rank]`` elements, same dtype.
        scratch: optional reusable uint8 array of at least ``max(counts) * itemsize`` bytes.

    Raises:
        ValueError: bad array shapes/layout or ``counts`` that do not match the buffers.
        TypeError: unsupported dtype, or ``buf`` and ``out`` dtypes differ.
        NotImplementedError: ``op`` is Adasum.
        PeerLostError, HoraTimeoutError: from the transport, naming the peer.
    """
    check_array(buf, "reducescatter buffer", writable=True)
    check_array(out, "reducescatter out", writable=True)
    check_same_dtype(buf, "reducescatter buffer", out, "reducescatter out")
    check_reducible(buf, "reducescatter buffer")
    op = elementwise_op(op)
    check_scratch(scratch)
    size, rank = comm.size, comm.rank
    counts = check_counts(counts, size, "reducescatter counts")
    bounds = offsets(counts)
    if buf.size != bounds[-1]:
        raise ValueError(
            f"reducescatter buffer has {buf.size} elements but sum(counts) = {bounds[-1]}"
        )
    if out.size != counts[rank]:
        raise ValueError(
            f"reducescatter out has {out.size} elements but counts[{rank}] = {counts[rank]}"
        )
    if size > 1 and bounds[-1] > 0:
        tmp = scratch_array(scratch, max(counts), buf.dtype)
        ring_reduce_scatter_inplace(comm, buf, bounds, op, tmp)
    np.copyto(out, buf[bounds[rank]:bounds[rank + 1]])
