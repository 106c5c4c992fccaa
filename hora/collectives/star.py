"""Star ("parameter server") allreduce: everyone sends to rank 0, rank 0 reduces and replies.

Not a good algorithm: rank 0's link carries ``2 * (size - 1)`` full buffers, so its cost grows
linearly with the number of ranks while the ring's stays flat. It exists so that the benchmark
can show exactly that, and as a simple, obviously-correct reference.
"""

from __future__ import annotations

from hora.collectives._buffers import (
    Array,
    as_bytes,
    check_allreduce_args,
    scratch_array,
)
from hora.collectives.comm import Comm
from hora.collectives.ops import ReduceOp, reduce_inplace

ROOT = 0
"""The rank that plays the parameter server."""


def star_allreduce(comm: Comm, buf: Array, op: ReduceOp, scratch: Array | None = None) -> None:
    """Allreduce through rank 0, in place.

    Every rank of ``comm`` must call this in the same order with a buffer of the same length and
    dtype and the same ``op``. Non-root ranks only talk to rank 0: one ``send`` of the whole
    buffer, then one ``recv_into``. Rank 0 receives from ranks ``1..size-1`` in order, reducing
    each into its buffer (so the reduction order is fixed: ``((x0 op x1) op x2) ...``), then
    sends the result to each. Every rank ends with rank 0's bytes.

    Args:
        comm: the group.
        buf: 1-D C-contiguous array of a supported dtype; replaced by the reduction in place.
        op: Sum, Average (reduced as Sum; the caller scales by ``1/size``), Min, Max or Product.
        scratch: optional reusable uint8 array of at least ``buf.nbytes`` bytes (used on rank 0).

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
    raw = as_bytes(buf)
    if comm.rank != ROOT:
        comm.send(ROOT, raw)
        comm.recv_into(ROOT, raw)
        return
    tmp = scratch_array(scratch, buf.size, buf.dtype)
    tmp_raw = as_bytes(tmp)
    for peer in range(size):
        if peer != ROOT:
            comm.recv_into(peer, tmp_raw)
            reduce_inplace(buf, tmp, op)
    for peer in range(size):
        if peer != ROOT:
            comm.send(peer, raw)
