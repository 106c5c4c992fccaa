"""Routes over an external data plane (``HORA_DATA_PLANE=torch`` or ``mpi``, or any plane of
:mod:`hora.core.data.paths`' table with an :class:`~hora.transports.planes.ExternalPlane`).

:func:`plane_route` is what such a plane's row builds instead of
:func:`~hora.core.data.routing.build_route` (hora's own routes). The
control plane is untouched: rank 0 still negotiates every op, fuses, checks dtypes and shapes,
detects stalls and deadlocks; the executor still packs the fusion buffer and scales. Only the
bytes of each collective go through the external engine (:mod:`hora.transports.torch_plane`,
:mod:`hora.transports.mpi_plane`), over a group of the process set's members only.

**What stays on hora's builtin path** (decided from the agreed response alone, so every
member decides alike; logged once per reason at INFO):

* Adasum (neither engine has it);
* reductions the engine lacks or gets wrong: int16 / uint16 on gloo; float16, bfloat16, bool
  and 8- and 16-bit integers on MPI (Open MPI 4.1 saturates their sums);
* process sets of one rank (nothing moves).

**Device buffers.** A plane with ``native = True`` (torch) also takes the adapter's tensors as
they are (:mod:`hora.core.op.device`): the route hands the plane the framework's tensor, and for
what stays on the builtin path copies it to host memory and back.

**The fast lane is off** with an external plane (the route has no lane group): every allreduce
is negotiated by rank 0 and its bytes go through the plane, so ops ordered by the coordinator are
the only ones the plane ever sees, on one thread.

**Failure.** While the engine waits for the plane it watches hora's own connections to the
set's members (:class:`~hora.transports.planes.PeerWatch`): a member that dies or aborts is
reported at once as :class:`~hora.errors.PeerLostError` naming its rank and host, and the engine
fails the job on every rank as with the builtin plane.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hora._util.log import get_logger
from hora.collectives.comm import Comm
from hora.collectives.ops import ReduceOp
from hora.config import Config
from hora.core.data.routing import Route, SetSite, build_route, close_quietly
from hora.core.op.device import DeviceBuffer, scale
from hora.core.op.entry import Buffer
from hora.errors import ConfigError
from hora.transports.planes import ExternalPlane, PeerWatch, Ticket, reduce_name
from hora.transports.tcp import TcpTransport

log = get_logger(__name__)


class PlaneRoute(Route):
    """A process set's route over an external plane (see the module docstring)."""

    def __init__(self, comm: Comm, config: Config, plane: ExternalPlane, watch: PeerWatch,
                 hostnames: Sequence[str], job_id: str) -> None:
        super().__init__(comm, config)
        self._plane = plane
        self._watch = watch
        self._hostnames = list(hostnames)
        self._job_id = job_id
        self._builtin: Route | None = None
        self._told: set[str] = set()

    # ---- hora's own path, for what the plane cannot do -----------------------------------------
    def _fallback(self, why: str) -> Route:
        """The builtin route (built at the first need, by every member at the same response)."""
        if why not in self._told:
            self._told.add(why)
            log.info("%s on the %s data plane: runs on hora's builtin path", why,
                     self._plane.name)
        if self._builtin is None:
            plain = self._config.replace(data_plane="builtin", cache_capacity=0)
            self._builtin = build_route(self.comm, self._hostnames, plain, self._job_id)
        return self._builtin

    def _run(self, ticket: Ticket, what: str) -> None:
        self._watch.wait(ticket, self._plane.bell, what)
        if ticket.settle is not None:  # device memory: order this thread's stream after the op
            ticket.settle()

    def _reduction(self, buf: Buffer, op: ReduceOp) -> str:
        """The plane's op name, or '' when reducing ``buf`` must run on the builtin path."""
        name = reduce_name(op)
        if name and self._plane.reduces(buf.dtype, name):
            return name
        return ""

    @property
    def name(self) -> str:
        return self._plane.name

    @property
    def native(self) -> bool:
        """Whether the plane takes device buffers (:mod:`hora.core.op.device`) as they are."""
        return bool(getattr(self._plane, "native", False))

    # ---- collectives -------------------------------------------------------------------------
    def allreduce(self, buf: Buffer, op: ReduceOp, scratch: np.ndarray,
                  counts: Sequence[int] | None = None, *, src: np.ndarray | None = None,
                  postscale: float = 1.0) -> None:
        """:meth:`hora.core.data.routing.Route.allreduce` over the plane (or the builtin path); a
        device buffer's bytes stay on its device unless the builtin path must reduce them."""
        name = self._reduction(buf, op)
        if not name:
            why = "Adasum" if op is ReduceOp.Adasum else f"{op.name} allreduce of {buf.dtype}"
            route = self._fallback(why)
            if isinstance(buf, DeviceBuffer):  # hora's own path moves host memory
                host = buf.to_host()
                route.allreduce(host, op, scratch, counts, postscale=postscale)
                buf.load(host)
            else:
                route.allreduce(buf, op, scratch, counts, src=src, postscale=postscale)
            return
        if src is not None:
            assert isinstance(buf, np.ndarray), "src is for host buffers"
            np.copyto(buf, src)
        self._run(self._plane.allreduce(_native(buf), name), "allreduce")
        scale(buf, postscale)

    def allgather(self, sendbuf: Buffer, counts: Sequence[int],
                  out: Buffer) -> None:
        item = out.dtype.itemsize
        self._run(self._plane.allgather(_moved(sendbuf), [c * item for c in counts],
                                        _moved(out)), "allgather")

    def broadcast(self, buf: Buffer, root: int) -> None:
        self._run(self._plane.broadcast(_moved(buf), root), "broadcast")

    def alltoall(self, sendbuf: Buffer, send_counts: Sequence[int],
                 recvbuf: Buffer, recv_counts: Sequence[int]) -> None:
        item = sendbuf.dtype.itemsize
        self._run(self._plane.alltoall(_moved(sendbuf), [c * item for c in send_counts],
                                       _moved(recvbuf), [c * item for c in recv_counts]),
                  "alltoall")

    def reducescatter(self, buf: Buffer, counts: Sequence[int],
                      op: ReduceOp, out: Buffer, scratch: np.ndarray) -> None:
        name = self._reduction(buf, op)
        if not name:
            route = self._fallback(f"{op.name} reducescatter of {buf.dtype}")
            if isinstance(buf, DeviceBuffer) or isinstance(out, DeviceBuffer):
                host_out = out.to_host() if isinstance(out, DeviceBuffer) else out
                route.reducescatter(buf.to_host() if isinstance(buf, DeviceBuffer) else buf,
                                    counts, op, host_out, scratch)
                if isinstance(out, DeviceBuffer):
                    out.load(host_out)
            else:
                route.reducescatter(buf, counts, op, out, scratch)
            return
        self._run(self._plane.reducescatter(_native(buf), counts, name, _native(out)),
                  "reducescatter")

    def close(self) -> None:
        if self._builtin is not None:
            close_quietly(self._builtin)
        self._plane.close()


def _native(buf: Buffer) -> Any:
    """What the plane is handed: a host array, or the framework's tensor of a device buffer."""
    return buf.native if isinstance(buf, DeviceBuffer) else buf


def _moved(buf: Buffer) -> Any:
    """A moving op's buffer for the plane: its bytes, flat (no copy; moving needs no dtype)."""
    if isinstance(buf, DeviceBuffer):
        return buf.bytes_view().native
    return buf.reshape(-1).view(np.uint8)


def plane_route(site: SetSite, make: Callable[[SetSite], ExternalPlane]) -> Route:
    """The route of ``site``'s set (more than one rank) over the plane ``make`` builds for it
    (collective over the members); hora's connections to the members are watched meanwhile.

    Raises:
        ConfigError: the plane cannot run here (no TCP transport, library missing, not mpirun).
        RendezvousError / HoraTimeoutError: the members' group could not be built in time.
    """
    world, config = site.world, site.config
    if not isinstance(world, TcpTransport):
        raise ConfigError(f"HORA_DATA_PLANE={config.data_plane} needs hora's TCP transport "
                          "(a job of several processes)")
    plane = make(site)
    me = world.rank
    watch = PeerWatch(world, [r for r in site.ranks if r != me], config.timeout_seconds,
                      plane.name)
    log.info("process set %d (%d ranks): data plane %s (hora's control plane negotiates)",
             site.set_id, site.comm.size, plane.name)
    return PlaneRoute(site.comm, config, plane, watch, site.hostnames, site.job_id)
