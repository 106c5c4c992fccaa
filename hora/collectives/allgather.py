"""Allgather with per-rank counts (ring algorithm).

Rank ``i`` contributes ``counts[i]`` elements (possibly zero); every rank ends with the
concatenation in rank order. Uses the shared ring primitive of :mod:`hora.collectives.ring`:
``size - 1`` steps, each one ``sendrecv`` to the right neighbour and from the left one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hora.collectives._buffers import Array, check_array, check_counts, check_same_dtype, offsets
from hora.collectives.comm import Comm
from hora.collectives.ring import ring_allgather_inplace


def allgather(comm: Comm, sendbuf: Array, counts: Sequence[int], out: Array) -> None:
    """Gather every rank's ``sendbuf`` into ``out`` on every rank, in rank order.

    Every rank of ``comm`` must call this in the same order with the same ``counts`` and dtype.
    Rank ``i``'s data lands at ``out[sum(counts[:i]) : sum(counts[:i + 1])]``. ``sendbuf`` may
    alias (part of) ``out``, e.g. be this rank's own slot: it is copied into place before any
    data is received.

    Args:
        comm: the group.
        sendbuf: 1-D C-contiguous array of ``counts[comm.rank]`` elements.
        counts: elements contributed by each rank (``comm.size`` non-negative ints).
        out: 1-D C-contiguous writable array of ``sum(counts)`` elements, same dtype.

    Raises:
        ValueError: bad array shapes/layout or ``counts`` that do not match the buffers.
        TypeError: ``sendbuf`` and ``out`` dtypes differ.
        PeerLostError, HoraTimeoutError: from the transport, naming the peer.
    """
    check_array(sendbuf, "allgather sendbuf", writable=False)
    check_array(out, "allgather out", writable=True)
    check_same_dtype(sendbuf, "allgather sendbuf", out, "allgather out")
    size, rank = comm.size, comm.rank
    counts = check_counts(counts, size, "allgather counts")
    bounds = offsets(counts)
    if sendbuf.size != counts[rank]:
        raise ValueError(
            f"allgather sendbuf has {sendbuf.size} elements but counts[{rank}] = {counts[rank]}"
        )
    if out.size != bounds[-1]:
        raise ValueError(f"allgather out has {out.size} elements but sum(counts) = {bounds[-1]}")
    np.copyto(out[bounds[rank]:bounds[rank + 1]], sendbuf)
    if size == 1 or bounds[-1] == 0:
        return
    ring_allgather_inplace(comm, out, bounds)
