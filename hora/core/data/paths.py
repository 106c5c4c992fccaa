"""The table of data planes: which engine moves the bytes of a process set's data collectives.

A data plane is one row of :data:`PLANES`, added by :func:`register_plane`: its name (the value
of ``HORA_DATA_PLANE`` that selects it; ``HOROVOD_CPU_OPERATIONS=mpi`` selects ``mpi`` in
:func:`hora.config.load`), the check ``init()`` runs on every rank before connecting, the
frameworks whose tensors it moves as they are (the executor's device forms,
:mod:`hora.core.data.device_exec`), and the factory of a set's route. Everything a plane does
not decide stays the engine's: negotiation, fusion, checks, failure detection.

When each path applies, from the job down to one op:

* the job: the plane named by ``config.data_plane`` (:func:`plane_for`), for every process set;
* the set: a set of one rank takes no plane (nothing moves: a plain route); hora's own plane
  (``builtin``) picks a route per set from its own table, :data:`hora.core.data.routing.SCHEMES`
  (shared memory, hierarchical, the TCP ring);
* the op, by size: hora's routes move what fits the shared segments there, the rest over TCP
  (:meth:`~hora.core.data.routing.Route.fits`);
* the op, by dtype and reduction: an external plane's route runs what its engine cannot reduce
  on hora's own route (:meth:`~hora.transports.planes.ExternalPlane.reduces`, Adasum);
* the op, by device: a plane with ``native`` frameworks gets their tensors as they are; any
  other route gets host memory (device buffers staged through the host).

A new data plane is its module (an :class:`~hora.transports.planes.ExternalPlane` under
``hora/transports/``) plus one :func:`register_plane` call whose factory builds it for a set
(:func:`~hora.core.data.plane_route.plane_route` wraps it in a route); a plane users choose by
name also needs its name among ``HORA_DATA_PLANE``'s choices (``hora/knobs.py``).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hora.collectives.broadcast import broadcast
from hora.config import Config
from hora.core.data.plane_route import plane_route
from hora.core.data.routing import Route, SetSite, build_route
from hora.errors import ConfigError
from hora.transports.planes import ExternalPlane

Check = Callable[[Config, str, int], None]
"""A plane's check at ``init()``: (config, launcher, job size); raises ConfigError."""


@dataclass(frozen=True)
class Plane:
    """One row of :data:`PLANES` (see the module docstring).

    Attributes:
        name: the value of ``HORA_DATA_PLANE`` that selects it.
        route: a set's route (a set of more than one rank; collective over its members).
        check: run by ``init()`` on every rank alike, before connecting; raises
            :class:`~hora.errors.ConfigError` when the plane cannot run in this job.
        native: the frameworks whose tensors it moves as they are (their adapters then hand
            over device buffers, :mod:`hora.core.op.device`, and the device forms run).
    """

    name: str
    route: Callable[[SetSite], Route]
    check: Check | None = None
    native: tuple[str, ...] = ()


PLANES: dict[str, Plane] = {}
"""The data planes by name (:func:`register_plane`)."""


def register_plane(plane: Plane) -> Plane:
    """Add ``plane`` to :data:`PLANES` (replacing one of the same name); returns it."""
    PLANES[plane.name] = plane
    return plane


def external(make: Callable[[SetSite], ExternalPlane]) -> Callable[[SetSite], Route]:
    """A plane row's ``route`` for an external engine: ``make`` builds the engine's group for a
    set, :func:`~hora.core.data.plane_route.plane_route` wraps it."""
    return lambda site: plane_route(site, make)


def plane_for(config: Config) -> Plane:
    """The job's data plane.

    Raises:
        ConfigError: no plane of that name is registered.
    """
    plane = PLANES.get(config.data_plane)
    if plane is None:
        raise ConfigError(f"unknown data plane {config.data_plane!r} (HORA_DATA_PLANE: one of "
                          f"{', '.join(PLANES)})")
    return plane


def native_frameworks(config: Config) -> tuple[str, ...]:
    """The frameworks whose tensors the job's plane moves as they are (none if unknown)."""
    plane = PLANES.get(config.data_plane)
    return () if plane is None else plane.native


def check_plane(config: Config, launcher: str, size: int) -> None:
    """At ``init()``, on every rank alike: the chosen plane can run in this job.

    Raises:
        ConfigError: unknown plane, or the plane's own check failed (its library is missing;
            mpi: the ranks were not started by mpirun, or the job is elastic).
    """
    plane = plane_for(config)
    if plane.check is not None:
        plane.check(config, launcher, size)


def build_set_route(site: SetSite) -> Route:
    """The route of ``site``'s set over the job's plane (collective over the set's members)."""
    if site.comm.size == 1:  # nothing moves
        return Route(site.comm, site.config)
    return plane_for(site.config).route(site)


# ---- the planes --------------------------------------------------------------------------------
def _builtin(site: SetSite) -> Route:
    return build_route(site.comm, site.hostnames, site.config, site.job_id)


def _check_torch(config: Config, launcher: str, size: int) -> None:
    from hora.transports.torch_plane import import_torch

    import_torch()


def _torch_plane(site: SetSite) -> ExternalPlane:
    """A torch.distributed gloo group of the set's members, met at hora's rendezvous store."""
    from hora.rendezvous.env import detect
    from hora.rendezvous.store_client import KVStoreClient
    from hora.transports.torch_plane import TorchPlane

    comm, config = site.comm, site.config
    token = np.frombuffer(secrets.token_bytes(8), dtype=np.uint8).copy()
    broadcast(comm, token, 0)  # one scope per group, drawn by its first member
    info = detect()
    if info.store_host is None or info.store_port is None:
        raise ConfigError("HORA_DATA_PLANE=torch: this job has no rendezvous store")
    client = KVStoreClient(info.store_host, info.store_port, info.secret,
                           config.timeout_seconds)
    scope = f"hora.plane.{site.job_id}.{site.set_id}.{token.tobytes().hex()}"
    try:
        return TorchPlane.create(client, scope, comm.rank, comm.size, config.timeout_seconds,
                                 config.gloo_iface)
    except BaseException:
        client.close()
        raise


def _check_mpi(config: Config, launcher: str, size: int) -> None:
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


def _mpi_plane(site: SetSite) -> ExternalPlane:
    """An MPI communicator of the set's members (mpi4py)."""
    from hora.transports.mpi_plane import MpiPlane

    world = site.world
    return MpiPlane.create(list(site.ranks), world.rank, world.size, site.set_id,
                           site.config.timeout_seconds)


register_plane(Plane("builtin", _builtin))
register_plane(Plane("torch", external(_torch_plane), _check_torch, native=("torch",)))
register_plane(Plane("mpi", external(_mpi_plane), _check_mpi))

__all__ = ["PLANES", "Plane", "SetSite", "build_set_route", "check_plane", "external",
           "native_frameworks", "plane_for", "register_plane"]
