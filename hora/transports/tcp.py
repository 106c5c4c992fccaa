"""The TCP transport: a full mesh of authenticated sockets between the ranks of a job, any hosts.

:meth:`TcpTransport.create` listens on the chosen interface, publishes ``host:port`` and the
host name in the rendezvous store, waits for every rank's entry, then builds

* a **data** connection between every pair of ranks (the lower rank accepts, the higher rank
  connects; all in parallel), used as raw byte streams by the collectives via :meth:`comm`;
* a **control** connection between rank 0 and every other rank, carrying framed messages.

Every connection runs :mod:`hora._util.auth` (the scope is bound into the MACs) and then states
its rank and channel, so a process without the job secret, or from another generation of the
job, is refused.

Data plane: sockets are non-blocking with ``TCP_NODELAY``; :meth:`sendrecv` interleaves
``send`` of at most :data:`SEND_CHUNK` bytes with ``recv_into`` whatever has arrived, polling
only when neither direction can move, so the two transfers overlap and a ring of ranks that all
call it at once cannot deadlock. Buffers are never copied (memoryview slices and ``recv_into``).
Every wait has an *inactivity* deadline: no progress for ``timeout`` seconds raises
:class:`~hora.errors.HoraTimeoutError` naming the peer; EOF or a reset raises
:class:`~hora.errors.PeerLostError` naming the peer's rank and host.

The data plane is for one thread at a time (the engine's). The control plane may be used from
several threads: :meth:`send_control` locks per peer, :meth:`recv_control` is serialized, and
:meth:`wake` is lock-free.
"""

from __future__ import annotations

import collections
import json
import queue
import select
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

from hora._util import auth
from hora._util.log import get_logger
from hora._util.typing_compat import override
from hora._util.net import recv_bytes, send_all
from hora.collectives.comm import Buffer, Comm
from hora.errors import (
    AuthenticationError,
    HoraInternalError,
    HoraTimeoutError,
    PeerLostError,
    RendezvousError,
    RendezvousTimeoutError,
    TransportError,
)
from hora.transports.base import MAX_CONTROL_MESSAGE, Transport

if TYPE_CHECKING:
    from hora.rendezvous.kvstore import KVStoreClient

log = get_logger(__name__)

SEND_CHUNK = 512 * 1024
"""Most bytes handed to one ``send`` call inside :meth:`TcpTransport.sendrecv`, so that sending
yields to receiving often enough to keep both directions moving (measured: see docs)."""

DATA, CONTROL = 0, 1
_CHANNEL_NAMES = {DATA: "data", CONTROL: "control"}
_HELLO = struct.Struct("!8sIIB")  # magic, rank, size, channel
_HELLO_MAGIC = b"HORATCP1"
_ACCEPT, _REJECT = b"\x01", b"\x00"
_LEN = struct.Struct("!I")
_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT
_TIMEOUT_HINT = "HINT: raise HORA_TIMEOUT_SECONDS (hora run --timeout-seconds) if this is expected."
_LOST_HINT = "it probably exited or crashed; see its output"


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
    """Full-mesh TCP connections between the ranks of one job. Build with :meth:`create`."""

    name = "tcp"

    def __init__(self, rank: int, size: int, hostnames: list[str],
                 data: dict[int, socket.socket], control: dict[int, socket.socket],
                 timeout: float, wake_pair: tuple[socket.socket, socket.socket] | None = None
                 ) -> None:
        self._rank = rank
        self._size = size
        self._hostnames = list(hostnames)
        self._data = data
        self._control = control
        self._timeout = timeout
        self._closed = False
        for sock in (*data.values(), *control.values()):
            sock.setblocking(False)
        self._wake_r, self._wake_w = wake_pair or socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._send_locks = {peer: threading.Lock() for peer in control}
        self._recv_lock = threading.Lock()
        self._inbox: dict[int, bytearray] = {peer: bytearray() for peer in control}
        self._pending: collections.deque[tuple[int, bytes]] = collections.deque()
        self._lost: dict[int, str] = {}
        self._lost_reported: set[int] = set()
        self._woken = False
        self._pollers: dict[tuple[int, int], select.poll] = {}  # cached per (fd, events)
        self._scratch = memoryview(bytearray(256 * 1024))  # control-plane receive buffer
        self._fd_peer = {sock.fileno(): peer for peer, sock in control.items()}
        self._poller = select.poll()
        self._poller.register(self._wake_r, _POLLIN)
        for sock in control.values():
            self._poller.register(sock, _POLLIN)

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def create(cls, rank: int, size: int, store: KVStoreClient | None, scope: str, secret: bytes,
               bind_host: str, hostname: str, timeout: float, *,
               connect_timeout: float | None = None) -> TcpTransport:
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
            connect_timeout: seconds allowed for the whole set-up (default ``timeout``).

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
        deadline = time.monotonic() + (timeout if connect_timeout is None else connect_timeout)
        if size == 1:
            return cls(rank, size, [hostname], {}, {}, timeout)
        if store is None:
            raise TransportError(f"a {size}-rank TCP transport needs a rendezvous store")
        try:
            listener = socket.create_server((bind_host, 0), backlog=2 * size + 8,
                                            family=socket.AF_INET6 if ":" in bind_host
                                            else socket.AF_INET)
        except OSError as exc:
            raise TransportError(
                f"rank {rank} cannot listen on {bind_host!r}: {exc}. HINT: it must be an address "
                "of this host; choose the interface with HORA_GLOO_IFACE."
            ) from exc
        wake_pair = socket.socketpair()
        try:
            port = listener.getsockname()[1]
            advertised = bind_host if bind_host not in ("", "0.0.0.0", "::") else hostname
            entry = {"host": advertised, "port": port, "hostname": hostname, "size": size}
            store.set(scope, str(rank), json.dumps(entry).encode())
            entries = _gather_entries(store, scope, rank, size, deadline)
            setup = _MeshSetup(rank, size, entries, secret, scope, deadline, listener, wake_pair)
            data, control = setup.run()
        except BaseException:
            listener.close()
            for sock in wake_pair:
                sock.close()
            raise
        listener.close()
        hostnames = [str(entries[r]["hostname"]) for r in range(size)]
        log.debug("tcp mesh of %d ranks ready (scope %s)", size, scope)
        return cls(rank, size, hostnames, data, control, timeout, wake_pair)

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
        host = self._hostnames[peer] if 0 <= peer < len(self._hostnames) else "?"
        return f"rank {peer} (host {host})"

    @override
    def comm(self) -> Comm:
        return self

    # ---- data plane --------------------------------------------------------------------------

    def _sock(self, peer: int) -> socket.socket:
        if self._closed:
            raise TransportError("the TCP transport is closed (hora was shut down)")
        sock = self._data.get(peer)
        if sock is None:
            raise ValueError(f"rank {self._rank} has no data connection to peer {peer!r} "
                             f"(valid peers: 0..{self._size - 1} except itself)")
        return sock

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

    # ---- control plane -----------------------------------------------------------------------

    def _check_control_peer(self, peer: int) -> socket.socket:
        if self._closed:
            raise TransportError("the TCP transport is closed (hora was shut down)")
        sock = self._control.get(peer)
        if sock is None:
            raise ValueError(f"control messages go between rank 0 and the others only; rank "
                             f"{self._rank} has no control connection to {peer!r}")
        return sock

    @override
    def send_control(self, peer: int, payload: bytes) -> None:
        """Send one framed control message to ``peer`` (rank 0 <-> others only).

        Raises:
            TransportError: the payload exceeds MAX_CONTROL_MESSAGE.
            PeerLostError: the connection is closed.
            HoraTimeoutError: the peer accepted no bytes for ``timeout`` seconds.
        """
        sock = self._check_control_peer(peer)
        if len(payload) > MAX_CONTROL_MESSAGE:
            raise TransportError(f"control message of {len(payload)} bytes exceeds the limit "
                                 f"of {MAX_CONTROL_MESSAGE}")
        header = _LEN.pack(len(payload))
        parts = [header + payload] if len(payload) <= 65536 else [header, payload]
        with self._send_locks[peer]:
            for part in parts:
                view = memoryview(part).cast("B")
                sent = 0
                while sent < len(view):
                    try:
                        sent += sock.send(view[sent:])
                    except BlockingIOError:
                        self._wait(sock, _POLLOUT, peer, "sending a control message", sent,
                                   len(view))
                    except OSError as exc:
                        raise self._lost_error(peer, exc, "sending a control message") from exc

    @override
    def recv_control(self, timeout: float | None) -> tuple[int, bytes] | None:
        """Next control message as ``(sender, payload)``; None on timeout, :meth:`wake` or close.

        Messages already received are delivered before a pending wake; a wake is never lost
        (several wakes before a call make one call return None).

        Raises:
            PeerLostError: a control connection closed (names the peer's rank and host); raised
                after the messages it sent before closing have been delivered.
            TransportError: a peer sent a frame longer than MAX_CONTROL_MESSAGE.
        """
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._recv_lock:
            while True:
                if self._pending:
                    return self._pending.popleft()
                if self._woken or self._closed:
                    self._woken = False
                    return None
                for peer, why in self._lost.items():
                    if peer not in self._lost_reported:  # each lost peer is reported once
                        self._lost_reported.add(peer)
                        raise PeerLostError(f"{self.describe(peer)} {why} to rank "
                                            f"{self._rank}: {_LOST_HINT}", peer=peer)
                if deadline is None:
                    wait_ms: float | None = None
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    wait_ms = left * 1000
                for fd, _ in self._poller.poll(wait_ms):
                    if self._closed:
                        return None
                    if fd == self._wake_r.fileno():
                        self._drain_wake()
                    else:
                        self._read_control(self._fd_peer[fd])

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        self._woken = True

    def _read_control(self, peer: int) -> None:
        sock, inbox = self._control[peer], self._inbox[peer]
        why = ""
        scratch = self._scratch
        try:
            while True:
                n = sock.recv_into(scratch)
                if n == 0:
                    why = "closed its control connection"
                    break
                inbox += scratch[:n]
                if n < len(scratch):
                    break
        except BlockingIOError:
            pass
        except OSError as exc:
            why = f"broke its control connection ({exc})"
        offset = 0
        while len(inbox) - offset >= _LEN.size:
            (length,) = _LEN.unpack_from(inbox, offset)
            if length > MAX_CONTROL_MESSAGE:
                self._lost[peer] = f"sent an invalid control frame of {length} bytes"
                self._poller.unregister(sock)
                raise TransportError(
                    f"{self.describe(peer)} sent a control frame of {length} bytes, over the "
                    f"limit of {MAX_CONTROL_MESSAGE}: protocol error (a different hora version?)"
                )
            end = offset + _LEN.size + length
            if len(inbox) < end:
                break
            self._pending.append((peer, bytes(inbox[offset + _LEN.size:end])))
            offset = end
        if offset:
            del inbox[:offset]
        if why:
            if inbox:
                why += f" in the middle of a message ({len(inbox)} bytes left over)"
            self._lost[peer] = why
            self._poller.unregister(sock)

    @override
    def wake(self) -> None:
        try:
            self._wake_w.send(b"\x01")
        except (BlockingIOError, OSError):
            pass  # a full pipe already holds a wake-up; a closed one means we are closed

    # ---- shutdown ----------------------------------------------------------------------------

    @override
    def shutdown_data(self) -> None:
        for sock in self._data.values():  # FIN, not RST: peers see EOF at once
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @override
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.wake()
        socks = [*self._data.values(), *self._control.values()]
        for sock in socks:  # wakes any thread of this process blocked on them
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._recv_lock:  # a concurrent recv_control has returned None by now
            for sock in socks:
                sock.close()
            self._wake_r.close()
            self._wake_w.close()

    def __del__(self) -> None:  # pragma: no cover - best effort if close() was forgotten
        if not getattr(self, "_closed", True):
            for sock in (*self._data.values(), *self._control.values()):
                sock.close()


# ---- rendezvous and mesh set-up --------------------------------------------------------------

def _gather_entries(store: KVStoreClient, scope: str, rank: int, size: int,
                    deadline: float) -> dict[int, dict[str, Any]]:
    keys = [str(r) for r in range(size)]
    try:
        raw = store.wait(scope, keys, max(0.0, deadline - time.monotonic()))
    except RendezvousTimeoutError:
        missing = [int(k) for k in store.missing(scope, keys)]
        raise RendezvousTimeoutError(
            f"rank {rank}: ranks {missing} of {size} never published their address in scope "
            f"{scope!r}: they never started or never reached hora.init() (or crashed before). "
            "HINT: check their output; raise HORA_START_TIMEOUT if start-up is slow."
        ) from None
    entries: dict[int, dict[str, Any]] = {}
    for r in range(size):
        try:
            entry = json.loads(raw[str(r)])
            entry["port"] = int(entry["port"])
            entry["host"], entry["hostname"] = str(entry["host"]), str(entry["hostname"])
        except (ValueError, KeyError, TypeError):
            raise RendezvousError(f"rank {r} published a malformed address in scope {scope!r}; "
                                  "are all ranks running the same hora version?") from None
        if int(entry.get("size", size)) != size:
            raise RendezvousError(f"rank {r} thinks the job has {entry['size']} ranks, rank "
                                  f"{rank} thinks {size}; did two jobs share a scope?")
        entries[r] = entry
    return entries


class _MeshSetup:
    """Accept and make every connection of one rank, in parallel, before a deadline."""

    def __init__(self, rank: int, size: int, entries: dict[int, dict[str, Any]], secret: bytes,
                 scope: str, deadline: float, listener: socket.socket,
                 wake_pair: tuple[socket.socket, socket.socket]) -> None:
        self.rank, self.size, self.entries = rank, size, entries
        self.secret, self.deadline, self.listener = secret, deadline, listener
        self.context = b"hora-tcp\0" + scope.encode()
        self.wake_r, self.wake_w = wake_pair
        self.incoming = {(p, DATA) for p in range(rank + 1, size)}
        if rank == 0:
            self.incoming |= {(p, CONTROL) for p in range(1, size)}
        self.outgoing = [(p, DATA) for p in range(rank)] + ([(0, CONTROL)] if rank else [])
        self.lock = threading.Lock()
        self.done = False
        self.conns: dict[tuple[int, int], socket.socket] = {}
        self.errors: queue.Queue[BaseException] = queue.Queue()

    def describe(self, peer: int) -> str:
        return f"rank {peer} (host {self.entries[peer]['hostname']})"

    def offer(self, key: tuple[int, int], sock: socket.socket) -> bool:
        with self.lock:
            if self.done or key in self.conns:
                sock.close()
                return False
            self.conns[key] = sock
        self._poke()
        return True

    def _poke(self) -> None:
        try:
            self.wake_w.send(b"\x00")
        except OSError:
            pass

    def run(self) -> tuple[dict[int, socket.socket], dict[int, socket.socket]]:
        threads = [threading.Thread(target=self._connect, args=(peer, ch), daemon=True,
                                    name=f"hora-tcp-connect-{peer}") for peer, ch in self.outgoing]
        for thread in threads:
            thread.start()
        wanted = self.incoming | set(self.outgoing)
        poller = select.poll()
        poller.register(self.listener, _POLLIN)
        poller.register(self.wake_r, _POLLIN)
        try:
            while True:
                with self.lock:
                    if wanted <= self.conns.keys():
                        break
                if not self.errors.empty():
                    raise self.errors.get()
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise self._timeout(wanted)
                for fd, _ in poller.poll(left * 1000):
                    if fd == self.wake_r.fileno():
                        self.wake_r.recv(4096)
                    else:
                        self._accept()
        except BaseException:
            with self.lock:
                self.done = True
                for sock in self.conns.values():
                    sock.close()
            raise
        with self.lock:
            self.done = True
        for thread in threads:
            thread.join(timeout=1.0)
        try:  # leave the pair empty for the transport's wake()
            while self.wake_r.recv(4096, socket.MSG_DONTWAIT):
                pass
        except (BlockingIOError, OSError):
            pass
        data = {p: s for (p, ch), s in self.conns.items() if ch == DATA}
        control = {p: s for (p, ch), s in self.conns.items() if ch == CONTROL}
        return data, control

    def _timeout(self, wanted: set[tuple[int, int]]) -> BaseException:
        with self.lock:
            missing = sorted(wanted - self.conns.keys())
        inbound = sorted({p for p, ch in missing if (p, ch) in self.incoming})
        outbound = sorted({p for p, ch in missing if (p, ch) not in self.incoming})
        parts = []
        if inbound:
            parts.append(f"ranks {inbound} never connected to it")
        if outbound:
            parts.append(f"it could not finish connecting to ranks {outbound}")
        return HoraTimeoutError(
            f"rank {self.rank}: TCP mesh set-up did not finish in time: {'; '.join(parts)}. They "
            "may have crashed, be unable to reach this host (firewall, wrong interface: set "
            "HORA_GLOO_IFACE), or be slow; see their output. " + _TIMEOUT_HINT
        )

    def _accept(self) -> None:
        try:
            sock, addr = self.listener.accept()
        except OSError:
            return
        threading.Thread(target=self._handshake_in, args=(sock, addr), daemon=True,
                         name="hora-tcp-accept").start()

    def _handshake_in(self, sock: socket.socket, addr: Any) -> None:
        where = f"{addr[0]}:{addr[1]}"
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            auth.server_handshake(sock, self.secret, self.deadline, self.context)
            magic, peer, size, channel = _HELLO.unpack(
                recv_bytes(sock, _HELLO.size, self.deadline))
            key = (peer, channel)
            problem = ""
            if magic != _HELLO_MAGIC:
                problem = "bad hello"
            elif size != self.size:
                problem = f"it is in a {size}-rank job, this rank in a {self.size}-rank job"
            elif key not in self.incoming:
                problem = f"unexpected {_CHANNEL_NAMES.get(channel, channel)} connection"
            elif key in self.conns:
                problem = "duplicate connection"
            if problem:
                send_all(sock, _REJECT, self.deadline)
                raise TransportError(f"rank {peer} from {where}: {problem}")
            send_all(sock, _ACCEPT, self.deadline)
        except (AuthenticationError, TransportError) as exc:
            log.warning("rank %d refused a connection during TCP set-up: %s", self.rank, exc)
            sock.close()
            return
        except (OSError, EOFError) as exc:
            log.warning("rank %d dropped a connection from %s during TCP set-up: %s",
                        self.rank, where, exc)
            sock.close()
            return
        self.offer(key, sock)

    def _connect(self, peer: int, channel: int) -> None:
        entry = self.entries[peer]
        address = (str(entry["host"]), int(entry["port"]))
        delay, last = 0.01, None
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.errors.put(TransportError(
                    f"rank {self.rank} could not connect to {self.describe(peer)} at "
                    f"{address[0]}:{address[1]}: {last}. HINT: the peer may have exited, or its "
                    "address is not reachable from this host (set HORA_GLOO_IFACE)."))
                self._poke()
                return
            with self.lock:
                if self.done:
                    return
            try:
                sock = socket.create_connection(address, timeout=left)
                break
            except OSError as exc:
                last = exc
                time.sleep(min(delay, max(0.0, self.deadline - time.monotonic())))
                delay = min(2 * delay, 0.25)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            auth.client_handshake(sock, self.secret, self.deadline, self.context)
            send_all(sock, _HELLO.pack(_HELLO_MAGIC, self.rank, self.size, channel),
                     self.deadline)
            verdict = recv_bytes(sock, 1, self.deadline)
            if verdict != _ACCEPT:
                raise TransportError(
                    f"{self.describe(peer)} refused this rank's {_CHANNEL_NAMES[channel]} "
                    "connection (duplicate rank? two jobs sharing a scope?)")
        except AuthenticationError as exc:
            sock.close()
            self.errors.put(AuthenticationError(
                f"rank {self.rank} could not authenticate with {self.describe(peer)}: {exc}"))
            self._poke()
            return
        except TimeoutError:
            sock.close()
            self.errors.put(HoraTimeoutError(
                f"rank {self.rank}: {self.describe(peer)} accepted the connection but did not "
                f"complete the handshake in time; it may be stuck. {_TIMEOUT_HINT}"))
            self._poke()
            return
        except (TransportError, OSError, EOFError) as exc:
            sock.close()
            self.errors.put(exc if isinstance(exc, TransportError) else TransportError(
                f"rank {self.rank} lost its new connection to {self.describe(peer)} during "
                f"set-up ({exc}): {_LOST_HINT}"))
            self._poke()
            return
        self.offer((peer, channel), sock)


__all__ = ["SEND_CHUNK", "TcpTransport"]
