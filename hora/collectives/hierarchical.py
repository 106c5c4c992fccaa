"""Hierarchical allreduce for process sets that span hosts: shared memory inside, TCP across.

Two algorithms; the caller picks by the layout of the set:

* :func:`hierarchical_allreduce` (Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE`` scheme, the
  default whenever every host holds the same number of the set's ranks): reduce-scatter inside
  the host so local rank ``l`` holds the host's sum of shard ``l``; every local rank allreduces
  its shard across hosts with the ranks of the same local rank on the other hosts (``cross``,
  all shards in parallel); allgather inside the host.
* :func:`leader_allreduce` (any layout): allreduce inside the host, one leader per host
  (local rank 0) allreduces across hosts, broadcast inside the host.

Why the shard scheme is the default on CPU/TCP: each host sends the same bytes across the
network either way (``2 (H-1)/H`` of the buffer for ``H`` hosts), but with leaders one Python
process per host drives every socket and does every cross-host reduction, and a Python socket
stream tops out at ~1-2 GB/s (see DESIGN.md), below a 25 GbE NIC. With shards, ``local_size``
processes each move and reduce ``1/local_size`` of the buffer concurrently. The local phases cost
about one shared-memory allreduce in both schemes (reduce-scatter + allgather vs allreduce +
broadcast). The leader scheme remains for hosts with different numbers of ranks, where shards
would not line up across hosts.

Both work in place, treat Average as Sum (the caller scales by ``1/size``), and leave identical
bytes on every rank: each element's host partial is computed once (or identically on every local
rank), reduced across hosts by one cross-host allreduce (identical bytes on its ranks), then
copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hora.collectives._buffers import (
    Array,
    check_array,
    check_reducible,
    elementwise_op,
    even_counts,
    offsets,
)
from hora.collectives.allgather import allgather
from hora.collectives.allreduce import allreduce
from hora.collectives.broadcast import broadcast
from hora.collectives.comm import Comm
from hora.collectives.ops import ReduceOp
from hora.collectives.reducescatter import reducescatter
from hora.collectives.select import select_allreduce
from hora.collectives.shm import ShmGroup

Local = ShmGroup | Comm


@dataclass(frozen=True)
class HostLayout:
    """Where a rank of a process set sits among the set's hosts (see :func:`host_layout`).

    Attributes:
        scheme: ``"local"`` (every rank on this host: use the local group alone), ``"shard"``
            (every host has the same number of ranks: :func:`hierarchical_allreduce`) or
            ``"leader"`` (uneven: :func:`leader_allreduce`).
        local: the set's ranks (indices into the set) on this rank's host, in rank order.
        cross: the set's ranks this rank exchanges with across hosts: for ``"shard"`` the ranks
            with its local index on every host, in host order; for ``"leader"`` every host's
            first rank, on those first ranks only; otherwise None.
    """

    scheme: str
    local: list[int]
    cross: list[int] | None


def host_layout(hostnames: Sequence[str], rank: int) -> HostLayout:
    """The host layout of ``rank`` in a set whose rank ``i`` runs on ``hostnames[i]``.

    Hosts are ordered by their first rank. Every rank of the set computes the same layout.
    """
    hosts: dict[str, list[int]] = {}
    for index, host in enumerate(hostnames):
        hosts.setdefault(host, []).append(index)
    groups = list(hosts.values())
    local = hosts[hostnames[rank]]
    if len(groups) == 1:
        return HostLayout("local", local, None)
    index = local.index(rank)
    if len({len(g) for g in groups}) == 1:
        return HostLayout("shard", local, [g[index] for g in groups])
    return HostLayout("leader", local, [g[0] for g in groups] if index == 0 else None)


def _cross_allreduce(cross: Comm | None, buf: Array, op: ReduceOp,
                     scratch: Array | None) -> None:
    if cross is None or cross.size == 1 or buf.size == 0:
        return
    allreduce(cross, buf, op, select_allreduce(buf.nbytes, cross.size, "auto"), scratch)


def _local_allreduce(local: Local, buf: Array, op: ReduceOp, scratch: Array | None) -> None:
    if isinstance(local, ShmGroup):
        local.allreduce(buf, op)
    else:
        _cross_allreduce(local, buf, op, scratch)


def hierarchical_allreduce(local: Local, cross: Comm | None, buf: Array, op: ReduceOp, *,
                           scratch: Array | None = None) -> None:
    """Allreduce ``buf`` over ``local x cross`` ranks: local reduce-scatter, cross allreduce of
    this rank's shard, local allgather. In place.

    Every rank of the set calls this in the same order with the same length, dtype and ``op``.
    All hosts must hold the same number of the set's ranks.

    Args:
        local: the ranks of the set on this host, ordered as on every other host (local rank
            ``l`` here pairs with local rank ``l`` elsewhere): a :class:`ShmGroup`, or a
            :class:`Comm` (then the local phases use the ring algorithms).
        cross: the ranks of the set with this rank's local rank, one per host, in host order;
            None (or a 1-rank comm) on a single host.
        buf: 1-D C-contiguous writable array of a supported dtype.
        op: Sum, Average (reduced as Sum), Min, Max or Product.
        scratch: optional reusable uint8 array for the TCP phases (``buf.nbytes`` suffices).

    Raises:
        ValueError, TypeError, NotImplementedError: as
            :func:`~hora.collectives.ring.ring_allreduce`.
        PeerLostError, HoraTimeoutError: a peer died or is stuck (named).
    """
    check_array(buf, "allreduce buffer", writable=True)
    check_reducible(buf, "allreduce buffer")
    op = elementwise_op(op)
    if buf.size == 0:
        return
    counts = even_counts(buf.size, local.size)
    bounds = offsets(counts)
    me = local.rank
    shard = buf[bounds[me]:bounds[me + 1]]
    if local.size > 1:
        if isinstance(local, ShmGroup):
            local.reducescatter(buf, counts, op, shard)
        else:
            reducescatter(local, buf, counts, op, shard, scratch)
    _cross_allreduce(cross, shard, op, scratch)
    if local.size > 1:
        if isinstance(local, ShmGroup):
            local.allgather(shard, counts, buf)
        else:
            allgather(local, shard, counts, buf)


def leader_allreduce(local: Local, cross: Comm | None, buf: Array, op: ReduceOp, *,
                     scratch: Array | None = None) -> None:
    """Allreduce ``buf``: allreduce on this host, across hosts among one leader per host, then
    broadcast from the leader on this host. In place. Works for any number of ranks per host.

    Args:
        local: the ranks of the set on this host; its rank 0 is the host's leader.
        cross: on leaders, the comm over every host's leader (None or 1 rank for one host);
            must be None on the other ranks.
        buf, op, scratch: as :func:`hierarchical_allreduce`.

    Raises:
        ValueError: ``cross`` given on a non-leader; the buffer checks of
            :func:`hierarchical_allreduce`.
        PeerLostError, HoraTimeoutError: a peer died or is stuck (named).
    """
    check_array(buf, "allreduce buffer", writable=True)
    check_reducible(buf, "allreduce buffer")
    op = elementwise_op(op)
    if local.rank != 0 and cross is not None:
        raise ValueError(f"local rank {local.rank} is not its host's leader but got a cross "
                         "comm; HINT: pass cross only on local rank 0")
    if buf.size == 0:
        return
    if local.size > 1:
        _local_allreduce(local, buf, op, scratch)
    if local.rank == 0:
        _cross_allreduce(cross, buf, op, scratch)
    if local.size > 1:
        if isinstance(local, ShmGroup):
            local.broadcast(buf, 0)
        else:
            broadcast(local, buf, 0)


__all__ = ["HostLayout", "hierarchical_allreduce", "host_layout", "leader_allreduce"]
