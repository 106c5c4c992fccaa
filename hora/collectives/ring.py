"""Ring algorithms: reduce-scatter, allgather and the ring allreduce built from them.

The buffer is cut into ``size`` segments. In every step each rank does exactly one
:meth:`~hora.collectives.comm.Comm.sendrecv`, sending one segment to its right neighbour
``(rank + 1) % size`` while receiving one from its left neighbour ``(rank - 1) % size``, so each
link carries ``(size - 1) / size`` of the buffer per phase whatever the number of ranks
(bandwidth-optimal). Allreduce = reduce-scatter (``size - 1`` steps) + allgather
(``size - 1`` steps).

Each segment is reduced exactly once along a fixed path of the ring and then copied around it,
so every rank ends with the same bytes even for floating point.

The two phases are exposed as in-place primitives over explicit segment offsets so that
:mod:`hora.collectives.allgather` and :mod:`hora.collectives.reducescatter` (uneven counts) share
one implementation with :func:`ring_allreduce`.
"""

from __future__ import annotations

from collections.abc import Sequence

from hora.collectives._buffers import (
    Array,
    as_bytes,
    check_allreduce_args,
    even_counts,
    offsets,
    scratch_array,
)
from hora.collectives.comm import Comm
from hora.collectives.ops import ReduceOp, reduce_inplace


def ring_reduce_scatter_inplace(comm: Comm, buf: Array, bounds: Sequence[int], op: ReduceOp,
                                tmp: Array) -> None:
    """Ring reduce-scatter in place: afterwards segment ``comm.rank`` of ``buf`` is reduced.

    Segment ``i`` is ``buf[bounds[i]:bounds[i + 1]]``. At step ``s`` (``0 <= s < size - 1``)
    rank ``r`` sends segment ``(r - s - 1) % size`` and receives segment ``(r - s - 2) % size``,
    reducing it into its own copy; the last segment it receives is its own. Other segments hold
    partial results afterwards.

    Args:
        comm: the group; every member calls this with the same ``bounds``.
        buf: 1-D contiguous array, modified in place.
        bounds: ``size + 1`` segment offsets in elements.
        op: an element-wise op (already mapped by ``elementwise_op``).
        tmp: array of ``buf.dtype`` with at least ``max segment`` elements.
    """
    size, rank = comm.size, comm.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    raw, tmp_raw, item = as_bytes(buf), as_bytes(tmp), buf.itemsize
    for step in range(size - 1):
        send_seg = (rank - step - 1) % size
        recv_seg = (rank - step - 2) % size
        lo, hi = bounds[recv_seg], bounds[recv_seg + 1]
        comm.sendrecv(right, raw[bounds[send_seg] * item:bounds[send_seg + 1] * item],
                      left, tmp_raw[:(hi - lo) * item])
        if hi > lo:
            reduce_inplace(buf[lo:hi], tmp[:hi - lo], op)


def ring_allgather_inplace(comm: Comm, buf: Array, bounds: Sequence[int]) -> None:
    """Ring allgather in place: segment ``comm.rank`` of ``buf`` is copied to every rank.

    At step ``s`` (``0 <= s < size - 1``) rank ``r`` sends segment ``(r - s) % size`` and
    receives segment ``(r - s - 1) % size`` directly into ``buf``.

    Args:
        comm: the group; every member calls this with the same ``bounds``.
        buf: 1-D contiguous array whose segment ``comm.rank`` holds this rank's data.
        bounds: ``size + 1`` segment offsets in elements.
    """
    size, rank = comm.size, comm.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    raw, item = as_bytes(buf), buf.itemsize
    for step in range(size - 1):
        send_seg = (rank - step) % size
        recv_seg = (rank - step - 1) % size
        comm.sendrecv(right, raw[bounds[send_seg] * item:bounds[send_seg + 1] * item],
                      left, raw[bounds[recv_seg] * item:bounds[recv_seg + 1] * item])


def ring_allreduce(comm: Comm, buf: Array, op: ReduceOp, scratch: Array | None = None) -> None:
    """Bandwidth-optimal allreduce: ring reduce-scatter then ring allgather, in place.

    Every rank of ``comm`` must call this in the same order with a buffer of the same length and
    dtype and the same ``op``. ``buf`` is split into ``comm.size`` chunks whose sizes differ by at
    most one element (empty chunks when ``len(buf) < comm.size``). Each rank makes exactly
    ``2 * (size - 1)`` ``sendrecv`` calls, all to its right neighbour and from its left one; none
    when ``size == 1`` or the buffer is empty. Every rank ends with identical bytes.

    Args:
        comm: the group.
        buf: 1-D C-contiguous array of a supported dtype; replaced by the reduction in place.
        op: Sum, Average (reduced as Sum; the caller scales by ``1/size``), Min, Max or Product.
        scratch: optional reusable uint8 array for received chunks; ``ceil(len(buf) / size)``
            elements' worth of bytes (``buf.nbytes`` always suffices). Allocated if None or too
            small.

    Raises:
        ValueError: ``buf`` is not 1-D, not contiguous or read-only, or ``scratch`` is malformed.
        TypeError: ``buf`` has an unsupported dtype.
        NotImplementedError: ``op`` is Adasum.
        PeerLostError, HoraTimeoutError: from the transport, naming the peer.
    """
    op = check_allreduce_args(buf, op, scratch)
    size = comm.size
    if size == 1 or buf.size == 0:
        return
    counts = even_counts(buf.size, size)
    tmp = scratch_array(scratch, counts[0], buf.dtype)
    bounds = offsets(counts)
    ring_reduce_scatter_inplace(comm, buf, bounds, op, tmp)
    ring_allgather_inplace(comm, buf, bounds)
