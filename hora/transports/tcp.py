"""The TCP transport: authenticated sockets between the ranks of a job, any hosts.

:meth:`TcpTransport.create` has :func:`hora.transports.tcp_mesh.connect_mesh` build the
connections (rendezvous, listening, connecting, authentication; described there):

* **data** connections, used as raw byte streams by the collectives via :meth:`comm`: to the
  ring neighbours and host leaders at start, to any other peer on first use
  (:class:`~hora.transports.tcp_links.LazyLinks`), never a full mesh unless the job's
  collectives use every pair (:meth:`TcpTransport.connection_counts`);
* a **control** connection between rank 0 and every other rank, carrying framed messages.

This module is the transport that uses the established connections: the data plane here, the
control plane in :mod:`hora.transports.tcp_control`.

Data plane: sockets are non-blocking with ``TCP_NODELAY``; :meth:`sendrecv` interleaves
``send`` of at most :data:`SEND_CHUNK` bytes with ``recv_into`` whatever has arrived, polling
only when neither direction can move, so the two transfers overlap and a ring of ranks that all
call it at once cannot deadlock. Buffers are never copied (memoryview slices and ``recv_into``).
Every wait has an *inactivity* deadline: no progress for ``timeout`` seconds raises
:class:`~hora.errors.HoraTimeoutError` naming the peer; EOF or a reset raises
:class:`~hora.errors.PeerLostError` naming the peer's rank and host.

The data plane is for one thread at a time (the engine's). The control plane (framed messages,
safe from several threads) is :class:`hora.transports.tcp_control.ControlPlane`.
"""

from __future__ import annotations

import select
import socket
import time
from typing import TYPE_CHECKING

from hora._util.log import get_logger
from hora._util.typing_compat import override
from hora.collectives.comm import Buffer, Comm
from hora.config import KNOBS_BY_NAME
from hora.errors import HoraInternalError, HoraTimeoutError, PeerLostError, TransportError
from hora.transports.base import Transport
from hora.transports.tcp_control import ControlPlane, describe_peer
from hora.transports.tcp_links import LazyLinks
from hora.transports.tcp_mesh import LOST_HINT as _LOST_HINT
from hora.transports.tcp_mesh import TIMEOUT_HINT as _TIMEOUT_HINT
from hora.transports.tcp_mesh import connect_mesh

if TYPE_CHECKING:
    from hora.rendezvous.store_client import KVStoreClient

log = get_logger(__name__)

SEND_CHUNK = 512 * 1024
"""Most bytes handed to one ``send`` call inside :meth:`TcpTransport.sendrecv`, so that sending
yields to receiving often enough to keep both directions moving (measured: see docs)."""

_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT


def _byte_view(buf: Buffer, writable: bool = False) -> memoryview:
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise ValueError("hora transports need C-contiguous buffers")
        view = view.cast("B")
    elif not view.c_contiguous:
        raise ValueError("hora transports need C-contiguous buffers")
    if writable and view.readonly:
        raise ValueError("the receive buffer is read-only")
    return view


class TcpTransport(Transport):
    """TCP connections between the ranks of one job. Build with :meth:`create`."""

    name = "tcp"

    def __init__(self, rank: int, size: int, hostnames: list[str],
                 data: dict[int, socket.socket], control: dict[int, socket.socket],
                 timeout: float, wake_pair: tuple[socket.socket, socket.socket] | None = None,
                 links: LazyLinks | None = None) -> None:
        self._rank = rank
        self._size = size
        self._hostnames = list(hostnames)
        self._data = data
        self._links = links  # opens the data connections not made at start (None: none)
        self._control = control
        self._timeout = timeout
        self._closed = False
        for sock in data.values():
            sock.setblocking(False)
        self._pollers: dict[tuple[int, int], select.poll] = {}  # cached per (fd, events)
        self._ctl = ControlPlane(rank, control, wake_pair, self._hostnames)

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def create(cls, rank: int, size: int, store: KVStoreClient | None, scope: str, secret: bytes,
               bind_host: str, hostname: str, timeout: float, *,
               connect_timeout: float | None = None,
               connect_cap: float | None = None) -> TcpTransport:
        """Rendezvous through ``store`` under ``scope`` and connect to every other rank.

        Every rank of the job calls this with the same ``scope``, ``size`` and ``secret``.

        Args:
            rank: this process's global rank.
            size: number of ranks.
            store: the rendezvous store client (may be None only when ``size == 1``).
            scope: store scope for this mesh; a new one per (re)initialisation.
            secret: the job secret, for authenticating every connection.
            bind_host: local address to listen on (and to publish).
            hostname: this process's host identity, published for topology and messages.
            timeout: inactivity deadline of every data and control wait, in seconds.
            connect_timeout: seconds the set-up may go without progress (no new rank
                published its address; default ``timeout``).
            connect_cap: seconds allowed for the whole set-up (default: the
                ``start_timeout_cap`` knob's default), at least ``connect_timeout``.

        Raises:
            RendezvousTimeoutError: some ranks never published their address (lists them).
            RendezvousError: the store failed.
            HoraTimeoutError: some ranks published but never connected (lists them).
            TransportError: a peer could not be reached or ``bind_host`` is not local;
                AuthenticationError (a subclass) when a peer rejected our credentials.
            ValueError: ``rank`` is not in ``0..size-1``.
        """
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in 0..{size - 1}")
        idle = timeout if connect_timeout is None else connect_timeout
        cap = KNOBS_BY_NAME["start_timeout_cap"].default if connect_cap is None else connect_cap
        deadline = time.monotonic() + max(idle, cap)
        if size == 1:
            return cls(rank, size, [hostname], {}, {}, timeout)
        mesh = connect_mesh(rank, size, store, scope, secret, bind_host, hostname, idle,
                            deadline)
        log.debug("tcp mesh of %d ranks ready (scope %s)", size, scope)
        return cls(rank, size, mesh.hostnames, mesh.data, mesh.control, timeout, mesh.wake_pair,
                   mesh.links)

    # ---- identity ----------------------------------------------------------------------------

    @property
    @override
    def rank(self) -> int:
        return self._rank

    @property
    @override
    def size(self) -> int:
        return self._size

    @property
    def hostnames(self) -> list[str]:
        """Host identity of every rank, in rank order (as published in the store)."""
        return list(self._hostnames)

    @property
    def timeout(self) -> float:
        """The inactivity deadline in seconds."""
        return self._timeout

    @override
    def describe(self, peer: int) -> str:
        return describe_peer(self._hostnames, peer)

    @override
    def comm(self) -> Comm:
        return self

    # ---- data plane --------------------------------------------------------------------------

    def _sock(self, peer: int) -> socket.socket:
        if self._closed:
            raise TransportError("the TCP transport is closed (hora was shut down)")
        sock = self._data.get(peer)
        if sock is None:
            return self._open(peer)
        return sock

    def _open(self, peer: int) -> socket.socket:
        """Open the data connection to ``peer`` on its first use (:class:`LazyLinks`)."""
        if (self._links is None or not isinstance(peer, int) or isinstance(peer, bool)
                or not 0 <= peer < self._size or peer == self._rank):
            raise ValueError(f"rank {self._rank} has no data connection to peer {peer!r} "
                             f"(valid peers: 0..{self._size - 1} except itself)")
        sock = self._links.open(peer, self._timeout)
        if self._closed:
            sock.close()
            raise TransportError("the TCP transport is closed (hora was shut down)")
        sock.setblocking(False)
        self._data[peer] = sock
        log.debug("rank %d opened its data connection to rank %d on first use", self._rank, peer)
        return sock

    def connection_counts(self) -> tuple[int, int]:
        """``(data, control)``: how many TCP connections to other ranks this rank holds now
        (listening socket, wake-up pair and attached host links not counted)."""
        return len(self._data), len(self._ctl.peers()) - len(self._ctl.attached)

    def _lost_error(self, peer: int, exc: BaseException | None, doing: str
                    ) -> HoraInternalError:
        if self._closed:
            return TransportError(f"the TCP transport was closed while rank {self._rank} was "
                                  f"{doing} {self.describe(peer)}")
        how = "closed its connection" if exc is None else f"broke its connection ({exc})"
        return PeerLostError(f"{self.describe(peer)} {how} while rank {self._rank} was "
                             f"{doing}: {_LOST_HINT}", peer=peer)

    def _timeout_error(self, waits: list[tuple[int, str]]) -> HoraTimeoutError:
        what = " and ".join(f"{doing} {self.describe(peer)}" for peer, doing in waits)
        return HoraTimeoutError(
            f"rank {self._rank} made no progress for {self._timeout:g} s {what}; the peer may "
            f"be stuck, much slower, or waiting in a different collective. {_TIMEOUT_HINT}"
        )

    def send(self, peer: int, buf: Buffer) -> None:
        """Send all bytes of ``buf`` to ``peer``; returns when ``buf`` may be reused.

        Raises:
            PeerLostError: the peer closed or reset the connection.
            HoraTimeoutError: the peer accepted no bytes for ``timeout`` seconds.
        """
        view = _byte_view(buf)
        total, sent = len(view), 0
        sock = self._sock(peer)
        while sent < total:
            try:
                sent += sock.send(view[sent:])
            except BlockingIOError:
                self._wait(sock, _POLLOUT, peer, "sending", sent, total)
            except OSError as exc:
                raise self._lost_error(peer, exc, f"sending {total} bytes to it") from exc

    def recv_into(self, peer: int, buf: Buffer) -> None:
        """Receive exactly ``len(buf)`` bytes (as bytes) from ``peer`` into ``buf``.

        Raises:
            PeerLostError: the peer closed or reset the connection.
            HoraTimeoutError: no bytes arrived for ``timeout`` seconds.
        """
        view = _byte_view(buf, writable=True)
        total, got = len(view), 0
        sock = self._sock(peer)
        while got < total:
            try:
                n = sock.recv_into(view[got:])
            except BlockingIOError:
                self._wait(sock, _POLLIN, peer, "receiving", got, total)
                continue
            except OSError as exc:
                raise self._lost_error(peer, exc, f"receiving {total} bytes from it") from exc
            if n == 0:
                raise self._lost_error(peer, None, f"receiving from it ({got} of {total} bytes)")
            got += n

    def sendrecv(self, send_peer: int, send_buf: Buffer, recv_peer: int, recv_buf: Buffer) -> None:
        """Send ``send_buf`` to ``send_peer`` while receiving ``recv_buf`` from ``recv_peer``.

        The two transfers overlap; ranks of a ring calling this at once cannot deadlock.

        Raises:
            PeerLostError: either peer closed or reset its connection.
            HoraTimeoutError: neither transfer made progress for ``timeout`` seconds.
        """
        sview = _byte_view(send_buf)
        rview = _byte_view(recv_buf, writable=True)
        if send_peer == self._rank and recv_peer == self._rank:
            if len(sview) != len(rview):
                raise ValueError("sendrecv to itself needs equal buffer sizes")
            rview[:] = sview
            return
        ssock, rsock = self._sock(send_peer), self._sock(recv_peer)
        stotal, rtotal = len(sview), len(rview)
        sent = got = 0
        chunk = SEND_CHUNK
        while sent < stotal or got < rtotal:
            moved = False
            if sent < stotal:
                try:
                    sent += ssock.send(sview[sent:sent + chunk])
                    moved = True
                except BlockingIOError:
                    pass
                except OSError as exc:
                    raise self._lost_error(send_peer, exc, "sending to it") from exc
            if got < rtotal:
                try:
                    n = rsock.recv_into(rview[got:])
                except BlockingIOError:
                    n = -1
                except OSError as exc:
                    raise self._lost_error(recv_peer, exc, "receiving from it") from exc
                if n == 0:
                    raise self._lost_error(recv_peer, None,
                                           f"receiving from it ({got} of {rtotal} bytes)")
                if n > 0:
                    got += n
                    moved = True
            if not moved:
                self._wait_both(ssock if sent < stotal else None,
                                rsock if got < rtotal else None,
                                send_peer, recv_peer, sent, stotal, got, rtotal)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("the TCP transport was closed by this process during a "
                                 "transfer (hora was shut down)")

    def _wait(self, sock: socket.socket, events: int, peer: int, doing: str, done: int,
              total: int) -> None:
        """Block until ``sock`` is ready for ``events``, at most the inactivity timeout."""
        self._check_open()
        key = (sock.fileno(), events)
        poller = self._pollers.get(key)
        if poller is None:
            poller = self._pollers[key] = select.poll()
            poller.register(sock, events)
        if not poller.poll(self._timeout * 1000):
            direction = "to" if events == _POLLOUT else "from"
            raise self._timeout_error([(peer, f"{doing} ({done} of {total} bytes) {direction}")])

    def _wait_both(self, ssock: socket.socket | None, rsock: socket.socket | None,
                   send_peer: int, recv_peer: int, sent: int, stotal: int, got: int,
                   rtotal: int) -> None:
        self._check_open()
        poller = select.poll()
        waits: list[tuple[int, str]] = []
        if ssock is not None:
            poller.register(ssock, _POLLOUT)
            waits.append((send_peer, f"sending ({sent} of {stotal} bytes) to"))
        if rsock is not None:
            events = _POLLIN | (_POLLOUT if rsock is ssock else 0)
            poller.register(rsock, events)  # re-registering the same socket modifies it
            waits.append((recv_peer, f"receiving ({got} of {rtotal} bytes) from"))
        if not poller.poll(self._timeout * 1000):
            raise self._timeout_error(waits)

    def data_connections(self, peers: list[int]) -> dict[int, socket.socket]:
        """The data connections to ``peers`` (global ranks), for a caller that waits on an
        external data plane (:class:`hora.transports.planes.PeerWatch`) and must notice a
        peer's death while that plane moves the bytes: it polls them, never reads or writes.

        Raises:
            TransportError: the transport is closed.
            ValueError: a peer is this rank or out of range.
        """
        return {peer: self._sock(peer) for peer in peers}

    # ---- control plane (hora.transports.tcp_control) -----------------------------------------

    @override
    def send_control(self, peer: int, payload: bytes) -> None:
        """See :meth:`hora.transports.tcp_control.ControlPlane.send`."""
        self._ctl.send(peer, payload, self._wait, self._lost_error)

    @override
    def recv_control(self, timeout: float | None) -> tuple[int, bytes] | None:
        """See :meth:`hora.transports.tcp_control.ControlPlane.recv`."""
        return self._ctl.recv(timeout)

    @override
    def attach_control(self, peer: int, sock: socket.socket) -> bool:
        """See :meth:`hora.transports.tcp_control.ControlPlane.attach`."""
        self._check_open()
        self._ctl.attach(peer, sock)
        return True

    @override
    def wake(self) -> None:
        self._ctl.wake()

    # ---- shutdown ----------------------------------------------------------------------------

    @override
    def shutdown_data(self) -> None:
        for sock in list(self._data.values()):  # FIN, not RST: peers see EOF at once
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @override
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._links is not None:
            self._links.close()  # wakes a rank waiting for a peer to connect
        self.shutdown_data()  # wakes any thread of this process blocked on a data connection
        self._ctl.close()  # ... or in recv_control, before the control connections close
        for sock in list(self._data.values()):
            sock.close()

    def __del__(self) -> None:  # pragma: no cover - best effort if close() was forgotten
        if not getattr(self, "_closed", True):
            if self._links is not None:
                self._links.close()
            for sock in (*self._data.values(), *self._control.values()):
                sock.close()


__all__ = ["SEND_CHUNK", "TcpTransport"]
