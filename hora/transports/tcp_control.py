"""The TCP transport's control plane: framed messages between rank 0 and every other rank.

:class:`ControlPlane` owns the control connections :func:`hora.transports.tcp_mesh.connect_mesh`
built (rank 0 to every other rank; every other rank to rank 0) and the wake-up socket pair.
Messages are length-prefixed (at most :data:`~hora.transports.base.MAX_CONTROL_MESSAGE` bytes);
the receiver polls every control connection and the wake-up pipe at once, so the engine's thread
sleeps in :meth:`ControlPlane.recv` until a message, a timeout or a :meth:`ControlPlane.wake`.

It may be used from several threads: :meth:`~ControlPlane.send` locks per peer,
:meth:`~ControlPlane.recv` is serialized, and :meth:`~ControlPlane.wake` is lock-free. Waiting to
send and the wording of a connection lost while sending are the owning transport's
(:class:`~hora.transports.tcp.TcpTransport`), passed to each :meth:`~ControlPlane.send`; the
plane keeps no reference to its transport.
"""

from __future__ import annotations

import collections
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from hora.errors import HoraInternalError, PeerLostError, TransportError
from hora.transports.base import MAX_CONTROL_MESSAGE
from hora.transports.tcp_mesh import LOST_HINT

_LEN = struct.Struct("!I")
_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT

WaitReady = Callable[[socket.socket, int, int, str, int, int], None]
"""``wait(sock, events, peer, doing, done, total)``: block until ``sock`` is ready for ``events``
or raise the transport's timeout (or closed) error."""

LostError = Callable[[int, BaseException | None, str], HoraInternalError]
"""``lost_error(peer, exc, doing)``: the transport's error for a connection lost mid-transfer."""


def describe_peer(hostnames: list[str], peer: int) -> str:
    """``'rank 3 (host a)'``: a peer's identity in the TCP transport's messages."""
    host = hostnames[peer] if 0 <= peer < len(hostnames) else "?"
    return f"rank {peer} (host {host})"


class _Poller:
    """``select.poll``'s interface over ``epoll`` where there is one: rank 0 holds a control
    connection per rank, and ``poll`` costs O(connections) per call in the kernel, ``epoll``
    O(ready ones) (measured with 1024 ranks: most of rank 0's time per cached cycle was
    ``poll`` over 1023 idle connections, ``benchmarks/control_plane_sim.py``)."""

    def __init__(self) -> None:
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._poll = select.poll() if self._epoll is None else None

    def register(self, sock: socket.socket, events: int) -> None:
        if self._epoll is not None:
            self._epoll.register(sock.fileno(), select.EPOLLIN)
        else:
            assert self._poll is not None
            self._poll.register(sock, events)

    def unregister(self, sock: socket.socket) -> None:
        try:
            if self._epoll is not None:
                self._epoll.unregister(sock.fileno())
            else:
                assert self._poll is not None
                self._poll.unregister(sock)
        except (KeyError, OSError, ValueError):
            pass

    def poll(self, wait_ms: float | None) -> list[tuple[int, int]]:
        if self._epoll is not None:
            return self._epoll.poll(-1 if wait_ms is None else wait_ms / 1000)
        assert self._poll is not None
        return self._poll.poll(wait_ms)

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()


class ControlPlane:
    """Framed control messages over the control connections of one rank, and its wake-up pipe.

    Args:
        rank: this process's global rank.
        control: control connection per peer (made non-blocking here).
        wake_pair: the socket pair whose write end :meth:`wake` writes to (default: a new one).
        hostnames: host identity of every rank, in rank order (for messages).
    """

    def __init__(self, rank: int, control: dict[int, socket.socket],
                 wake_pair: tuple[socket.socket, socket.socket] | None,
                 hostnames: list[str]) -> None:
        self._rank = rank
        self._control = control
        self._hostnames = hostnames
        self._closed = False
        for sock in control.values():
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
        self._scratch = memoryview(bytearray(256 * 1024))  # receive buffer
        self._fd_peer = {sock.fileno(): peer for peer, sock in control.items()}
        self.attached: set[int] = set()  # peers whose connection came through attach()
        self._poller = _Poller()
        self._poller.register(self._wake_r, _POLLIN)
        for sock in control.values():
            self._poller.register(sock, _POLLIN)

    def peers(self) -> list[int]:
        """The ranks this rank has control connections to."""
        return list(self._control)

    def attach(self, peer: int, sock: socket.socket) -> None:
        """Add a control connection to ``peer`` made elsewhere (the response cache's links
        between the ranks of one host, :mod:`hora.core.engine.cross_host`): framed, polled and
        reported lost like the others. The engine thread only, before it uses the link.

        Raises:
            ValueError: this rank already has a control connection to ``peer``.
        """
        if peer in self._control or peer == self._rank:
            raise ValueError(f"rank {self._rank} already has a control connection to {peer}")
        self.attached.add(peer)
        sock.setblocking(False)
        self._send_locks[peer] = threading.Lock()
        self._inbox[peer] = bytearray()
        self._fd_peer[sock.fileno()] = peer
        self._control[peer] = sock
        self._poller.register(sock, _POLLIN)

    def _check_peer(self, peer: int) -> socket.socket:
        if self._closed:
            raise TransportError("the TCP transport is closed (hora was shut down)")
        sock = self._control.get(peer)
        if sock is None:
            raise ValueError(f"control messages go between rank 0 and the others only; rank "
                             f"{self._rank} has no control connection to {peer!r}")
        return sock

    def _describe(self, peer: int) -> str:
        return describe_peer(self._hostnames, peer)

    def send(self, peer: int, payload: bytes, wait: WaitReady, lost_error: LostError) -> None:
        """Send one framed control message to ``peer`` (rank 0 <-> others only).

        ``wait`` blocks until the connection is writable (raising the transport's timeout);
        ``lost_error`` words a connection lost while sending.

        Raises:
            TransportError: the payload exceeds MAX_CONTROL_MESSAGE.
            PeerLostError: the connection is closed.
            HoraTimeoutError: the peer accepted no bytes for the transport's timeout.
        """
        sock = self._check_peer(peer)
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
                        wait(sock, _POLLOUT, peer, "sending a control message", sent, len(view))
                    except OSError as exc:
                        raise lost_error(peer, exc, "sending a control message") from exc

    def recv(self, timeout: float | None) -> tuple[int, bytes] | None:
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
                        raise PeerLostError(f"{self._describe(peer)} {why} to rank "
                                            f"{self._rank}: {LOST_HINT}", peer=peer)
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
                        self._read(self._fd_peer[fd])

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        self._woken = True

    def _read(self, peer: int) -> None:
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
                    f"{self._describe(peer)} sent a control frame of {length} bytes, over the "
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

    def wake(self) -> None:
        """Make a concurrent (or the next) :meth:`recv` return None promptly; any thread."""
        try:
            self._wake_w.send(b"\x01")
        except (BlockingIOError, OSError):
            pass  # a full pipe already holds a wake-up; a closed one means we are closed

    def close(self) -> None:
        """Wake a waiting :meth:`recv`, then close the control connections and the wake pipe."""
        self._closed = True
        self.wake()
        socks = list(self._control.values())
        for sock in socks:  # wakes any thread of this process blocked on them
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._recv_lock:  # a concurrent recv has returned None by now
            for sock in socks:
                sock.close()
            self._poller.close()
            self._wake_r.close()
            self._wake_w.close()


__all__ = ["ControlPlane", "LostError", "WaitReady", "describe_peer"]
