"""Hierarchical Adasum for process sets that span hosts: average on each host (shared memory),
Adasum across hosts (TCP), the result spread on each host.

This is Horovod's Adasum on NCCL builds (``AdasumGpuAllreduceOp``): the ranks of a node are
reduced with a plain sum, the sum is divided by the node's rank count (Horovod's framework
layer sets the postscale to ``1 / local_size``), and Adasum combines one vector per node, so
the number of *hosts* must be a power of two (the number of ranks need not be). Adasum is
scale-equivariant (``adasum(c a, c b) = c adasum(a, b)``), so dividing before or after the
cross-host phase gives the same result up to rounding. The consequence for training (Horovod's
user guide): ranks on one host are averaged, so the learning rate is scaled by the ranks per
host, as with op=Average, while hosts are combined adaptively.

Two layouts, as :mod:`hora.collectives.hierarchical`:

* :func:`shard_adasum` (every host holds the same number of the set's ranks): reduce-scatter
  on each host, so local rank ``l`` holds the host sum of shard ``l``; every local rank runs
  Adasum on its shard with the ranks of local rank ``l`` on the other hosts, all shards in
  parallel, and the three dot products of each level are summed over the host's ranks
  (``dot_sum``) so the coefficients are the whole vector's (Horovod's reduction
  communicators); allgather on each host.
* :func:`leader_adasum` (any layout): allreduce on each host, Adasum among one leader per host,
  broadcast on each host.

Both work in place and leave identical bytes on every rank of the set.
"""

from __future__ import annotations

from collections.abc import Sequence

from hora.collectives._buffers import Array, check_array
from hora.collectives.adasum import FLOAT_DTYPES, adasum_allreduce, check_size
from hora.collectives.allgather import allgather
from hora.collectives.allreduce import allreduce
from hora.collectives.broadcast import broadcast
from hora.collectives.comm import Comm
from hora.collectives.hierarchical import host_shard
from hora.collectives.ops import ReduceOp, dtype_name, scale_inplace
from hora.collectives.select import select_allreduce
from hora.collectives.shm import ShmGroup

Local = ShmGroup | Comm


def _check(buf: Array, hosts: int) -> None:
    check_array(buf, "adasum buffer", writable=True)
    if dtype_name(buf.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"Adasum reduces floating-point buffers ({', '.join(FLOAT_DTYPES)}), "
                        f"not {dtype_name(buf.dtype)}")
    check_size(hosts, hosts=True)


def _local_sum(local: Local, buf: Array) -> None:
    """Sum ``buf`` over the host's ranks, in place (identical bytes on each)."""
    if local.size == 1 or buf.size == 0:
        return
    if isinstance(local, ShmGroup):
        local.allreduce(buf, ReduceOp.Sum)
    else:
        allreduce(local, buf, ReduceOp.Sum, select_allreduce(buf.nbytes, local.size, "auto"))


def _shard_counts(counts: Sequence[int] | None, total: int, lo: int, hi: int) -> list[int]:
    """How many elements of each tensor (``counts``, packed in a buffer of ``total``) fall in
    the shard ``[lo, hi)``."""
    out, start = [], 0
    for n in (total,) if counts is None else counts:
        out.append(max(0, min(hi, start + n) - max(lo, start)))
        start += n
    return out


def shard_adasum(local: Local, cross: Comm | None, buf: Array, *, hosts: int,
                 counts: Sequence[int] | None = None) -> None:
    """Hierarchical Adasum of ``buf`` over ``local x cross`` ranks (see the module docstring),
    in place. Every host holds the same number of the set's ranks.

    Args:
        local: the set's ranks on this host, ordered alike on every host (a
            :class:`ShmGroup`, or a :class:`Comm`: then the local phases use the ring).
        cross: the set's ranks with this rank's local index, one per host, in host order
            (None or 1 rank on a single host).
        buf: 1-D C-contiguous writable float buffer, the same length on every rank.
        hosts: the number of hosts (checked on every rank before any communication).
        counts: the lengths of the tensors packed in ``buf`` (a fused buffer), each combined
            with its own coefficients; None: ``buf`` is one tensor.

    Raises:
        NotImplementedError: ``hosts`` is not a power of two.
        TypeError, ValueError: a bad buffer.
        PeerLostError, HoraTimeoutError: a peer died or is stuck (named).
    """
    _check(buf, hosts)
    if buf.size == 0:
        return
    shards, bounds, shard = host_shard(local, buf, ReduceOp.Sum)
    me = local.rank
    if local.size > 1:
        scale_inplace(shard, 1.0 / local.size)
    if cross is not None and cross.size > 1:
        adasum_allreduce(cross, shard,
                         counts=_shard_counts(counts, buf.size, bounds[me], bounds[me + 1]),
                         dot_sum=(lambda dots: _local_sum(local, dots)) if local.size > 1
                         else None)
    if local.size > 1:
        if isinstance(local, ShmGroup):
            local.allgather(shard, shards, buf)
        else:
            allgather(local, shard, shards, buf)


def leader_adasum(local: Local, cross: Comm | None, buf: Array, *, hosts: int,
                  counts: Sequence[int] | None = None) -> None:
    """Hierarchical Adasum of ``buf``: average on this host, Adasum among one leader per host
    (local rank 0), broadcast from the leader on this host. In place; any ranks per host.

    Args:
        local: the set's ranks on this host; its rank 0 is the host's leader.
        cross: on leaders, the comm over every host's leader; None on the other ranks.
        buf, hosts, counts: as :func:`shard_adasum`.

    Raises:
        ValueError: ``cross`` given on a non-leader; a bad buffer.
        NotImplementedError, TypeError, PeerLostError, HoraTimeoutError: as
            :func:`shard_adasum`.
    """
    _check(buf, hosts)
    if local.rank != 0 and cross is not None:
        raise ValueError(f"local rank {local.rank} is not its host's leader but got a cross "
                         "comm; HINT: pass cross only on local rank 0")
    if buf.size == 0:
        return
    if local.size > 1:
        _local_sum(local, buf)
        scale_inplace(buf, 1.0 / local.size)
    if cross is not None and cross.size > 1:
        adasum_allreduce(cross, buf, counts=counts)
    if local.size > 1:
        if isinstance(local, ShmGroup):
            local.broadcast(buf, 0)
        else:
            broadcast(local, buf, 0)


__all__ = ["leader_adasum", "shard_adasum"]
