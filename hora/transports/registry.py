"""The table of transports: which :class:`~hora.transports.base.Transport` connects a job's ranks.

A transport is one row of :data:`TRANSPORTS`, added by :func:`register`: its name, when it
applies (the job's size and launcher), whether it meets the other ranks through the rendezvous
store, and a factory. ``init()`` (:mod:`hora.core.engine.context`) takes the first row, in
``order``, that applies (:func:`choose`): the loopback transport for a process alone (no
launcher), hora's TCP mesh otherwise. No knob chooses among them: a row's ``applies`` decides.

A new transport is its module (a :class:`~hora.transports.base.Transport` passing
``tests/transports``' conformance suite) plus one :func:`register` call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hora.transports.base import Transport


@dataclass(frozen=True)
class Meeting:
    """What a transport's factory gets: this rank, the job, and (for a transport that meets its
    peers through the rendezvous store) the store and how long to wait for them."""

    rank: int
    size: int
    launcher: str
    hostname: str
    timeout: float
    """Inactivity deadline of every data and control wait, in seconds."""
    store: Any = None
    """The rendezvous store client (:class:`~hora.rendezvous.store_client.KVStoreClient`)."""
    scope: str = ""
    secret: bytes = b""
    bind_host: str = ""
    connect_timeout: float | None = None
    connect_cap: float | None = None


@dataclass(frozen=True)
class TransportKind:
    """One row of :data:`TRANSPORTS`.

    Attributes:
        name: the transport's name (logs).
        applies: (job size, launcher) -> whether it may connect this job.
        make: connects this rank (every rank of the job calls it alike): the transport and
            every rank's host name (ranks with the same name share a host: shared memory).
        store: whether it meets the other ranks through the rendezvous store (``init()`` then
            bootstraps one and checks the process sets through it).
        order: rows are tried from the lowest.
    """

    name: str
    applies: Callable[[int, str], bool]
    make: Callable[[Meeting], tuple[Transport, list[str]]]
    store: bool = True
    order: int = 100


TRANSPORTS: dict[str, TransportKind] = {}
"""The transports by name (:func:`register`)."""


def register(kind: TransportKind) -> TransportKind:
    """Add ``kind`` to :data:`TRANSPORTS` (replacing one of the same name); returns it."""
    TRANSPORTS[kind.name] = kind
    return kind


def choose(size: int, launcher: str) -> TransportKind:
    """The transport of a job of ``size`` ranks started by ``launcher``: the first row, by
    ``order``, that applies."""
    for kind in sorted(TRANSPORTS.values(), key=lambda k: k.order):
        if kind.applies(size, launcher):
            return kind
    raise LookupError(f"no transport applies to a job of {size} ranks started by {launcher}")


def _loopback(meeting: Meeting) -> tuple[Transport, list[str]]:
    from hora.transports.loopback import make_world

    transport = make_world(meeting.size, timeout=meeting.timeout)[meeting.rank]
    return transport, [meeting.hostname] * meeting.size


def _tcp(meeting: Meeting) -> tuple[Transport, list[str]]:
    from hora.transports.tcp import TcpTransport

    transport = TcpTransport.create(
        meeting.rank, meeting.size, meeting.store, scope=meeting.scope, secret=meeting.secret,
        bind_host=meeting.bind_host, hostname=meeting.hostname, timeout=meeting.timeout,
        connect_timeout=meeting.connect_timeout, connect_cap=meeting.connect_cap)
    return transport, list(transport.hostnames)


register(TransportKind("loopback", lambda size, launcher: size == 1 and launcher == "single",
                       _loopback, store=False, order=0))
register(TransportKind("tcp", lambda size, launcher: True, _tcp))

__all__ = ["TRANSPORTS", "Meeting", "TransportKind", "choose", "register"]
