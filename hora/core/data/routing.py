"""hora's own data paths (the builtin data plane): which route a process set takes, shared
memory, the TCP ring or hierarchical.

One :class:`Route` per process set, built lazily by every member at the set's first data
collective (building one is itself collective: shared-memory groups exchange segment names over
the set's comm). The executor calls the route's methods and never picks algorithms itself.

Which route a set gets is one table, :data:`SCHEMES`, tried in order (the first that applies
and builds wins; :func:`build_route`):

* ``shm``: all members on one host, more than one of them -> :class:`~hora.collectives.shm.ShmGroup`
  (``HORA_SHM``; an op larger than the segments allow, :meth:`Route.fits`, takes the set's comm);
* ``hierarchical``: members on several hosts with several per host -> hierarchical allreduce
  (reduce on each host over shared memory, allreduce across hosts over TCP, spread back), unless
  ``HOROVOD_HIERARCHICAL_ALLREDUCE=0``; hierarchical allgather (gather on each host, exchange
  through one leader per host, broadcast on each host) when ``HOROVOD_HIERARCHICAL_ALLGATHER=1``;
  Adasum follows the allreduce's choice (:mod:`~hora.collectives.hierarchical_adasum`: host
  averages combined across hosts); other collectives use the flat TCP ring;
* ``ring``: otherwise the TCP ring (or star / recursive doubling, per ``select_allreduce``).

The data planes that replace this whole table (``HORA_DATA_PLANE``) are the table of
:mod:`hora.core.data.paths`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hora._util.log import get_logger
from hora.collectives.adasum import adasum_allreduce, adasum_gathered
from hora.collectives.allgather import allgather
from hora.collectives.allreduce import allreduce
from hora.collectives.alltoall import alltoall
from hora.collectives.broadcast import broadcast
from hora.collectives.comm import Comm, SubComm
from hora.collectives.hierarchical import (
    HostLayout,
    hierarchical_allreduce,
    host_layout,
    leader_allgather,
    leader_allreduce,
)
from hora.collectives.hierarchical_adasum import leader_adasum, shard_adasum
from hora.collectives.ops import ReduceOp, scale_inplace
from hora.collectives.reducescatter import reducescatter
from hora.collectives.select import select_allreduce
from hora.collectives.shm import ShmGroup
from hora.config import Config
from hora.errors import HoraError, TransportError
from hora.transports.shm import SPIN_ALLOWED, available_bytes, capacity_for
from hora.transports.shm_fabric import ShmFabric

log = get_logger(__name__)

_ADASUM = ReduceOp.Adasum  # (an enum member through its class: 100-200 ns in Python 3.11)

ADASUM_GATHER_BYTES = 64 << 20
"""Adasum on one host gathers every rank's buffer (shared memory) and combines locally when the
gathered copy stays within this; larger buffers take the recursive exchange over TCP (in a fast
lane always the gather: the lane's ops are within its fusion limits)."""

SHM_HEADROOM = 4
"""Use shared memory for an op only if this many times the segments it needs are free:
each rank holds two data segments of the op's capacity, and /dev/shm is shared with others."""


class DataPath(str, enum.Enum):
    """A process set's data path: the one vocabulary of logs, benchmarks and the timeline."""

    RING = "ring"  # the TCP ring (or star / recursive doubling for small messages)
    SHM = "shm"  # every member on this host, over shared memory
    SHARD = "shard"  # hierarchical across hosts, each host's ranks own a shard
    LEADER = "leader"  # hierarchical across hosts through one leader per host
    TORCH = "torch"  # an external data plane: torch.distributed (hora.core.data.paths)
    MPI = "mpi"  # an external data plane: MPI through mpi4py (hora.core.data.paths)

    def __str__(self) -> str:
        return self.value


class Route:
    """The data path of one process set (see the module docstring)."""

    def __init__(self, comm: Comm, config: Config, *, group: ShmGroup | None = None,
                 shm_free: int = 0, scheme: DataPath = DataPath.RING,
                 local: ShmGroup | Comm | None = None,
                 cross: Comm | None = None, lane_group: ShmGroup | None = None,
                 gather_hosts: list[list[int]] | None = None, hosts: int = 1,
                 lane: bool = False) -> None:
        self.comm = comm
        self.group = group  # the whole set on one host, over shared memory
        self.lane_group = lane_group  # a second group for the fast lane (hora.core.lane.fastlane)
        self.scheme = scheme
        self._local = local
        self._cross = cross
        self._gather_hosts = gather_hosts  # the set's ranks per host: hierarchical allgather
        self._hosts = hosts  # how many hosts the set spans (hierarchical Adasum checks it)
        self._lane = lane  # a fast lane's route: its thread never touches the set's TCP comm
        self._config = config
        self._shm_free = shm_free
        self._shm_bytes = _shm_limit(group.size if group is not None else 1, shm_free)

    @property
    def name(self) -> str:
        """The data path's name (logs, the timeline): a :class:`DataPath`, or a plane's name."""
        return self.scheme

    @property
    def native(self) -> bool:
        """Whether the route takes device buffers (:mod:`hora.core.op.device`) as they are: the
        executor's device forms (:mod:`hora.core.data.device_exec`) run on it."""
        return False

    def _shm_fits(self, nbytes: int) -> bool:
        return nbytes <= self._shm_bytes

    def fits(self, nbytes: int) -> bool:
        """Whether an op of ``nbytes`` runs in shared memory (the same answer on every member)."""
        return self.group is not None and self._shm_fits(nbytes)

    def renew_lane_group(self, job_id: str) -> bool:
        """Replace :attr:`lane_group` by a fresh one (collective over the set); True if made."""
        if self.lane_group is None:
            return False
        self.lane_group.close()
        self.lane_group = _lane_group(self.comm, self._config, job_id)
        return self.lane_group is not None

    def lane_route(self) -> Route | None:
        """The fast lane's route: the same decisions over :attr:`lane_group`, or None."""
        if self.lane_group is None:
            return None
        return Route(self.comm, self._config, group=self.lane_group, shm_free=self._shm_free,
                     scheme=DataPath.SHM, lane=True)

    def staging(self, nbytes: int) -> np.ndarray | None:
        """A shared-memory buffer to pack the next fused allreduce into, or None."""
        if self.group is not None and self._shm_fits(nbytes):
            return self.group.staging(nbytes)
        return None

    def allreduce(self, buf: np.ndarray, op: ReduceOp, scratch: np.ndarray,
                  counts: Sequence[int] | None = None, *, src: np.ndarray | None = None,
                  postscale: float = 1.0) -> None:
        """Reduce ``buf`` in place over this route, then multiply it by ``postscale``
        (:func:`~hora.collectives.ops.scale_inplace`). ``src``: this rank's input, when it is
        not already in ``buf`` (same size; ``buf`` is then only written). Adasum: hierarchical
        when the route is (:mod:`hora.collectives.hierarchical_adasum`), gathered over shared
        memory on one host (:func:`~hora.collectives.adasum.adasum_gathered`), else over the
        set's comm; each of the tensors packed in ``buf``, ``counts`` elements each, with its
        own coefficients."""
        if op is not _ADASUM and self.group is not None \
                and buf.nbytes <= self._shm_bytes:  # one host: copy and scale within the passes
            self.group.allreduce(buf, op, src=src, postscale=postscale)
            return
        if src is not None:
            np.copyto(buf, src)
        self._allreduce(buf, op, scratch, counts)
        scale_inplace(buf, postscale)

    def takes_parts(self, nbytes: int, op: int) -> bool:
        """Whether :meth:`allreduce_parts` takes a fused allreduce of ``nbytes`` with ``op``
        (the same answer on every member): an element-wise op over this set's shared memory."""
        return op != _ADASUM and self.group is not None and self._shm_fits(nbytes)

    def allreduce_parts(self, dsts: Sequence[np.ndarray], op: ReduceOp,
                        srcs: Sequence[np.ndarray | None], postscale: float = 1.0) -> None:
        """Reduce several 1-D arrays as one buffer without packing them (where
        :meth:`takes_parts`): the results in ``dsts``, the inputs read from ``srcs`` (an item
        None: the output itself), then multiplied by ``postscale``
        (:meth:`~hora.collectives.shm.ShmGroup.allreduce_parts`)."""
        assert self.group is not None
        self.group.allreduce_parts(dsts, op, srcs=srcs, postscale=postscale)

    def _allreduce(self, buf: np.ndarray, op: ReduceOp, scratch: np.ndarray,
                   counts: Sequence[int] | None) -> None:
        """The paths other than one host's shared memory (which :meth:`allreduce` takes for
        every element-wise op), and Adasum."""
        if op is ReduceOp.Adasum:
            if self.scheme is DataPath.SHARD and self._local is not None:
                shard_adasum(self._local, self._cross, buf, hosts=self._hosts, counts=counts)
            elif self.scheme is DataPath.LEADER and self._local is not None:
                leader_adasum(self._local, self._cross, buf, hosts=self._hosts, counts=counts)
            elif self.group is not None and (self._lane or (
                    buf.nbytes * self.group.size <= ADASUM_GATHER_BYTES
                    and self._shm_fits(buf.nbytes))):
                group = self.group
                adasum_gathered(lambda x, out: group.allgather(x, [x.size] * group.size, out),
                                group.size, buf, counts=counts, barrier=group.barrier)
            else:
                adasum_allreduce(self.comm, buf, counts=counts)
        elif self.scheme is DataPath.SHARD and self._local is not None:
            hierarchical_allreduce(self._local, self._cross, buf, op, scratch=scratch)
        elif self.scheme is DataPath.LEADER and self._local is not None:
            leader_allreduce(self._local, self._cross, buf, op, scratch=scratch)
        else:
            cfg = self._config
            algorithm = select_allreduce(buf.nbytes, self.comm.size, cfg.allreduce_algorithm,
                                         cfg.small_allreduce_bytes)
            allreduce(self.comm, buf, op, algorithm, scratch=scratch)

    def allgather(self, sendbuf: np.ndarray, counts: Sequence[int], out: np.ndarray) -> None:
        if self.group is not None and self._shm_fits(out.nbytes):
            self.group.allgather(sendbuf, counts, out)
        elif self._gather_hosts is not None and self._local is not None:
            leader = self._local.rank == 0
            leader_allgather(self._local, self._cross if leader else None, sendbuf, counts, out,
                             self._gather_hosts, self.comm.rank)
        else:
            allgather(self.comm, sendbuf, counts, out)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if self.group is not None and self._shm_fits(buf.nbytes):
            self.group.broadcast(buf, root)
        else:
            broadcast(self.comm, buf, root)

    def alltoall(self, sendbuf: np.ndarray, send_counts: Sequence[int], recvbuf: np.ndarray,
                 recv_counts: Sequence[int]) -> None:
        if self.group is not None and self._shm_fits(max(sendbuf.nbytes, recvbuf.nbytes)):
            self.group.alltoall(sendbuf, send_counts, recvbuf, recv_counts)
        else:
            alltoall(self.comm, sendbuf, send_counts, recvbuf, recv_counts)

    def reducescatter(self, buf: np.ndarray, counts: Sequence[int], op: ReduceOp,
                      out: np.ndarray, scratch: np.ndarray) -> None:
        if self.group is not None and self._shm_fits(buf.nbytes):
            self.group.reducescatter(buf, counts, op, out)
        else:
            reducescatter(self.comm, buf, counts, op, out, scratch=scratch)

    def close(self) -> None:
        for group in (self.group, self._local, self.lane_group):
            if isinstance(group, ShmGroup):
                group.close()


def _shm_limit(size: int, free: int) -> int:
    """The largest op of a group of ``size`` that runs in shared memory: while
    :data:`SHM_HEADROOM` times the two data segments of its capacity
    (:func:`~hora.transports.shm.capacity_for`, a power of two) on every member fit ``free``
    bytes; -1 if none does."""
    capacity = capacity_for(0)
    if SHM_HEADROOM * 2 * capacity * size > free:
        return -1
    while SHM_HEADROOM * 2 * (capacity * 2) * size <= free:
        capacity *= 2
    return capacity


@dataclass(frozen=True)
class SetSite:
    """One process set seen from this rank: what a data path's factory builds the set's route
    from (building is collective: every member builds at the same response)."""

    world: Comm
    """hora's global comm (the job's transport; an external plane watches its connections)."""
    ranks: Sequence[int]
    """The set's global ranks."""
    comm: Comm
    """A comm over the set's members (member ``i`` is ``ranks[i]``)."""
    hostnames: Sequence[str]
    """The host of each member."""
    config: Config
    job_id: str
    set_id: int = 0


@dataclass(frozen=True)
class Scheme:
    """One of hora's own routes, a row of :data:`SCHEMES`.

    Attributes:
        name: the route's name in this table.
        selected_by: the knobs that turn it on or off (docs/config.md), for readers.
        applies: whether it may serve the set (``site``, this rank's host layout): decided
            from every member's host and the config, so every member decides alike.
        build: the route (collective), or None when it cannot be built here (every member gets
            None together: the next row is tried).
        per_op: which ops of the set it takes, for readers (the route's methods decide).
    """

    name: str
    selected_by: str
    applies: Callable[[SetSite, HostLayout], bool]
    build: Callable[[SetSite, HostLayout], Route | None]
    per_op: str = "every op"


def build_route(comm: Comm, hostnames: Sequence[str], config: Config, job_id: str) -> Route:
    """Build the route of a set whose member ``i`` runs on ``hostnames[i]`` (collective): the
    first row of :data:`SCHEMES` that applies and builds."""
    if comm.size == 1:
        return Route(comm, config)
    site = SetSite(comm, range(comm.size), comm, hostnames, config, job_id)
    layout = host_layout(hostnames, comm.rank)
    for scheme in SCHEMES:
        if scheme.applies(site, layout):
            route = scheme.build(site, layout)
            if route is not None:
                return route
    return Route(comm, config)


def _one_host(site: SetSite, layout: HostLayout) -> bool:
    return layout.scheme == "local" and site.config.shm


def _shm_route(site: SetSite, layout: HostLayout) -> Route | None:
    comm, config, job_id = site.comm, site.config, site.job_id
    group, free = _shm_group(comm, config, job_id)
    if group is None:
        return None
    log.debug("process set of %d ranks on one host: shared memory", comm.size)
    return Route(comm, config, group=group, shm_free=free, scheme=DataPath.SHM,
                 lane_group=_lane_group(comm, config, job_id))


def _choices(site: SetSite) -> tuple[bool, bool]:
    """(hierarchical allreduce, hierarchical allgather) of a set across hosts: decided from
    every member's host, never this rank's alone, so all members choose alike."""
    hostnames = site.hostnames
    several = len(set(hostnames)) < len(hostnames)  # some host has several ranks
    hierarchical = site.config.hierarchical_allreduce
    if hierarchical is None:  # automatic: worth it when some host has several ranks
        hierarchical = several
    return hierarchical, site.config.hierarchical_allgather and several


def _across_hosts(site: SetSite, layout: HostLayout) -> bool:
    return layout.scheme != "local" and any(_choices(site))


def _hierarchical_route(site: SetSite, layout: HostLayout) -> Route:
    comm, config = site.comm, site.config
    hierarchical, gather = _choices(site)
    local_comm: Comm = SubComm(comm, layout.local)
    local: ShmGroup | Comm = local_comm
    if config.shm and len(layout.local) > 1:
        group, _ = _shm_group(local_comm, config, site.job_id)
        local = group if group is not None else local_comm
    cross = SubComm(comm, layout.cross) if layout.cross is not None else None
    if hierarchical:
        log.debug("process set across hosts: hierarchical allreduce (%s)", layout.scheme)
    if gather:
        log.info("process set of %d ranks on %d hosts: hierarchical allgather", comm.size,
                 len(layout.hosts))
    return Route(comm, config, scheme=DataPath(layout.scheme) if hierarchical else DataPath.RING,
                 local=local, cross=cross, gather_hosts=layout.hosts if gather else None,
                 hosts=len(layout.hosts))


SCHEMES: list[Scheme] = [
    Scheme("shm", "HORA_SHM", _one_host, _shm_route,
           "ops that fit the shared segments (Route.fits); larger ones over the set's comm"),
    Scheme("hierarchical", "HOROVOD_HIERARCHICAL_ALLREDUCE, HOROVOD_HIERARCHICAL_ALLGATHER",
           _across_hosts, _hierarchical_route,
           "allreduce and Adasum (allgather when HOROVOD_HIERARCHICAL_ALLGATHER=1); the rest "
           "over the flat ring"),
    Scheme("ring", "HORA_ALLREDUCE_ALGORITHM, HORA_SMALL_ALLREDUCE_BYTES",
           lambda site, layout: True, lambda site, layout: Route(site.comm, site.config),
           "every op; the allreduce's algorithm by size (select_allreduce)"),
]
"""hora's own routes, tried in order by :func:`build_route`; a transport that brings its own
route adds one row (:func:`register_scheme`)."""


def register_scheme(scheme: Scheme, *, before: str = "ring") -> None:
    """Add ``scheme`` to :data:`SCHEMES` just before the row named ``before`` (replacing a row
    of the same name)."""
    rows = [s for s in SCHEMES if s.name != scheme.name]
    at = next((i for i, s in enumerate(rows) if s.name == before), len(rows))
    rows.insert(at, scheme)
    SCHEMES[:] = rows


def _shm_group(comm: Comm, config: Config, job_id: str) -> tuple[ShmGroup | None, int]:
    """A shared-memory group over ``comm`` (all on one host), or None: every member agrees."""
    free = _agree_min(comm, available_bytes())
    if free < SHM_HEADROOM * 2 * capacity_for(0) * comm.size:
        log.warning("/dev/shm has only %d bytes free: ranks on this host use TCP", free)
        return None, 0
    try:
        fabric = ShmFabric.create(comm, job_id, timeout=config.timeout_seconds)
    except TransportError as exc:  # every member raises together
        log.warning("shared memory unavailable, ranks on this host use TCP: %s", exc)
        return None, 0
    return ShmGroup(fabric), free


def _lane_group(comm: Comm, config: Config, job_id: str) -> ShmGroup | None:
    """The fast lane's own shared-memory group (collective; every member gets one or None).

    None when the response cache is off (``HOROVOD_CACHE_CAPACITY=0``), a timeline is
    configured (every op is then negotiated, so the timeline shows each phase), or the CPU does
    not keep stores in order (the lane's logs are read without locks).
    """
    if config.cache_capacity <= 0 or config.timeline or not SPIN_ALLOWED:
        return None
    try:
        return ShmGroup(ShmFabric.create(comm, job_id, timeout=config.timeout_seconds))
    except TransportError as exc:  # every member raises together
        log.warning("no fast lane (every op is negotiated): %s", exc)
        return None


def _agree_min(comm: Comm, value: int) -> int:
    """The minimum of ``value`` over ``comm`` (a tiny allreduce), so every rank decides alike."""
    buf = np.array([value], dtype=np.int64)
    allreduce(comm, buf, ReduceOp.Min, select_allreduce(8, comm.size, "auto", 1 << 16))
    return int(buf[0])


def close_quietly(route: Any) -> None:
    try:
        route.close()
    except HoraError:
        log.debug("error closing a route", exc_info=True)
