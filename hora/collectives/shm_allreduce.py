"""The shared-memory allreduce algorithms behind :meth:`hora.collectives.shm.ShmGroup.allreduce`.

Each is a function of the group's :class:`~hora.collectives.comm.Fabric`, the buffer, the
element-wise op and the collective's segment *parity* (see :mod:`hora.collectives.shm` for why
two segments make a final barrier unnecessary). Every rank ends with identical bytes: each
element is reduced by exactly one rank in a fixed order, or by every rank in the same order.
Each also multiplies the result by a *postscale* (an Average's ``1/size``) where it is still
in cache: the rank that reduces a slice scales it before publishing it (reducing into the
shared slot and scaling on each rank's copy out measured slower across two processes).
``replicated`` and :func:`chunked` may read this rank's input from a separate ``src`` (the
caller's tensor; the buffer is then only written), which saves copying it into the buffer
first.

* :func:`replicated` (small buffers, one signal round: copy in, signal, every rank folds every
  rank's copy into its buffer in rank order): the small allreduce of every fast-lane step, so
  its path stays short.
* :func:`chunked` (large private buffers, two signals per chunk; :func:`chunked_parts` runs it
  over several arrays as one buffer, :class:`Parts`, without packing them): per chunk of
  :data:`~hora.collectives.select.SHM_CHUNK_BYTES`, rank ``r`` exports the slices other ranks
  own into a slot of its segment, reduces its own slice straight from the peers' slots into its
  own buffer, publishes that slice, and imports the others', the three phases pipelined
  :data:`LOOKAHEAD` chunks apart over :data:`SLOTS` reused slots. Each rank's buffer is read and
  written about once; the slots stay in cache.
* :func:`staged` (the buffer *is* this rank's segment): reduce the own slice in place from the
  peers' segments, import the other slices; a last signal round hands the buffer back to the
  caller. No copy in at all. Small staged buffers use :func:`staged_small` (two rounds instead
  of three).

Both large-buffer algorithms are bound by memory bandwidth: chunked moves ~2.5x the buffer
through DRAM per rank, staged ~1.5x, so staged is the faster where the buffer can live in the
segment. Why chunks with a lookahead rather than one copy-in / reduce / copy-out, and the
figures: docs/benchmarks.md, "Measurements behind the code's constants".
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

import numpy as np

from hora.collectives._buffers import Array, even_counts, offsets
from hora.collectives.comm import U8, Fabric
from hora.collectives.ops import UFUNCS, ReduceOp, reduce_inplace, reduce_into, scale_inplace

WAIT_SPIN_BYTES = 256
"""A wait that follows a step over ``n`` bytes (a chunk exported or reduced by the peer) checks
the peer's counter at least ``n // WAIT_SPIN_BYTES`` times before it sleeps (where every rank
has a core): about as long as the peer's step itself takes (a check costs a few dozen
nanoseconds of Python, a byte a fraction of one), so a peer a step behind is caught without a
futex sleep and wake-up, whose latency grows to a scheduler tick when other processes want the
core. A rank that spins there only holds its own core, which it needs again at once."""


SegmentViews = list[tuple[U8, int, Any, Array] | None]
"""A group's views of its segments for :func:`replicated`: one slot per parity and rank
(``parity * size + rank``), each ``(segment array, nbytes, dtype, view)``."""


def replicated(fabric: Fabric, buf: Array, op: ReduceOp, parity: int, src: Array | None = None,
               postscale: float = 1.0, views: SegmentViews | None = None) -> None:
    """The shared-memory allreduce of small buffers (one signal round): copy this rank's input
    into its segment, signal, and fold every rank's copy into ``buf`` in rank order, the same
    bytes on every rank; then multiply by ``postscale``. ``src``: this rank's input when it is
    not in ``buf``. ``views``: the caller's views of the segments, kept from op to op (a view
    is made again when its segment was remapped, or the size or dtype changed: slicing and
    viewing cost more than the 4 KiB reduction). It is the small allreduce of every fast-lane
    step: written out with as few calls as it takes."""
    nbytes, dtype, rank, size = buf.nbytes, buf.dtype, fabric.rank, fabric.size
    data = buf if src is None else src
    if views is None:
        views = [None] * (2 * size)
    k = parity * size
    base = fabric.reserve(parity, nbytes)
    v = views[k + rank]
    if v is None or v[0] is not base or v[1] != nbytes or v[2] is not dtype:
        v = views[k + rank] = (base, nbytes, dtype, base[:nbytes].view(dtype))
    mine = v[3]
    mine[...] = data
    fabric.wait_all(fabric.post())
    ufunc = UFUNCS[op]
    if ufunc is np.add and dtype.kind == "b":  # (bool)
        ufunc = np.logical_or
    # ((x0 op x1) op x2) ... on every rank: the same bytes everywhere
    first = data
    for j in range(size):
        if j == rank:
            other = mine
        else:
            base = fabric.peer(j, parity, nbytes)
            v = views[k + j]
            if v is None or v[0] is not base or v[1] != nbytes or v[2] is not dtype:
                v = views[k + j] = (base, nbytes, dtype, base[:nbytes].view(dtype))
            other = v[3]
        if j == 0:
            first = data if rank == 0 else other
        else:
            ufunc(first, other, out=buf)
            first = buf
    if postscale != 1.0:
        scale_inplace(buf, postscale)


def view(raw: U8, nbytes: int, dtype: np.dtype[Any]) -> Array:
    """The first ``nbytes`` of a uint8 segment as ``dtype``."""
    return raw[:nbytes].view(dtype)


def sync(fabric: Fabric, nbytes: int = 0) -> None:
    """Post one signal and wait for every peer's matching one (after a step over ``nbytes``:
    :data:`WAIT_SPIN_BYTES`)."""
    fabric.wait_all(fabric.post(), nbytes // WAIT_SPIN_BYTES)


def segments(fabric: Fabric, parity: int, nbytes: int, dtype: np.dtype[Any]) -> list[Array]:
    """Every rank's segment ``parity`` as ``dtype`` (this rank's own included), in rank order."""
    return [view(fabric.own(parity) if j == fabric.rank else fabric.peer(j, parity, nbytes),
                 nbytes, dtype) for j in range(fabric.size)]


LOOKAHEAD = 1
"""Chunks a rank exports ahead of the one it reduces (and reduces ahead of the one it imports),
so that a rank a little behind does not stall the others at every chunk."""

SLOTS = 3 * LOOKAHEAD + 2
"""Chunk slots per segment. Slot ``c % SLOTS`` is rewritten for chunk ``c`` once every peer has
posted the export signal of chunk ``c - 1 - LOOKAHEAD``, which it does after importing chunk
``c - 1 - 3 * LOOKAHEAD`` = ``c - SLOTS + 1``: after its last read of the slot's old chunk."""


class Parts:
    """Arrays reduced as one buffer without being packed into one: their concatenation, each
    read from its input and written into its output where it lives (a fused allreduce of
    tensors, with no fusion buffer and no copy in or out).

    ``dsts``: 1-D C-contiguous arrays of one dtype; ``srcs``: their inputs (same sizes; None, or
    an item None: the input is the output itself, reduced in place). Empty arrays are skipped.
    """

    __slots__ = ("dsts", "dtype", "size", "srcs", "starts")

    def __init__(self, dsts: Sequence[Array], srcs: Sequence[Array | None] | None = None) -> None:
        pairs = [(d, d if s is None else s)
                 for d, s in zip(dsts, srcs if srcs is not None else [None] * len(dsts))]
        self.dtype = dsts[0].dtype if dsts else np.dtype(np.uint8)
        self.dsts = [d for d, _ in pairs if d.size]
        self.srcs = [s for d, s in pairs if d.size]
        starts = [0]
        for d in self.dsts:
            starts.append(starts[-1] + d.size)
        self.starts = starts
        self.size = starts[-1]

    def pieces(self, a: int, b: int) -> list[tuple[Array, Array, int, int]]:
        """Elements ``[a, b)`` of the concatenation: (input piece, output piece, its offset from
        ``a``, its length) per array they span, in order."""
        starts = self.starts
        if len(starts) == 2:  # (one array: one piece)
            return [(self.srcs[0][a:b], self.dsts[0][a:b], 0, b - a)] if b > a else []
        out = []
        i = bisect_right(starts, a) - 1
        at = a
        while at < b:
            lo, end = starts[i], min(b, starts[i + 1])
            out.append((self.srcs[i][at - lo:end - lo], self.dsts[i][at - lo:end - lo], at - a,
                        end - at))
            at = end
            i += 1
        return out


def chunked(fabric: Fabric, buf: Array, op: ReduceOp, parity: int, chunk_bytes: int,
            src: Array | None = None, postscale: float = 1.0) -> None:
    """:func:`chunked_parts` of one buffer (``src``: its input when not in ``buf``)."""
    chunked_parts(fabric, Parts([buf], [src]), op, parity, chunk_bytes, postscale)


def chunked_parts(fabric: Fabric, parts: Parts, op: ReduceOp, parity: int, chunk_bytes: int,
                  postscale: float = 1.0) -> None:
    rank, size = fabric.rank, fabric.size
    dtype, total = parts.dtype, parts.size
    item = dtype.itemsize
    per_chunk = max(size, chunk_bytes // item)
    nchunks = -(-total // per_chunk)
    need = min(nchunks, SLOTS) * per_chunk * item if nchunks > 1 else total * item
    mine = view(fabric.reserve(parity, need), need, dtype)
    segs: list[Array] = []
    others = [j for j in range(size) if j != rank]
    exported: list[int] = []  # this rank's signal count after exporting chunk c (so: a peer's)
    reduced: list[int] = []
    spins = per_chunk * item // WAIT_SPIN_BYTES
    ufunc = UFUNCS.get(op)
    if ufunc is None:
        raise NotImplementedError(f"{ReduceOp(op).name} is not an element-wise reduction")
    if ufunc is np.add and dtype == np.bool_:
        ufunc = np.logical_or
    # per chunk: its slot's start in the segments, the ranks' slice bounds within it (the same
    # for every full chunk), and each rank's slice as pieces of the arrays (input, output,
    # offset in the slice, length): computed once, not three times per chunk
    full = offsets(even_counts(per_chunk, size))
    plan = []
    for chunk, lo in enumerate(range(0, total, per_chunk)):
        b = full if lo + per_chunk <= total else offsets(even_counts(total - lo, size))
        plan.append(((chunk % SLOTS) * per_chunk, b,
                     [parts.pieces(lo + b[k], lo + b[k + 1]) for k in range(size)]))

    for step in range(nchunks + 2 * LOOKAHEAD):
        chunk = step
        if chunk < nchunks:  # export the slices other ranks own, for them to reduce
            slot, b, pieces = plan[chunk]
            for k in others:
                at = slot + b[k]
                for x, _, off, n in pieces[k]:
                    np.copyto(mine[at + off:at + off + n], x)
            exported.append(fabric.post())
        chunk = step - LOOKAHEAD
        if 0 <= chunk < nchunks:  # reduce this rank's slice straight into its outputs, publish
            slot, b, pieces = plan[chunk]
            fabric.wait_all(exported[chunk], spins)
            if not segs:
                segs = segments(fabric, parity, need, dtype)
            at = slot + b[rank]
            for x, own, off, n in pieces[rank]:
                lo, hi = at + off, at + off + n
                first = x
                for j in others:  # (a slice is reduced by its owner alone: one result everywhere)
                    ufunc(first, segs[j][lo:hi], out=own)
                    first = own
                if postscale != 1.0:
                    scale_inplace(own, postscale)
                np.copyto(mine[lo:hi], own)
            reduced.append(fabric.post())
        chunk = step - 2 * LOOKAHEAD
        if 0 <= chunk < nchunks:  # import the slices other ranks reduced
            slot, b, pieces = plan[chunk]
            fabric.wait_all(reduced[chunk], spins)
            for j in others:
                at = slot + b[j]
                seg = segs[j]
                for _, out, off, n in pieces[j]:
                    np.copyto(out, seg[at + off:at + off + n])


def staged_small(fabric: Fabric, buf: Array, op: ReduceOp, parity: int, tmp: Array,
                 postscale: float = 1.0) -> None:
    """:func:`replicated` for a staged buffer: fold every segment into ``tmp`` (peers are still
    reading this rank's segment, so not into ``buf``), then copy back after a second round."""
    sync(fabric)
    segs = segments(fabric, parity, buf.nbytes, buf.dtype)
    reduce_into(tmp, segs[0], segs[1], op)
    for seg in segs[2:]:
        reduce_inplace(tmp, seg, op)
    scale_inplace(tmp, postscale)
    sync(fabric)
    np.copyto(buf, tmp)


def staged(fabric: Fabric, buf: Array, op: ReduceOp, parity: int,
           postscale: float = 1.0) -> None:
    rank, size = fabric.rank, fabric.size
    b = offsets(even_counts(buf.size, size))
    sync(fabric, buf.nbytes)  # every rank's packed data is in place
    segs = segments(fabric, parity, buf.nbytes, buf.dtype)
    own = buf[b[rank]:b[rank + 1]]
    for j in range(size):
        if j != rank:
            reduce_inplace(own, segs[j][b[rank]:b[rank + 1]], op)
    scale_inplace(own, postscale)
    sync(fabric, own.nbytes)
    for j in range(size):
        if j != rank:
            np.copyto(buf[b[j]:b[j + 1]], segs[j][b[j]:b[j + 1]])
    # nobody reads this segment any more once every peer imported: the caller may write it
    sync(fabric, buf.nbytes - own.nbytes)


__all__ = ["LOOKAHEAD", "SLOTS", "WAIT_SPIN_BYTES", "Parts", "chunked", "chunked_parts", "segments",
           "staged", "staged_small", "sync", "view"]
