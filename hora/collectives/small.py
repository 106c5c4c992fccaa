"""Latency-optimal allreduce for small messages: recursive doubling.

For small buffers the per-message latency dominates, and the ring's ``2 * (size - 1)`` messages
cost more than recursive doubling's ``log2(size)`` rounds of full-buffer exchanges.

Non-power-of-two sizes use the standard fold: with ``p`` the largest power of two ``<= size``
and ``extra = size - p``, each odd rank ``2i + 1 < 2 * extra`` hands its buffer to rank ``2i``
and sits out; the remaining ``p`` ranks (virtual ranks in the same order as their real ranks) do
``log2(p)`` exchange rounds; finally rank ``2i`` sends the result back to ``2i + 1``.

Determinism: in every combine the partner with the lower (virtual) rank supplies the left
operand, so both partners compute the same expression on the same bytes and every rank ends
with bitwise identical results, even for floats (and for ``min(0.0, -0.0)``, which is not
bitwise commutative).
"""

from __future__ import annotations

import numpy as np

from hora.collectives._buffers import (
    Array,
    as_bytes,
    check_allreduce_args,
    scratch_array,
)
from hora.collectives.comm import Comm
from hora.collectives.ops import ReduceOp, reduce_inplace


def small_allreduce(comm: Comm, buf: Array, op: ReduceOp, scratch: Array | None = None) -> None:
    """Recursive-doubling allreduce, in place; ``ceil(log2(size))`` rounds (+2 when folding).

    Every rank of ``comm`` must call this in the same order with a buffer of the same length and
    dtype and the same ``op``. Every rank ends with identical bytes.

    Args:
        comm: the group.
        buf: 1-D C-contiguous array of a supported dtype; replaced by the reduction in place.
        op: Sum, Average (reduced as Sum; the caller scales by ``1/size``), Min, Max or Product.
        scratch: optional reusable uint8 array of at least ``buf.nbytes`` bytes.

    Raises:
        ValueError: ``buf`` is not 1-D, not contiguous or read-only, or ``scratch`` is malformed.
        TypeError: ``buf`` has an unsupported dtype.
        NotImplementedError: ``op`` is Adasum.
        PeerLostError, HoraTimeoutError: from the transport, naming the peer.
    """
    op = check_allreduce_args(buf, op, scratch)
    size, rank = comm.size, comm.rank
    if size == 1 or buf.size == 0:
        return
    tmp = scratch_array(scratch, buf.size, buf.dtype)
    raw, tmp_raw = as_bytes(buf), as_bytes(tmp)
    pof2 = 1 << (size.bit_length() - 1)
    extra = size - pof2

    # Fold: odd ranks below 2*extra give their data to the even rank below them and wait.
    if rank < 2 * extra:
        if rank % 2 == 1:
            comm.send(rank - 1, raw)
            comm.recv_into(rank - 1, raw)
            return
        comm.recv_into(rank + 1, tmp_raw)
        reduce_inplace(buf, tmp, op)  # lower rank's data is the left operand
        vrank = rank // 2
    else:
        vrank = rank - extra

    mask = 1
    while mask < pof2:
        vpeer = vrank ^ mask
        peer = 2 * vpeer if vpeer < extra else vpeer + extra
        comm.sendrecv(peer, raw, peer, tmp_raw)
        if vrank < vpeer:
            reduce_inplace(buf, tmp, op)
        else:
            reduce_inplace(tmp, buf, op)  # partner's (lower) data stays the left operand
            np.copyto(raw, tmp_raw)
        mask <<= 1

    # Unfold: hand the result back to the rank that sat out.
    if rank < 2 * extra:
        comm.send(rank + 1, raw)
