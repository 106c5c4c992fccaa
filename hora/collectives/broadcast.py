"""Broadcast: a binomial tree for small buffers, a pipelined chain for large ones.

Why two algorithms (the choice is :func:`hora.collectives.select.select_broadcast`):

* The **binomial tree** finishes in ``ceil(log2 N)`` rounds, each moving the whole buffer; the
  fewest messages, so it wins when latency dominates. The root sends ``ceil(log2 N)`` copies,
  not ``N - 1``.
* The **pipelined chain** cuts the buffer into ~1 MiB chunks and streams them along
  ``root -> root+1 -> ... -> root-1``; each rank forwards chunk ``i`` to its right neighbour
  while receiving chunk ``i + 1`` from its left (one ``sendrecv``), so the whole broadcast
  takes about one buffer's transfer time plus ``N - 2`` chunk times, independent of ``N``. That
  beats both the tree (``log2 N`` buffer times) and scatter + ring allgather
  (``2 (N-1)/N`` buffer times) for large buffers, and like the ring it only uses neighbour links.

:func:`~hora.collectives.barrier.barrier` is re-exported here for callers that look for it
beside broadcast.
"""

from __future__ import annotations

from hora.collectives._buffers import Array, as_bytes, check_array
from hora.collectives.barrier import barrier
from hora.collectives.comm import Comm
from hora.collectives.select import PIPELINE_CHUNK_BYTES, select_broadcast


def _check(comm: Comm, buf: Array, root: int) -> None:
    check_array(buf, "broadcast buffer", writable=True)
    if not 0 <= root < comm.size:
        raise ValueError(f"broadcast root {root} is not a rank of a group of {comm.size}")


def broadcast(comm: Comm, buf: Array, root: int, *,
              chunk_bytes: int = PIPELINE_CHUNK_BYTES) -> None:
    """Copy ``root``'s ``buf`` into ``buf`` on every rank of ``comm``, in place.

    Every rank of ``comm`` must call this in the same order with a buffer of the same length and
    dtype and the same ``root``. Runs :func:`tree_broadcast` or :func:`chain_broadcast` as
    :func:`~hora.collectives.select.select_broadcast` decides.

    Args:
        comm: the group.
        buf: 1-D C-contiguous writable array; the data on ``root``, overwritten elsewhere.
        root: rank of ``comm`` that holds the data.
        chunk_bytes: chunk size for the pipelined chain (tests lower it).

    Raises:
        ValueError: ``root`` out of range; ``buf`` not 1-D, not contiguous or read-only.
        PeerLostError, HoraTimeoutError: from the transport, naming the peer.
    """
    _check(comm, buf, root)
    if comm.size == 1 or buf.nbytes == 0:
        return
    if select_broadcast(buf.nbytes, comm.size, chunk_bytes) == "chain":
        chain_broadcast(comm, buf, root, chunk_bytes)
    else:
        tree_broadcast(comm, buf, root)


def tree_broadcast(comm: Comm, buf: Array, root: int) -> None:
    """Binomial-tree broadcast, in place: ``ceil(log2 size)`` rounds of whole-buffer sends.

    With ``v = (rank - root) % size``, rank ``v`` receives once from ``v - lowbit(v)`` and then
    sends to ``v + m`` for each power of two ``m < lowbit(v)`` (largest subtree first).
    Same contract and errors as :func:`broadcast`.
    """
    _check(comm, buf, root)
    size, rank = comm.size, comm.rank
    if size == 1 or buf.nbytes == 0:
        return
    raw = as_bytes(buf)
    vrank = (rank - root) % size
    mask = 1
    while mask < size:
        if vrank & mask:
            comm.recv_into((rank - mask) % size, raw)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vrank + mask < size:
            comm.send((rank + mask) % size, raw)
        mask >>= 1


def chain_broadcast(comm: Comm, buf: Array, root: int,
                    chunk_bytes: int = PIPELINE_CHUNK_BYTES) -> None:
    """Pipelined chain broadcast, in place, in chunks of ``chunk_bytes``.

    Ranks form the chain ``root, root+1, ..., root-1`` (mod size). The root sends every chunk
    to its right neighbour; the last rank only receives; every other rank receives chunk 0, then
    forwards chunk ``i - 1`` while receiving chunk ``i`` (one ``sendrecv``), then forwards the
    last chunk. Same contract and errors as :func:`broadcast`.

    Raises:
        ValueError: also when ``chunk_bytes < 1``.
    """
    _check(comm, buf, root)
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    size, rank = comm.size, comm.rank
    if size == 1 or buf.nbytes == 0:
        return
    raw = as_bytes(buf)
    chunks = [raw[lo:lo + chunk_bytes] for lo in range(0, raw.size, chunk_bytes)]
    right, left = (rank + 1) % size, (rank - 1) % size
    vrank = (rank - root) % size
    if vrank == 0:
        for chunk in chunks:
            comm.send(right, chunk)
    elif vrank == size - 1:
        for chunk in chunks:
            comm.recv_into(left, chunk)
    else:
        comm.recv_into(left, chunks[0])
        for i in range(1, len(chunks)):
            comm.sendrecv(right, chunks[i - 1], left, chunks[i])
        comm.send(right, chunks[-1])


__all__ = ["barrier", "broadcast", "chain_broadcast", "tree_broadcast"]
