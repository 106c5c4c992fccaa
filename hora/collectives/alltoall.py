"""All-to-all with per-destination counts (pairwise exchange).

Rank ``r`` sends a different slice of its buffer to every rank and receives one slice from
every rank. Schedule: at step ``k = 1..size-1`` rank ``r`` sends to ``(r + k) % size`` while
receiving from ``(r - k) % size`` in one ``sendrecv``; both ends of every transfer are in the
same step, so the schedule cannot deadlock. The slice a rank sends to itself is copied locally.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hora.collectives._buffers import (
    Array,
    as_bytes,
    check_array,
    check_counts,
    check_same_dtype,
    offsets,
)
from hora.collectives.comm import Comm


def alltoall(comm: Comm, sendbuf: Array, send_counts: Sequence[int], recvbuf: Array,
             recv_counts: Sequence[int]) -> None:
    """Exchange slices between every pair of ranks.

    Every rank of ``comm`` must call this in the same order with the same dtype, and the counts
    must agree pairwise: ``send_counts[j]`` on rank ``r`` equals ``recv_counts[r]`` on rank
    ``j`` (the engine negotiates this; a disagreement here corrupts the byte streams).

    Rank ``r`` sends ``sendbuf[sum(send_counts[:j]) : +send_counts[j]]`` to rank ``j`` and
    receives ``recv_counts[j]`` elements from rank ``j`` into ``recvbuf`` at offset
    ``sum(recv_counts[:j])``. Counts may be zero.

    Args:
        comm: the group.
        sendbuf: 1-D C-contiguous array of ``sum(send_counts)`` elements.
        send_counts: elements sent to each rank (``comm.size`` non-negative ints).
        recvbuf: 1-D C-contiguous writable array of ``sum(recv_counts)`` elements, same dtype;
            must not overlap ``sendbuf``.
        recv_counts: elements received from each rank.

    Raises:
        ValueError: bad layout, counts that do not match the buffers or each other for this
            rank's own slice, or overlapping buffers.
        TypeError: ``sendbuf`` and ``recvbuf`` dtypes differ.
        PeerLostError, HoraTimeoutError: from the transport, naming the peer.
    """
    check_array(sendbuf, "alltoall sendbuf", writable=False)
    check_array(recvbuf, "alltoall recvbuf", writable=True)
    check_same_dtype(sendbuf, "alltoall sendbuf", recvbuf, "alltoall recvbuf")
    size, rank = comm.size, comm.rank
    send_counts = check_counts(send_counts, size, "alltoall send_counts")
    recv_counts = check_counts(recv_counts, size, "alltoall recv_counts")
    send_off, recv_off = offsets(send_counts), offsets(recv_counts)
    if sendbuf.size != send_off[-1]:
        raise ValueError(
            f"alltoall sendbuf has {sendbuf.size} elements but sum(send_counts) = {send_off[-1]}"
        )
    if recvbuf.size != recv_off[-1]:
        raise ValueError(
            f"alltoall recvbuf has {recvbuf.size} elements but sum(recv_counts) = {recv_off[-1]}"
        )
    if send_counts[rank] != recv_counts[rank]:
        raise ValueError(
            f"rank {rank} sends itself {send_counts[rank]} elements but expects to receive "
            f"{recv_counts[rank]} from itself"
        )
    if sendbuf.size and recvbuf.size and np.may_share_memory(sendbuf, recvbuf):
        raise ValueError("alltoall sendbuf and recvbuf must not overlap")

    np.copyto(recvbuf[recv_off[rank]:recv_off[rank + 1]],
              sendbuf[send_off[rank]:send_off[rank + 1]])
    send_raw, recv_raw, item = as_bytes(sendbuf), as_bytes(recvbuf), sendbuf.itemsize
    for step in range(1, size):
        dst, src = (rank + step) % size, (rank - step) % size
        comm.sendrecv(dst, send_raw[send_off[dst] * item:send_off[dst + 1] * item],
                      src, recv_raw[recv_off[src] * item:recv_off[src + 1] * item])
