"""Routes over an external data plane (``HORA_DATA_PLANE=torch`` or ``mpi``).

:func:`build_plane_route` is what :meth:`~hora.core.data.executor.Executor.route_for` builds instead
of :func:`~hora.core.data.routing.build_route` when the job's data plane is not hora's own. The
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

import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np

from hora._util.log import get_logger
from hora.collectives.broadcast import broadcast
from hora.collectives.comm import Comm
from hora.collectives.ops import ReduceOp
from hora.config import Config
from hora.core.data.routing import DataPath, Route, build_route, close_quietly
from hora.core.op.device import DeviceBuffer, scale
from hora.core.op.entry import Buffer
from hora.errors import ConfigError
from hora.transports.planes import ExternalPlane, PeerWatch, Ticket, reduce_name
from hora.transports.tcp import TcpTransport

log = get_logger(__name__)


def check_plane(config: Config, launcher: str, size: int) -> None:
    """At ``init()``, on every rank alike: the chosen plane can run in this job.

    Raises:
        ConfigError: the plane's library is missing, or (mpi) the ranks were not started by
            mpirun, or the job is elastic (MPI's world is fixed when mpirun starts it).
    """
    if config.data_plane == "torch":
        from hora.transports.torch_plane import import_torch

        import_torch()
    elif config.data_plane == "mpi":
        if config.elastic:
            raise ConfigError("HORA_DATA_PLANE=mpi cannot follow an elastic job's changing "
                              "membership (MPI's world is fixed when mpirun starts it); use "
                              "the builtin or torch data plane for elastic jobs")
        if size > 1 and launcher != "mpirun":
            raise ConfigError(
                f"HORA_DATA_PLANE=mpi needs ranks started by mpirun, but this job was started "
                f"by {launcher}: run `hora run --data-plane mpi -np N python train.py` (it "
                "starts the ranks through mpirun) or `mpirun -np N python train.py`, or choose "
                "another data plane")
        from hora.transports.mpi_plane import import_mpi

        import_mpi()


class PlaneRoute(Route):
    """A process set's route over an external plane (see the module docstring)."""

    def __init__(self, comm: Comm, config: Config, plane: ExternalPlane, watch: PeerWatch,
                 hostnames: Sequence[str], job_id: str) -> None:
        super().__init__(comm, config, scheme=DataPath(plane.name))
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


def build_plane_route(world: Comm, ranks: Sequence[int], comm: Comm, hostnames: Sequence[str],
                      config: Config, job_id: str, set_id: int) -> Route:
    """The route of process set ``set_id`` (global ``ranks``, ``comm`` over them, member ``i``
    on ``hostnames[i]``) over ``config.data_plane`` (collective over the members).

    Args:
        world: hora's global comm (the TCP transport: its connections are watched).

    Raises:
        ConfigError: the plane cannot run here (no TCP transport, library missing, not mpirun).
        RendezvousError / HoraTimeoutError: the members' group could not be built in time.
    """
    if comm.size == 1:
        return Route(comm, config)
    if not isinstance(world, TcpTransport):
        raise ConfigError(f"HORA_DATA_PLANE={config.data_plane} needs hora's TCP transport "
                          "(a job of several processes)")
    me = world.rank
    plane: Any
    if config.data_plane == "torch":
        from hora.rendezvous.env import detect
        from hora.rendezvous.store_client import KVStoreClient
        from hora.transports.torch_plane import TorchPlane

        token = np.frombuffer(secrets.token_bytes(8), dtype=np.uint8).copy()
        broadcast(comm, token, 0)  # one scope per group, drawn by its first member
        info = detect()
        if info.store_host is None or info.store_port is None:
            raise ConfigError("HORA_DATA_PLANE=torch: this job has no rendezvous store")
        client = KVStoreClient(info.store_host, info.store_port, info.secret,
                               config.timeout_seconds)
        scope = f"hora.plane.{job_id}.{set_id}.{token.tobytes().hex()}"
        try:
            plane = TorchPlane.create(client, scope, comm.rank, comm.size, config.timeout_seconds,
                                      config.gloo_iface)
        except BaseException:
            client.close()
            raise
    elif config.data_plane == "mpi":
        from hora.transports.mpi_plane import MpiPlane

        plane = MpiPlane.create(ranks, me, world.size, set_id, config.timeout_seconds)
    else:
        raise ConfigError(f"unknown data plane {config.data_plane!r}")
    watch = PeerWatch(world, [r for r in ranks if r != me], config.timeout_seconds, plane.name)
    log.info("process set %d (%d ranks): data plane %s (hora's control plane negotiates)",
             set_id, comm.size, plane.name)
    return PlaneRoute(comm, config, plane, watch, hostnames, job_id)
