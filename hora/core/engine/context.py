"""Process-wide runtime state: ``init`` -> (ops) -> ``shutdown``, repeatable in one process.

``init`` reads the launcher's environment (``hora run``, mpirun, Slurm, torchrun, or nothing for
a single process), meets the other ranks at the rendezvous store, connects the transport, checks
that every rank registered the same process sets, and starts the engine. Topology queries
(``rank()``, ``local_size()``, ...) read the frozen :class:`Context`.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import hora.config as config_mod
from hora._util import log as hlog
from hora._util.lifetime import die_with_parent
from hora._util.net import interface_address, is_loopback, route_source
from hora.config import Config
from hora.core.data import paths
from hora.core.engine import affinity
from hora.core.engine.engine import Engine
from hora.core.op import device
from hora.core.op import process_set as process_set_mod
from hora.core.op.handle import HandleTable
from hora.core.op.process_set import ProcessSet, Registry, global_process_set
from hora.errors import (
    ConfigError,
    HoraInternalError,
    NotInitializedError,
    RendezvousError,
    RendezvousTimeoutError,
)
from hora.rendezvous.topology import compute_topology
from hora.transports import registry as transports
from hora.transports.base import Transport

log = hlog.get_logger(__name__)


@dataclass
class Context:
    """Everything ``init`` established for this process."""

    config: Config
    engine: Engine
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str
    launcher: str
    hostnames: list[str]
    handles: HandleTable = field(default_factory=HandleTable)
    closers: list[Any] = field(default_factory=list)


ELASTIC_CONNECT_IDLE_S = 15.0
"""Seconds an elastic generation's connection may go without progress before its members ask
the driver for the next generation."""

current: Context | None = None
"""The live context (None before ``init`` and after ``shutdown``): the submit path reads it
without a call; everything else uses :func:`get`."""
_lock = threading.RLock()
_generation = 0
_atexit_registered = False
_dynamic = False


def get(what: str = "") -> Context:
    """The live context, or :class:`~hora.errors.NotInitializedError`."""
    ctx = current
    if ctx is None:
        raise NotInitializedError(what)
    return ctx


process_set_mod.set_rank_source(lambda: get("ProcessSet.rank").rank)


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return current is not None


def dynamic_process_sets() -> bool:
    return _dynamic


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Join the job: rendezvous, connect, start the engine. A no-op when already initialized.

    Args:
        comm: None (every rank of the launcher's job). A list of ranks or an mpi4py communicator
            is Horovod's MPI-only form; hora raises ValueError for those (see the message).
        process_sets: ProcessSet objects to register on every rank (the same list everywhere),
            or ``"dynamic"`` to allow :func:`add_process_set` later.

    Raises:
        ValueError: bad arguments, or process sets that differ across ranks.
        RendezvousError: the other ranks could not be reached before the start timeout.
        ConfigError: a malformed ``HORA_*`` / ``HOROVOD_*`` setting.
    """
    global current, _generation, _atexit_registered, _dynamic
    with _lock:
        if current is not None:
            return
        if comm is not None:
            raise ValueError(
                "Invalid type of argument comm: hora does not take an MPI communicator or rank "
                "list; launch with `hora run`, mpirun, srun or torchrun and call init() with no "
                "comm (process sets give you sub-groups)."
            )
        sets, dynamic = _parse_process_sets(process_sets)
        config = config_mod.load()
        dynamic = dynamic or config.dynamic_process_sets
        hlog.configure(config.log_level, config.log_hide_time)
        from hora.rendezvous import elastic

        session = elastic.session()
        while True:
            _generation += 1
            scope = f"hora.init.{_generation}"
            if session is not None:
                assignment = session.join()
                os.environ.update(assignment.environment())
                scope = assignment.scope
            info, transport, hostnames, closers = _connect(config, scope, sets, dynamic,
                                                           elastic=session is not None)
            if transport is not None:
                break
        assert transport is not None
        slot = compute_topology(hostnames)[info.rank]

        def pick(value: int | None, computed: int) -> int:
            return computed if value is None else value

        local_rank = pick(info.local_rank, slot.local_rank)
        local_size = pick(info.local_size, slot.local_size)
        try:
            core = affinity.core_for(config.thread_affinity, local_rank, local_size)
        except ConfigError:
            transport.close()
            for c in closers:
                c.close()
            raise
        registry = Registry(info.size)
        for ps in sets:
            ps.process_set_id = registry.register(ps.ranks)
        global_process_set.ranks = list(range(info.size))
        global_process_set.process_set_id = 0
        from hora.transports.shm import job_id_from_env

        engine = Engine(transport, config, registry, hostnames=hostnames,
                        job_id=job_id_from_env(os.environ, info.secret))
        current = Context(
            config=config, engine=engine, rank=info.rank, size=info.size,
            local_rank=local_rank, local_size=local_size,
            cross_rank=pick(info.cross_rank, slot.cross_rank),
            cross_size=pick(info.cross_size, slot.cross_size),
            hostname=info.hostname, launcher=info.launcher, hostnames=hostnames,
            closers=closers,
        )
        _dynamic = dynamic
        # adapters hand over device buffers from now on, for the frameworks the plane takes
        device.configure(paths.native_frameworks(config))
        if dynamic:
            os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
        engine.start(cpu_core=core)
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        log.debug("initialized: rank %d of %d on %s (launcher %s)", info.rank, info.size,
                  info.hostname, info.launcher)


def _connect(config: Config, scope: str, sets: list[ProcessSet], dynamic: bool, *,
             elastic: bool) -> tuple[Any, Transport | None, list[str], list[Any]]:
    """Meet the other ranks under ``scope`` and connect to them. An elastic worker whose
    generation could not connect (a member died meanwhile) gets ``None`` as transport and asks
    the driver for the next generation; any other failure raises."""
    from hora.rendezvous.env import detect
    from hora.rendezvous.store_bootstrap import bootstrap

    info = detect()
    hlog.set_rank(info.rank, info.size)
    paths.check_plane(config, info.launcher, info.size)  # every rank alike, before connecting
    if info.launcher == "mpirun" and os.environ.get("HORA_LAUNCHER") == "hora run":
        die_with_parent()  # hora run --data-plane mpi: killing it must not leave ranks behind
    if info.rank == 0:
        _warn_unknown_horovod_vars()
    closers: list[Any] = []
    transport: Transport
    kind = transports.choose(info.size, info.launcher)
    if not kind.store:  # (a process alone: the loopback transport)
        transport, hostnames = kind.make(transports.Meeting(
            info.rank, info.size, info.launcher, info.hostname, config.timeout_seconds))
        return info, transport, hostnames, closers
    store, server = bootstrap(info, timeout=config.start_timeout)
    closers.extend(c for c in (store, server) if c is not None)
    if store is None:
        raise RendezvousError("no rendezvous store for a multi-rank job")
    # An elastic generation's members are all running already: one that does not show up
    # within seconds died after the driver formed the generation.
    idle = min(config.start_timeout, ELASTIC_CONNECT_IDLE_S) if elastic else config.start_timeout
    try:
        transport, hostnames = kind.make(transports.Meeting(
            info.rank, info.size, info.launcher, info.hostname, config.timeout_seconds,
            store=store, scope=scope, secret=info.secret,
            bind_host=_bind_host(info.store_host or "", config), connect_timeout=idle,
            connect_cap=config.start_timeout_cap))
    except (HoraInternalError, RendezvousTimeoutError) as exc:
        for c in closers:
            c.close()
        if not elastic:
            raise
        log.warning("this generation of the elastic job could not connect (%s); asking the "
                    "driver for the next one", exc)
        return info, None, [], []
    except BaseException:
        for c in closers:
            c.close()
        raise
    _check_process_sets(store, scope, info.rank, info.size, sets, dynamic, transport, closers)
    return info, transport, hostnames, closers


_warned_vars: set[str] = set()


def _warn_unknown_horovod_vars() -> None:
    """Rank 0, once per name: an unknown ``HOROVOD_*`` variable is most likely a typo (unknown
    ``HORA_*`` names are refused by the config loader; Horovod's names only warn, as Horovod
    tolerates them)."""
    for name, close in config_mod.unknown_horovod_vars(os.environ):
        if name not in _warned_vars:
            _warned_vars.add(name)
            log.warning("unknown Horovod setting %s in the environment is ignored%s; see `hora "
                        "run --help-all` or docs/config.md for the settings hora reads", name,
                        f" (did you mean {close}?)" if close else "")


def shutdown() -> None:
    """Stop the engine and close connections. Pending ops fail; safe when not initialized."""
    global current
    with _lock:
        ctx, current = current, None
        if ctx is None:
            return
        device.configure(())
        try:
            ctx.engine.stop()
        finally:
            ctx.handles.clear()
            for closer in ctx.closers:
                try:
                    closer.close()
                except Exception:
                    log.debug("error while closing %r", closer, exc_info=True)
            global_process_set.ranks = []
            hlog.set_rank(None, None)


def _parse_process_sets(
    process_sets: Sequence[ProcessSet] | str | None,
) -> tuple[list[ProcessSet], bool]:
    if process_sets is None:
        return [], False
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"process_sets must be a list of ProcessSet or 'dynamic', "
                             f"got {process_sets!r}")
        return [], True
    sets = list(process_sets)
    seen: dict[tuple[int, ...], int] = {}
    for i, ps in enumerate(sets):
        if not isinstance(ps, ProcessSet):
            raise ValueError(f"process_sets[{i}] is {type(ps).__name__}, not a ProcessSet")
        if ps.mpi_comm is not None:
            raise NotImplementedError("process sets built from MPI communicators need an MPI "
                                      "communicator as init(comm=...), which hora does not use")
        key = tuple(ps.ranks)
        if key in seen:
            ps.process_set_id = None
            raise ValueError(f"Duplicate process set at index {i}: {list(key)} is the same as "
                             f"index {seen[key]}.")
        seen[key] = i
    return sets, False


def _check_process_sets(store: Any, scope: str, rank: int, size: int, sets: list[ProcessSet],
                        dynamic: bool, transport: Transport, closers: list[Any]) -> None:
    """Every rank must register the same process sets, of ranks of this job: compare through
    the store (a set with a rank outside the job fails on every rank that passed it)."""
    for i, ps in enumerate(sets):
        bad = [r for r in ps.ranks if not 0 <= r < size]
        if bad or not ps.ranks:
            transport.close()
            for c in closers:
                c.close()
            raise ValueError(
                f"Horovod initialization failed: process_sets[{i}] has ranks {ps.ranks}, and "
                f"this job has {size} rank(s) (0..{size - 1}): "
                + (f"{bad} {'is' if len(bad) == 1 else 'are'} not a rank of it." if bad else
                   "a process set needs at least one rank.")
                + " HINT: build process sets from hvd.size() (launch with more ranks, or "
                "leave the set out).")
    mine = json.dumps({"sets": [ps.ranks for ps in sets], "dynamic": dynamic})
    others = [(peer, theirs) for theirs, peer in _process_set_verdict(store, scope + ".sets",
                                                                       rank, size, mine)
              if theirs != mine]
    if others:
        peer, theirs = min(others)  # the lowest rank that passed something else
        transport.close()
        for c in closers:
            c.close()
        raise ValueError(
            "Horovod initialization failed: different ranks tried to set up mismatching "
            f"process sets: rank {rank} passed {mine}, rank {peer} passed {theirs}. HINT: "
            "pass the same process_sets= list (including sets this rank is not in) on every "
            "rank."
        )


def _process_set_verdict(store: Any, scope: str, rank: int, size: int,
                         mine: str) -> list[tuple[str, int]]:
    """Every distinct process-set list the ranks passed, with the lowest rank that passed it.
    O(1) store requests per rank: each publishes its list and counts itself; the rank whose
    arrival completes the count reads every list in one request and publishes the verdict,
    which the others wait for (as the transport's rendezvous does with addresses)."""
    store.set(scope, str(rank), mine.encode())
    if store.add(scope, "arrived") >= size:  # every rank set its list before counting itself
        keys = [str(r) for r in range(size)]
        got = store.get_many(scope, keys)
        if len(got) < size:  # (a store that lost some: wait for them)
            got = store.wait(scope, keys)
        lowest: dict[str, int] = {}
        for r in range(size):
            lowest.setdefault(got[str(r)].decode(), r)
        verdict: list[Any] = [[value, r] for value, r in lowest.items()]
        store.set(scope, "verdict", json.dumps(verdict).encode())
    else:
        verdict = json.loads(store.get(scope, "verdict"))
    return [(str(value), int(r)) for value, r in verdict]


def _bind_host(store_host: str, config: Config) -> str:
    """The address this rank's transport listens on."""
    if config.gloo_iface:
        return interface_address(config.gloo_iface)
    if not store_host or is_loopback(store_host):
        return "127.0.0.1"
    try:  # the source address of the route to the store is reachable by every rank
        return route_source(store_host)
    except OSError:
        return "0.0.0.0"
