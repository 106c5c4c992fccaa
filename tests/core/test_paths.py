"""The tables of data paths and transports (:mod:`hora.core.data.paths`,
:data:`hora.core.data.routing.SCHEMES`, :mod:`hora.transports.registry`): their choice rules,
and that a new data plane or transport is one module plus one registration (a dummy of each,
defined here, registered here, chosen when selected and used for real)."""

from __future__ import annotations

import collections
import itertools
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from hora.collectives.allgather import allgather
from hora.collectives.allreduce import allreduce
from hora.collectives.alltoall import alltoall
from hora.collectives.broadcast import broadcast
from hora.collectives.comm import Comm
from hora.collectives.hierarchical import host_layout
from hora.collectives.ops import ReduceOp, check_dtype
from hora.collectives.reducescatter import reducescatter
from hora.config import Config
from hora.core.data import paths, routing
from hora.core.data.plane_route import PlaneRoute
from hora.core.data.routing import SCHEMES, DataPath, Route, Scheme, SetSite
from hora.core.engine.engine import Engine
from hora.core.op.entry import Entry
from hora.core.op.handle import Handle
from hora.core.op.messages import OpKind, Request
from hora.core.op.process_set import Registry
from hora.errors import ConfigError
from hora.knobs import KNOBS
from hora.rendezvous.kvstore import KVStoreServer
from hora.rendezvous.store_client import KVStoreClient
from hora.transports import registry as transports
from hora.transports.base import Transport
from hora.transports.loopback import make_world
from hora.transports.planes import Doorbell, Ticket
from hora.transports.tcp import TcpTransport

SECRET = b"paths-test-secret"
_ids = itertools.count()


# ---- the planes' table --------------------------------------------------------------------------
def test_the_registered_planes_are_the_knobs_choices() -> None:
    knob = next(k for k in KNOBS if k.name == "data_plane")
    assert knob.choices is not None
    assert set(knob.choices) == {"builtin", "torch", "mpi"} <= set(paths.PLANES)


def test_the_plane_is_the_one_the_config_names() -> None:
    for name in ("builtin", "torch", "mpi"):
        assert paths.plane_for(Config(data_plane=name)).name == name
    with pytest.raises(ConfigError, match="unknown data plane 'nccl'"):
        paths.plane_for(Config(data_plane="nccl"))
    with pytest.raises(ConfigError, match="unknown data plane"):
        paths.check_plane(Config(data_plane="nccl"), "hora run", 2)


def test_only_the_torch_plane_takes_tensors_as_they_are() -> None:
    assert paths.native_frameworks(Config(data_plane="torch")) == ("torch",)
    assert paths.native_frameworks(Config(data_plane="builtin")) == ()
    assert paths.native_frameworks(Config(data_plane="mpi")) == ()
    assert paths.native_frameworks(Config(data_plane="unknown")) == ()


def test_each_plane_checks_its_job_at_init() -> None:
    paths.check_plane(Config(), "torchrun", 4)  # builtin: nothing to check
    with pytest.raises(ConfigError, match="needs ranks started by mpirun"):
        paths.check_plane(Config(data_plane="mpi"), "torchrun", 2)
    with pytest.raises(ConfigError, match="elastic"):
        paths.check_plane(Config(data_plane="mpi", elastic=True), "mpirun", 2)


def test_a_set_of_one_rank_takes_no_plane() -> None:
    comm = make_world(1)[0].comm()
    route = paths.build_set_route(SetSite(comm, [0], comm, ["h"], Config(data_plane="torch"),
                                          "job"))
    assert type(route) is Route and route.name == DataPath.RING


def test_every_data_collective_has_one_row_of_forms() -> None:
    """The executor's one dispatch by op kind: each collective but allreduce (fused) and the
    control ops has a host form and a device form, of one signature."""
    from hora.core.data import executor

    control = {OpKind.BARRIER, OpKind.JOIN, OpKind.ADD_PROCESS_SET, OpKind.REMOVE_PROCESS_SET,
               OpKind.ERROR}
    assert set(executor._FORMS) == set(OpKind) - control - {OpKind.ALLREDUCE}
    for host, on_device in executor._FORMS.values():
        assert host.__name__.lstrip("_") == on_device.__name__


# ---- hora's own routes: the schemes' table ------------------------------------------------------
class _NoComm:
    rank, size = 0, 0


def _first(hostnames: Sequence[str], **cfg: Any) -> str:
    """The first row of SCHEMES that applies to rank 0 of a set on ``hostnames``."""
    site = SetSite(_NoComm(), range(len(hostnames)), _NoComm(), hostnames,  # type: ignore[arg-type]
                   Config().replace(**cfg), "job")
    layout = host_layout(hostnames, 0)
    return next(s.name for s in SCHEMES if s.applies(site, layout))


def test_the_schemes_choice_rules() -> None:
    assert [s.name for s in SCHEMES] == ["shm", "hierarchical", "ring"]
    assert _first(["a", "a"]) == "shm"
    assert _first(["a", "a"], shm=False) == "ring"
    assert _first(["a", "a", "b", "b"]) == "hierarchical"  # automatic: several ranks per host
    assert _first(["a", "a", "b"]) == "hierarchical"
    assert _first(["a", "a", "b", "b"], hierarchical_allreduce=False) == "ring"
    assert _first(["a", "a", "b", "b"], hierarchical_allreduce=False,
                  hierarchical_allgather=True) == "hierarchical"
    assert _first(["a", "b", "c"]) == "ring"  # one rank per host: nothing to gain
    assert _first(["a", "b", "c"], hierarchical_allreduce=True) == "hierarchical"
    assert _first(["a", "b", "c"], hierarchical_allgather=True) == "ring"


def test_a_registered_scheme_is_tried_before_the_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routing, "SCHEMES", list(SCHEMES))
    built: list[int] = []

    def build(site: SetSite, layout: Any) -> Route:
        built.append(site.comm.rank)
        return Route(site.comm, site.config)

    routing.register_scheme(Scheme("mine", "-", lambda site, layout: len(layout.hosts) > 1,
                                   build))
    assert [s.name for s in routing.SCHEMES] == ["shm", "hierarchical", "mine", "ring"]
    world = make_world(2)
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda t: routing.build_route(t.comm(), ["a", "b"], Config(), "job"),
                      world))
    assert sorted(built) == [0, 1]
    built.clear()
    routing.build_route(make_world(1)[0].comm(), ["a"], Config(), "job")  # a set of one
    assert built == []


# ---- a dummy data plane: one module (this class) plus one registration -------------------------
_OPS = {"sum": ReduceOp.Sum, "min": ReduceOp.Min, "max": ReduceOp.Max,
        "product": ReduceOp.Product}


class EchoPlane:
    """An external plane that moves the bytes with hora's own collectives over the set's comm,
    at once (each ticket is done when returned); it cannot reduce float16."""

    name = "echo"
    made: list[EchoPlane] = []

    def __init__(self, comm: Comm) -> None:
        self.bell = Doorbell()
        self.comm = comm
        self.calls: collections.Counter[str] = collections.Counter()
        EchoPlane.made.append(self)

    def _done(self, what: str) -> Ticket:
        self.calls[what] += 1
        ticket = Ticket(self.bell)
        ticket.finish()
        return ticket

    def reduces(self, dtype: np.dtype[Any], op: str) -> bool:
        return dtype != np.float16

    def allreduce(self, buf: np.ndarray, op: str) -> Ticket:
        allreduce(self.comm, buf, _OPS[op], "ring")
        return self._done("allreduce")

    def allgather(self, send: np.ndarray, counts: Sequence[int], out: np.ndarray) -> Ticket:
        allgather(self.comm, send, counts, out)
        return self._done("allgather")

    def broadcast(self, buf: np.ndarray, root: int) -> Ticket:
        broadcast(self.comm, buf, root)
        return self._done("broadcast")

    def alltoall(self, send: np.ndarray, send_counts: Sequence[int], out: np.ndarray,
                 recv_counts: Sequence[int]) -> Ticket:
        alltoall(self.comm, send, send_counts, out, recv_counts)
        return self._done("alltoall")

    def reducescatter(self, buf: np.ndarray, counts: Sequence[int], op: str,
                      out: np.ndarray) -> Ticket:
        reducescatter(self.comm, buf, counts, _OPS[op], out)
        return self._done("reducescatter")

    def close(self) -> None:
        self.bell.close()


@pytest.fixture
def echo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(paths, "PLANES", dict(paths.PLANES))
    EchoPlane.made.clear()
    paths.register_plane(paths.Plane("echo", paths.external(lambda site: EchoPlane(site.comm))))
    yield
    EchoPlane.made.clear()


class TcpEngines:
    """``n`` engines on threads over hora's TCP transport, each on a host of its own."""

    def __init__(self, n: int, config: Config) -> None:
        self.server = KVStoreServer(SECRET, "127.0.0.1", 0).start()
        self.closers: list[Any] = [self.server]
        scope = f"paths{os.getpid()}.{next(_ids)}"

        def connect(rank: int) -> TcpTransport:
            store = KVStoreClient("127.0.0.1", self.server.port, SECRET, 10.0)
            self.closers.append(store)
            return TcpTransport.create(rank, n, store, scope, SECRET, "127.0.0.1", f"h{rank}",
                                       10.0)

        with ThreadPoolExecutor(max_workers=n) as pool:
            world = list(pool.map(connect, range(n)))
        hostnames = list(world[0].hostnames)
        self.engines = [Engine(t, config, Registry(n), hostnames=hostnames,
                               job_id=f"paths{os.getpid()}n{next(_ids)}") for t in world]
        for engine in self.engines:
            engine.start()

    def run(self, kind: OpKind, name: str, xs: list[np.ndarray], **req: Any) -> list[Any]:
        handles = []
        for r, (engine, x) in enumerate(zip(self.engines, xs)):
            request = Request(name=name, kind=kind, rank=r, dtype=check_dtype(x.dtype),
                              shape=list(x.shape), **req)
            out = np.empty_like(x) if kind in (OpKind.ALLREDUCE, OpKind.BROADCAST) else None
            handles.append(Handle(name))
            engine.submit(Entry(request=request, tensor=x, output=out, handle=handles[-1]))
        return [h.wait(20) for h in handles]

    def close(self) -> None:
        for engine in self.engines:
            engine.stop(timeout=5.0)
        for c in reversed(self.closers):
            c.close()


def test_a_registered_plane_is_chosen_when_selected(echo: None) -> None:
    world = TcpEngines(2, Config(data_plane="echo", cache_capacity=0))
    try:
        xs = [np.arange(6, dtype=np.float32) + r for r in range(2)]
        got = world.run(OpKind.ALLREDUCE, "ar", xs, op=int(ReduceOp.Sum))
        for g in got:
            np.testing.assert_array_equal(g, xs[0] + xs[1])
        assert [e.data_path(0) for e in world.engines] == ["echo", "echo"]
        routes = [e._executor.existing_route(0) for e in world.engines]
        assert all(isinstance(r, PlaneRoute) for r in routes)
        got = world.run(OpKind.ALLGATHER, "ag", [x.reshape(3, 2) for x in xs])
        for g in got:
            np.testing.assert_array_equal(g, np.concatenate([x.reshape(3, 2) for x in xs]))
        got = world.run(OpKind.BROADCAST, "bc", xs, root=1)
        for g in got:
            np.testing.assert_array_equal(g, xs[1])
        # what the plane cannot reduce (float16) runs on hora's own route, by the same rule
        halves = [x.astype(np.float16) for x in xs]
        got = world.run(OpKind.ALLREDUCE, "ar16", halves, op=int(ReduceOp.Sum))
        for g in got:
            np.testing.assert_array_equal(g, halves[0] + halves[1])
        assert len(EchoPlane.made) == 2
        for plane in EchoPlane.made:
            assert plane.calls == {"allreduce": 1, "allgather": 1, "broadcast": 1}
    finally:
        world.close()


# ---- the transports' table ----------------------------------------------------------------------
def test_the_transports_choice_rules() -> None:
    assert transports.choose(1, "single").name == "loopback"
    assert transports.choose(1, "torchrun").name == "tcp"
    assert transports.choose(4, "hora run").name == "tcp"
    assert transports.choose(2, "single").name == "tcp"
    assert not transports.TRANSPORTS["loopback"].store and transports.TRANSPORTS["tcp"].store


def test_a_registered_transport_is_chosen_where_it_applies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A dummy transport (the loopback transport, counted) registered for a process alone:
    ``init()`` connects through it, and ops run over it."""
    monkeypatch.setattr(transports, "TRANSPORTS", dict(transports.TRANSPORTS))
    made: list[Transport] = []

    def make(meeting: transports.Meeting) -> tuple[Transport, list[str]]:
        transport = make_world(meeting.size, timeout=meeting.timeout)[meeting.rank]
        made.append(transport)
        return transport, [meeting.hostname] * meeting.size

    transports.register(transports.TransportKind(
        "counted", lambda size, launcher: launcher == "single", make, store=False, order=-1))
    assert transports.choose(1, "single").name == "counted"
    assert transports.choose(3, "hora run").name == "tcp"
    for var in [v for v in os.environ if v.startswith(("HORA_", "HOROVOD_", "OMPI_", "PMI_",
                                                        "SLURM_"))] + ["RANK", "WORLD_SIZE"]:
        monkeypatch.delenv(var, raising=False)
    import hora

    hora.init()
    try:
        assert len(made) == 1
        np.testing.assert_array_equal(hora.allreduce(np.ones(3), op=hora.Sum), np.ones(3))
    finally:
        hora.shutdown()
