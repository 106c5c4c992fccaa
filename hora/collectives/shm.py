"""Collectives for ranks on one host, over shared memory: :class:`ShmGroup`.

The algorithms move tensor bytes only through shared memory segments; the only thing that
crosses the kernel is a futex wake. They are written against the small :class:`Fabric`
protocol (segments + signals), implemented by :class:`hora.transports.shm_fabric.ShmFabric`,
the same way the ring algorithms are written against :class:`~hora.collectives.comm.Comm`::

    group = ShmGroup(ShmFabric.create(comm, job_id, timeout=30.0))
    group.allreduce(buf, ReduceOp.Sum)

How a collective stays consistent without a final barrier: every rank has two data segments
and consecutive collectives alternate between them (the *parity*). In every collective every
rank posts at least one signal after writing its segment and waits for every peer's signals
before returning, and reads peers' segments only within the collective. So when a rank writes
a segment again (two collectives later) every peer has signalled it in the collective in
between, i.e. has finished reading it. A collective that signals nothing (one rank, empty
buffers) does not count: it leaves the parity as it is.

Allreduce has three algorithms (in :mod:`hora.collectives.shm_allreduce`), picked by
:func:`hora.collectives.select.select_shm_allreduce` and by whether the buffer is a
:meth:`ShmGroup.staging` view: ``replicated`` (small buffers, one signal round), ``chunked``
(large private buffers: owner-computes, pipelined over cache-sized chunk slots) and ``staged``
(the buffer already lives in this rank's segment, e.g. a fusion buffer packed there: no copy
in). :meth:`ShmGroup.allreduce_parts` runs ``chunked`` over several arrays as one buffer where
they live (a fused allreduce of tensors: no fusion buffer, no copy in or out). All leave
bitwise-identical results on every rank.

Failure: a collective that raises (timeout, lost peer, full ``/dev/shm``) closes the group, so
its peers raise :class:`~hora.errors.PeerLostError` at once instead of waiting for the timeout;
the group cannot be used afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

import numpy as np

from hora._util.cpus import usable_cpus
from hora.collectives import shm_allreduce
from hora.collectives._buffers import (
    Array,
    check_array,
    check_counts,
    check_reducible,
    check_same_dtype,
    elementwise_op,
    offsets,
)
from hora.collectives.comm import U8, Fabric
from hora.collectives.ops import REDUCIBLE, ReduceOp, reduce_inplace, scale_inplace
from hora.collectives.select import (
    SHM_CHUNK_BYTES,
    SHM_CHUNK_BYTES_OVERSUBSCRIBED,
    SHM_ONE_CHUNK_BYTES,
    SHM_SMALL_ALLREDUCE_BYTES,
    shm_replicated_bytes,
)
from hora.collectives.shm_allreduce import Parts, SegmentViews, replicated, sync, view
from hora.errors import MismatchError, TransportError

_SUM, _AVERAGE = ReduceOp.Sum, ReduceOp.Average  # (enum members through their class: slow)

_TABLE_ALIGN = 64


class _Collective:
    """See :meth:`ShmGroup._collective` (a class: ~10x cheaper than ``@contextmanager``)."""

    __slots__ = ("_group", "_posted")

    def __init__(self, group: ShmGroup) -> None:
        self._group = group
        self._posted = group._fabric.posted

    def __enter__(self) -> int:
        return self._group._parity

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        group = self._group
        if exc is not None:
            group._fail(exc)
        elif group._fabric.posted != self._posted:  # a collective that signalled nothing (one
            group._parity ^= 1  # rank, empty buffers) must not flip: see the module docstring


class ShmGroup:
    """Collectives among the ranks of one host over shared memory.

    Every member must call the same collectives in the same order with the same sizes (as with
    every hora collective); each method returns when this rank's result is complete. One thread
    at a time. Waits raise :class:`~hora.errors.HoraTimeoutError` /
    :class:`~hora.errors.PeerLostError` naming the peer.

    Args:
        fabric: the group's segments and signals, e.g.
            ``hora.transports.shm_fabric.ShmFabric.create(comm, job_id, timeout=...)``.
    """

    def __init__(self, fabric: Fabric) -> None:
        self._fabric = fabric
        self._parity = 0
        self._staged: tuple[int, int] | None = None  # (parity, nbytes) handed out by staging()
        self._broken: str | None = None
        self._scratch = np.empty(SHM_SMALL_ALLREDUCE_BYTES, np.uint8)
        # every rank has a core of its own when the group's ranks together may use as many
        # (ShmFabric.cores: the union of their affinity masks; a launcher that binds each rank to
        # one core leaves each process a single core, which is not oversubscription)
        self._cores: int = getattr(fabric, "cores", 0) or usable_cpus()
        self._size = fabric.size
        self._replicated_bytes = shm_replicated_bytes(fabric.size)
        self._views: SegmentViews = [None] * (2 * fabric.size)  # (replicated()'s)

    @property
    def rank(self) -> int:
        return self._fabric.rank

    @property
    def size(self) -> int:
        return self._fabric.size

    @property
    def fabric(self) -> Fabric:
        return self._fabric

    def describe(self, peer: int) -> str:
        return self._fabric.describe(peer)

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        """A collective failed: close the group (see :meth:`_collective`)."""
        self._broken = f"{type(exc).__name__}: {exc}"
        self._views = [None] * len(self._views)  # (they would keep the segments mapped)
        self._fabric.close()

    def _collective(self, staged_buf: Array | None = None) -> _Collective:
        """Context of one collective: ``with self._collective() as parity``.

        On failure it closes the group and re-raises. Closing tells every peer at once (they
        raise PeerLostError naming this rank instead of waiting for the timeout); the group is
        unusable afterwards, as its ranks' signal counts no longer match.
        """
        if self._broken is not None:
            raise TransportError(f"this shared-memory group failed earlier ({self._broken}) "
                                 "and cannot be used any more")
        if self._staged is not None:
            parity, nbytes = self._staged
            self._staged = None
            if staged_buf is None or not self._is_staged(staged_buf, parity, nbytes):
                raise ValueError(
                    "ShmGroup.staging() handed out a buffer for the next collective, but it was "
                    "not passed to it; HINT: pass the staging view (or a prefix) to the very "
                    "next allreduce, or do not call staging()")
        return _Collective(self)

    def _is_staged(self, buf: Array, parity: int, nbytes: int) -> bool:
        own = self._fabric.own(parity)
        return (buf.nbytes <= nbytes and own.nbytes >= buf.nbytes
                and buf.ctypes.data == own.ctypes.data)

    # ---- allreduce -----------------------------------------------------------------------------
    def staging(self, nbytes: int) -> U8:
        """A ``nbytes`` uint8 view of this rank's segment for the *next* collective's buffer.

        Pack the next :meth:`allreduce`'s input into (a prefix of) it, viewed as the dtype, and
        pass that view: the allreduce then copies nothing in. The view holds the result
        afterwards, and belongs to the caller until the next collective of this group starts.
        Every rank must use staging the same way for the same collective.

        Raises:
            TransportError: shared memory is full.
        """
        if nbytes < 0:
            raise ValueError(f"staging size must be >= 0, got {nbytes}")
        parity = self._parity
        raw = self._fabric.reserve(parity, max(nbytes, 1))
        self._staged = (parity, nbytes)
        return raw[:nbytes]

    def allreduce(self, buf: Array, op: ReduceOp, *, algorithm: str | None = None,
                  src: Array | None = None, postscale: float = 1.0) -> None:
        """Reduce ``buf`` element-wise across the group, in place; identical bytes on every rank.

        Args:
            buf: 1-D C-contiguous writable array of a supported dtype, or a view from
                :meth:`staging`.
            op: Sum, Average (reduced as Sum; the caller scales by ``1/size``, e.g. through
                ``postscale``), Min, Max or Product.
            algorithm: force ``"replicated"`` or ``"chunked"`` (benchmarks); default: chosen by
                :func:`~hora.collectives.select.select_shm_allreduce`. Ignored for a staged
                buffer.
            src: this rank's input when it is not in ``buf`` (same dtype and size, not
                overlapping ``buf``; left unchanged): ``buf`` is then only written, which saves
                copying ``src`` into it first. Not with a staged buffer.
            postscale: the result is multiplied by it
                (:func:`~hora.collectives.ops.scale_inplace`), while each slice is in cache.

        Raises:
            ValueError: bad buffer, or a staging view was handed out and not used here.
            TypeError: unsupported dtype.
            NotImplementedError: ``op`` is Adasum.
            PeerLostError, HoraTimeoutError: a peer died, closed, or is stuck (named).
        """
        # The checks cost no call when they pass (this runs for every op of the fast lane).
        if not isinstance(buf, np.ndarray) or buf.ndim != 1 \
                or not (flags := buf.flags).c_contiguous or not flags.writeable:
            check_array(buf, "allreduce buffer", writable=True)
        if buf.dtype not in REDUCIBLE:
            check_reducible(buf, "allreduce buffer")
        if op is not _SUM and op is not _AVERAGE:
            op = elementwise_op(op)  # (Average is reduced as a Sum: the caller postscales)
        staged = self._staged is not None
        if src is not None:
            if not isinstance(src, np.ndarray) or src.ndim != 1 or not src.flags.c_contiguous:
                check_array(src, "allreduce src", writable=False)
            if src.dtype != buf.dtype:
                check_same_dtype(src, "allreduce src", buf, "allreduce buffer")
            if src.size != buf.size or staged:
                raise ValueError(f"allreduce src must have the buffer's {buf.size} elements "
                                 f"(it has {src.size}) and needs an unstaged buffer")
        nbytes = buf.nbytes
        small = nbytes <= self._replicated_bytes  # select_shm_allreduce's rule, kept per group
        if algorithm is None:
            choice = "replicated" if small else "chunked"
        elif algorithm in ("replicated", "chunked"):
            choice = algorithm
        else:
            raise ValueError(f"unknown shm allreduce algorithm {algorithm!r}")
        if staged or self._broken is not None:
            self._collective(buf)  # raises for a broken group or a staging view not used here
        if self._size == 1 or buf.size == 0:  # nothing signalled: the parity stays
            if src is not None:
                np.copyto(buf, src)
            scale_inplace(buf, postscale)
            return
        parity = self._parity
        try:
            if staged and small:
                tmp = self._scratch[:nbytes].view(buf.dtype)
                shm_allreduce.staged_small(self._fabric, buf, op, parity, tmp, postscale)
            elif staged:
                shm_allreduce.staged(self._fabric, buf, op, parity, postscale)
            elif choice == "replicated":
                replicated(self._fabric, buf, op, parity, src, postscale, self._views)
            else:
                shm_allreduce.chunked(self._fabric, buf, op, parity, self._chunk(nbytes), src,
                                      postscale)
        except BaseException as exc:
            self._fail(exc)
            raise
        self._parity = parity ^ 1  # every algorithm above signalled

    def _chunk(self, nbytes: int) -> int:
        return (nbytes if nbytes <= SHM_ONE_CHUNK_BYTES else SHM_CHUNK_BYTES
                if self._size <= self._cores else SHM_CHUNK_BYTES_OVERSUBSCRIBED)

    def allreduce_parts(self, dsts: Sequence[Array], op: ReduceOp, *,
                        srcs: Sequence[Array | None] | None = None,
                        postscale: float = 1.0) -> None:
        """:meth:`allreduce` of the concatenation of ``dsts`` without packing it into one
        buffer (the ``chunked`` algorithm over the arrays where they live): the result of each
        is written into ``dsts[i]``, its input read from ``srcs[i]`` (None, or an item None: the
        array itself, in place; else the same size, not overlapping it). 1-D C-contiguous
        arrays of one dtype. Raises as :meth:`allreduce`."""
        srcs = list(srcs) if srcs is not None else [None] * len(dsts)
        for d, x in zip(dsts, srcs, strict=True):
            check_array(d, "allreduce output", writable=True)
            check_same_dtype(d, "allreduce output", dsts[0], "the first output")
            if x is not None:
                check_array(x, "allreduce input", writable=False)
                check_same_dtype(x, "allreduce input", d, "its output")
                if x.size != d.size:
                    raise ValueError(f"allreduce input has {x.size} elements, its output "
                                     f"{d.size}")
        if dsts:
            check_reducible(dsts[0], "allreduce output")
        if op is not _SUM and op is not _AVERAGE:
            op = elementwise_op(op)
        parts = Parts(dsts, srcs)
        if self._staged is not None or self._broken is not None:
            self._collective()  # raises for a broken group or a staging view not used here
        if self._size == 1 or parts.size == 0:  # nothing signalled: the parity stays
            for d, x in zip(parts.dsts, parts.srcs):
                if x is not d:
                    np.copyto(d, x)
                scale_inplace(d, postscale)
            return
        parity = self._parity
        try:
            shm_allreduce.chunked_parts(self._fabric, parts, op, parity,
                                        self._chunk(parts.size * parts.dtype.itemsize),
                                        postscale)
        except BaseException as exc:
            self._fail(exc)
            raise
        self._parity = parity ^ 1

    # ---- other collectives ---------------------------------------------------------------------
    def allgather(self, sendbuf: Array, counts: Sequence[int], out: Array) -> None:
        """Gather every rank's ``sendbuf`` into ``out`` in rank order (see
        :func:`hora.collectives.allgather.allgather`; ``sendbuf`` may alias ``out``)."""
        check_array(sendbuf, "allgather sendbuf", writable=False)
        check_array(out, "allgather out", writable=True)
        check_same_dtype(sendbuf, "allgather sendbuf", out, "allgather out")
        f = self._fabric
        counts = check_counts(counts, f.size, "allgather counts")
        b, item = offsets(counts), out.itemsize
        if sendbuf.size != counts[f.rank]:
            raise ValueError(f"allgather sendbuf has {sendbuf.size} elements but "
                             f"counts[{f.rank}] = {counts[f.rank]}")
        if out.size != b[-1]:
            raise ValueError(f"allgather out has {out.size} elements but sum(counts) = {b[-1]}")
        with self._collective() as parity:
            if f.size == 1 or b[-1] == 0:
                np.copyto(out[b[f.rank]:b[f.rank + 1]], sendbuf)
                return
            mine = view(f.reserve(parity, max(sendbuf.nbytes, 1)), sendbuf.nbytes, out.dtype)
            np.copyto(mine, sendbuf)
            sync(f)
            for j in range(f.size):
                seg = mine.view(np.uint8) if j == f.rank else f.peer(j, parity, counts[j] * item)
                np.copyto(out[b[j]:b[j + 1]], view(seg, counts[j] * item, out.dtype))

    def broadcast(self, buf: Array, root: int) -> None:
        """Copy ``root``'s ``buf`` into ``buf`` on every rank, in place."""
        check_array(buf, "broadcast buffer", writable=True)
        f = self._fabric
        if not 0 <= root < f.size:
            raise ValueError(f"broadcast root {root} is not a rank of a group of {f.size}")
        with self._collective() as parity:
            if f.size == 1 or buf.nbytes == 0:
                return
            raw = buf.view(np.uint8)
            if f.rank == root:
                np.copyto(f.reserve(parity, buf.nbytes)[:buf.nbytes], raw)
            sync(f)
            if f.rank != root:
                np.copyto(raw, f.peer(root, parity, buf.nbytes)[:buf.nbytes])

    def reducescatter(self, buf: Array, counts: Sequence[int], op: ReduceOp, out: Array) -> None:
        """Reduce ``buf`` across ranks; ``out`` gets segment ``rank`` (see
        :func:`hora.collectives.reducescatter.reducescatter`; ``out`` may be that segment of
        ``buf``; ``buf`` is not modified otherwise)."""
        check_array(buf, "reducescatter buffer", writable=False)
        check_array(out, "reducescatter out", writable=True)
        check_same_dtype(buf, "reducescatter buffer", out, "reducescatter out")
        check_reducible(buf, "reducescatter buffer")
        op = elementwise_op(op)
        f, rank = self._fabric, self._fabric.rank
        counts = check_counts(counts, f.size, "reducescatter counts")
        b = offsets(counts)
        if buf.size != b[-1]:
            raise ValueError(f"reducescatter buffer has {buf.size} elements but sum(counts) = "
                             f"{b[-1]}")
        if out.size != counts[rank]:
            raise ValueError(f"reducescatter out has {out.size} elements but counts[{rank}] = "
                             f"{counts[rank]}")
        with self._collective() as parity:
            if f.size == 1 or b[-1] == 0:
                np.copyto(out, buf[b[rank]:b[rank + 1]])
                return
            mine = view(f.reserve(parity, buf.nbytes), buf.nbytes, buf.dtype)
            for k in range(f.size):
                if k != rank:
                    np.copyto(mine[b[k]:b[k + 1]], buf[b[k]:b[k + 1]])
            sync(f)
            np.copyto(out, buf[b[rank]:b[rank + 1]])
            for j in range(f.size):
                if j != rank:
                    seg = view(f.peer(j, parity, buf.nbytes), buf.nbytes, buf.dtype)
                    reduce_inplace(out, seg[b[rank]:b[rank + 1]], op)

    def alltoall(self, sendbuf: Array, send_counts: Sequence[int], recvbuf: Array,
                 recv_counts: Sequence[int]) -> None:
        """Exchange slices between every pair of ranks (see
        :func:`hora.collectives.alltoall.alltoall`).

        Raises:
            MismatchError: a peer sends this rank a different count than ``recv_counts`` says.
        """
        check_array(sendbuf, "alltoall sendbuf", writable=False)
        check_array(recvbuf, "alltoall recvbuf", writable=True)
        check_same_dtype(sendbuf, "alltoall sendbuf", recvbuf, "alltoall recvbuf")
        f, rank, size = self._fabric, self._fabric.rank, self._fabric.size
        send_counts = check_counts(send_counts, size, "alltoall send_counts")
        recv_counts = check_counts(recv_counts, size, "alltoall recv_counts")
        send_off, recv_off = offsets(send_counts), offsets(recv_counts)
        if sendbuf.size != send_off[-1] or recvbuf.size != recv_off[-1]:
            raise ValueError(
                f"alltoall buffers have {sendbuf.size} / {recvbuf.size} elements but the counts "
                f"sum to {send_off[-1]} / {recv_off[-1]}")
        if send_counts[rank] != recv_counts[rank]:
            raise ValueError(f"rank {rank} sends itself {send_counts[rank]} elements but expects "
                             f"to receive {recv_counts[rank]} from itself")
        with self._collective() as parity:
            np.copyto(recvbuf[recv_off[rank]:recv_off[rank + 1]],
                      sendbuf[send_off[rank]:send_off[rank + 1]])
            if size == 1:
                return
            item = sendbuf.itemsize
            table = -(-8 * (size + 1) // _TABLE_ALIGN) * _TABLE_ALIGN  # offsets, then the data
            raw = f.reserve(parity, table + sendbuf.nbytes)
            raw[:8 * (size + 1)].view(np.int64)[:] = send_off
            np.copyto(raw[table:table + sendbuf.nbytes], sendbuf.view(np.uint8))
            sync(f)
            for j in range(size):
                if j == rank:
                    continue
                theirs = f.peer(j, parity, table)[:8 * (size + 1)].view(np.int64)
                lo, hi, total = int(theirs[rank]), int(theirs[rank + 1]), int(theirs[size])
                if hi - lo != recv_counts[j]:
                    raise MismatchError(
                        f"rank {rank}: {f.describe(j)} sends {hi - lo} elements in alltoall but "
                        f"this rank expects {recv_counts[j]}; every rank must agree on the splits")
                seg = f.peer(j, parity, table + total * item)
                np.copyto(recvbuf[recv_off[j]:recv_off[j + 1]].view(np.uint8),
                          seg[table + lo * item:table + hi * item])

    def barrier(self) -> None:
        """Return once every rank of the group has entered the barrier."""
        with self._collective():
            if self.size > 1:
                sync(self._fabric)

    def close(self) -> None:
        """Unmap and unlink this rank's segments (peers waiting on it get PeerLostError).
        Idempotent."""
        self._views = [None] * len(self._views)  # (they would keep the segments mapped)
        self._fabric.close()


__all__ = ["Fabric", "ShmGroup", "replicated"]
