"""Hierarchical collectives for process sets that span hosts: shared memory inside, TCP across.

Allreduce has two algorithms; the caller picks by the layout of the set:

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

Allgather has one, :func:`leader_allgather` (Horovod's ``HOROVOD_HIERARCHICAL_ALLGATHER``, any
layout): gather on each host, exchange the hosts' blocks among one leader per host, broadcast on
each host. On ``H`` hosts of ``L`` ranks each (the ranks of a host consecutive, as ``hora run``
places them), each host's link then carries ``(H-1)/H`` of the result each way (the leaders'
ring), against ``(HL-1)/(HL)`` in the flat ring, which passes every rank's block through every
host: 1.5x fewer bytes for 2 hosts x 2 ranks, 1.75x for 2 x 4, 1.25x for 4 x 4. What it costs
is on the host: the ranks copy the host's block through shared memory, the leader copies the
other hosts' blocks in, every other rank copies them out, and while the leaders exchange, the
other ranks wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hora.collectives._buffers import (
    Array,
    check_array,
    check_counts,
    check_reducible,
    check_same_dtype,
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
            first rank, on those first ranks only; otherwise None. On a host's first rank it is
            every host's first rank in both schemes (the leaders of :func:`leader_allgather`).
        hosts: the set's ranks on each host, hosts in order of their first rank.
    """

    scheme: str
    local: list[int]
    cross: list[int] | None
    hosts: list[list[int]] = field(default_factory=list)


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
        return HostLayout("local", local, None, groups)
    index = local.index(rank)
    if len({len(g) for g in groups}) == 1:
        return HostLayout("shard", local, [g[index] for g in groups], groups)
    return HostLayout("leader", local, [g[0] for g in groups] if index == 0 else None, groups)


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



def host_shard(local: Local, buf: np.ndarray, op: ReduceOp,
               scratch: np.ndarray | None = None) -> tuple[list[int], list[int], np.ndarray]:
    """Reduce ``buf`` over this host's ranks into this rank's shard (an even split by local
    rank): returns the split's counts, its offsets and the shard (a view of ``buf``)."""
    counts = even_counts(buf.size, local.size)
    bounds = offsets(counts)
    shard = buf[bounds[local.rank]:bounds[local.rank + 1]]
    if local.size > 1:
        if isinstance(local, ShmGroup):
            local.reducescatter(buf, counts, op, shard)
        else:
            reducescatter(local, buf, counts, op, shard, scratch)
    return counts, bounds, shard


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
    counts, bounds, shard = host_shard(local, buf, op, scratch)
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


def leader_allgather(local: Local, cross: Comm | None, sendbuf: Array, counts: Sequence[int],
                     out: Array, hosts: Sequence[Sequence[int]], rank: int) -> None:
    """Allgather with per-rank counts across hosts: gather on each host, exchange the hosts'
    blocks among one leader per host, broadcast on each host. Works for any number of ranks per
    host, ranks of a host in any positions of the set.

    The result is :func:`~hora.collectives.allgather.allgather`'s over the whole set, on every
    rank: rank ``i``'s ``counts[i]`` elements at ``out[sum(counts[:i]) : sum(counts[:i + 1])]``.
    Every rank of the set calls this in the same order with the same ``counts``, ``hosts`` and
    dtype. ``sendbuf`` may alias this rank's own slot of ``out``.

    Args:
        local: the ranks of ``hosts[h]``, this rank's host, in that order (a
            :class:`ShmGroup`, or a :class:`Comm`: then the local phases use the ring
            algorithms); its rank 0 is the host's leader.
        cross: on leaders, the comm over every host's leader (``hosts[k][0]``) in the order of
            ``hosts``; None (or 1 rank) for one host; must be None on the other ranks.
        sendbuf: 1-D C-contiguous array of ``counts[rank]`` elements.
        counts: elements contributed by each rank of the set (indices of ``hosts``).
        out: 1-D C-contiguous writable array of ``sum(counts)`` elements, same dtype.
        hosts: the set's ranks on each host, every rank once.
        rank: this rank's index in the set.

    Raises:
        ValueError: bad buffers or counts, ``hosts`` that do not match ``local`` / ``cross`` /
            ``rank``, or ``cross`` given on a non-leader.
        TypeError: ``sendbuf`` and ``out`` dtypes differ.
        PeerLostError, HoraTimeoutError: a peer died or is stuck (named).
    """
    check_array(sendbuf, "allgather sendbuf", writable=False)
    check_array(out, "allgather out", writable=True)
    check_same_dtype(sendbuf, "allgather sendbuf", out, "allgather out")
    order = [i for ranks in hosts for i in ranks]
    counts = check_counts(counts, len(order), "allgather counts")
    if sorted(order) != list(range(len(order))) or not 0 <= rank < len(order):
        raise ValueError(f"hosts {[list(h) for h in hosts]} must hold every rank of the set "
                         f"once, rank {rank} among them")
    h = next(k for k, ranks in enumerate(hosts) if rank in ranks)
    if list(hosts[h]).index(rank) != local.rank or len(hosts[h]) != local.size:
        raise ValueError(f"rank {rank} is local rank {local.rank} of {local.size} but hosts "
                         f"say {list(hosts[h])}")
    if local.rank != 0 and cross is not None:
        raise ValueError(f"local rank {local.rank} is not its host's leader but got a cross "
                         "comm; HINT: pass cross only on local rank 0")
    if cross is not None and (cross.size, cross.rank) != (len(hosts), h):
        raise ValueError(f"the leaders' comm has {cross.size} ranks (this one {cross.rank}) but "
                         f"there are {len(hosts)} hosts (this one {h})")
    bounds = offsets(counts)
    if sendbuf.size != counts[rank]:
        raise ValueError(f"allgather sendbuf has {sendbuf.size} elements but counts[{rank}] = "
                         f"{counts[rank]}")
    if out.size != bounds[-1]:
        raise ValueError(f"allgather out has {out.size} elements but sum(counts) = {bounds[-1]}")
    host_counts = [sum(counts[i] for i in ranks) for ranks in hosts]
    at = offsets(host_counts)
    # The leaders exchange whole host blocks, i.e. the result in host order; when that is rank
    # order (each host's ranks consecutive, hosts in rank order) it is ``out`` itself.
    in_place = order == sorted(order)
    leader = local.rank == 0
    if in_place:
        major, start = out, at[h]
    else:
        major = np.empty(out.size if leader else host_counts[h], out.dtype)
        start = at[h] if leader else 0
    block = major[start:start + host_counts[h]]
    mine = [counts[i] for i in hosts[h]]
    if local.size == 1:
        np.copyto(block, sendbuf)
    elif isinstance(local, ShmGroup):
        local.allgather(sendbuf, mine, block)
    else:
        allgather(local, sendbuf, mine, block)
    if leader and cross is not None and cross.size > 1:
        allgather(cross, block, host_counts, major)
    if leader and not in_place:
        src = 0
        for i in order:
            np.copyto(out[bounds[i]:bounds[i + 1]], major[src:src + counts[i]])
            src += counts[i]
    if local.size == 1:
        return
    # In place, every rank of the host holds the host's block already: spread the rest.
    spread = [out[:at[h]], out[at[h + 1]:]] if in_place else [out]
    for part in spread:
        if isinstance(local, ShmGroup):
            local.broadcast(part, 0)
        else:
            broadcast(local, part, 0)


__all__ = ["HostLayout", "hierarchical_allreduce", "host_layout", "leader_allgather",
           "leader_allreduce"]
