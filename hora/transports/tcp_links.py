"""Data connections opened on first use: :class:`LazyLinks`.

:func:`hora.transports.tcp_mesh.connect_mesh` makes only the connections every collective needs
at start (control to rank 0; data to the ring neighbours and host leaders,
:func:`~hora.transports.tcp_mesh.eager_peers`); :class:`~hora.transports.tcp.TcpTransport` asks
this class for any other data connection the first time it sends to or receives from that peer.
The same authentication and hello as at set-up; the listener stays open for it.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from typing import Any

from hora._util import auth
from hora._util.log import get_logger
from hora._util.net import recv_bytes, send_all
from hora.errors import AuthenticationError, HoraTimeoutError, PeerLostError, TransportError

log = get_logger(__name__)

# The wire of a rank-to-rank connection after authentication (shared with tcp_mesh's set-up).
DATA, CONTROL = 0, 1
_CHANNEL_NAMES = {DATA: "data", CONTROL: "control"}
_HELLO = struct.Struct("!8sIIB")  # magic, rank, size, channel
_HELLO_MAGIC = b"HORATCP1"
_ACCEPT, _REJECT = b"\x01", b"\x00"
_POLLIN = select.POLLIN
# Hints ending the TCP transport's timeout and lost-peer messages, in set-up and in use alike.
TIMEOUT_HINT = "HINT: raise HORA_TIMEOUT_SECONDS (hora run --timeout-seconds) if this is expected."
LOST_HINT = "it probably exited or crashed; see its output"


class LazyLinks:
    """The data connections a rank opens on first use, after set-up.

    Of a pair of ranks, the higher one connects and the lower one's listener accepts (a
    thread of its own, ``hora-tcp-listen``, for the life of the transport), so both ends
    asking for the connection at about the same time (as every point-to-point transfer of a
    collective does) get the same one, and neither waits for the other to be idle: the
    accepting side takes connections whatever its engine thread is doing.
    """

    def __init__(self, rank: int, size: int, entries: dict[int, dict[str, Any]], secret: bytes,
                 scope: str, listener: socket.socket, known: dict[int, socket.socket]) -> None:
        self._rank, self._size, self._entries = rank, size, entries
        self._secret = secret
        self._context = b"hora-tcp\0" + scope.encode()
        self._listener = listener
        self._cond = threading.Condition()
        self._accepted: dict[int, socket.socket] = {}
        self._taken: set[int] = set(known)  # peers whose connection the transport holds
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._listen, daemon=True,
                                        name=f"hora-tcp-listen-{rank}")
        self._thread.start()

    def describe(self, peer: int) -> str:
        host = self._entries[peer]["hostname"] if peer in self._entries else "?"
        return f"rank {peer} (host {host})"

    def open(self, peer: int, timeout: float) -> socket.socket:
        """The data connection to ``peer``, made now: connected (``peer`` lower than this rank)
        or accepted (higher), within ``timeout`` seconds. Blocking, ``TCP_NODELAY``.

        Raises:
            HoraTimeoutError: the peer did not connect, or accept, in time.
            TransportError: refused, unreachable, or this transport closed;
                AuthenticationError when the peer rejected our credentials.
        """
        deadline = time.monotonic() + timeout
        if peer < self._rank:
            sock = self._connect(peer, deadline)
        else:
            with self._cond:
                while peer not in self._accepted:
                    left = deadline - time.monotonic()
                    if self._closed:
                        raise TransportError("the TCP transport is closed (hora was shut down)")
                    if left <= 0:
                        raise HoraTimeoutError(
                            f"rank {self._rank} waited {timeout:g} s for {self.describe(peer)} "
                            "to open its data connection (opened on first use); it may be "
                            "stuck in another collective, have crashed, or be unable to reach "
                            f"this host. {TIMEOUT_HINT}")
                    self._cond.wait(min(left, 1.0))
                sock = self._accepted.pop(peer)
        with self._cond:
            self._taken.add(peer)
        return sock

    def adopt(self, peer: int, sock: socket.socket) -> None:
        """A connection from higher rank ``peer`` that set-up accepted after it finished."""
        with self._cond:
            if self._closed or peer in self._accepted or peer in self._taken:
                sock.close()
                return
            self._accepted[peer] = sock
            self._cond.notify_all()

    def _connect(self, peer: int, deadline: float) -> socket.socket:
        entry = self._entries[peer]
        address = (str(entry["host"]), int(entry["port"]))
        delay, last = 0.01, None
        while True:
            left = deadline - time.monotonic()
            if self._closed:
                raise TransportError("the TCP transport is closed (hora was shut down)")
            if left <= 0:
                raise TransportError(
                    f"rank {self._rank} could not connect to {self.describe(peer)} at "
                    f"{address[0]}:{address[1]}: {last}. HINT: the peer may have exited, or its "
                    "address is not reachable from this host (set HORA_GLOO_IFACE).")
            try:
                sock = socket.create_connection(address, timeout=left)
                break
            except ConnectionRefusedError:
                # Its listener was open before it published its address and stays open while
                # its transport lives: a refusal means the peer's transport is gone.
                raise PeerLostError(
                    f"{self.describe(peer)} refused the data connection rank {self._rank} "
                    f"opened on first use (nothing listens at {address[0]}:{address[1]} any "
                    f"more): {LOST_HINT}", peer=peer) from None
            except OSError as exc:
                last = exc
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(2 * delay, 0.25)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            auth.client_handshake(sock, self._secret, deadline, self._context)
            send_all(sock, _HELLO.pack(_HELLO_MAGIC, self._rank, self._size, DATA), deadline)
            if recv_bytes(sock, 1, deadline) != _ACCEPT:
                raise TransportError(f"{self.describe(peer)} refused this rank's data "
                                     "connection (it holds one already, or is another job)")
        except AuthenticationError as exc:
            sock.close()
            raise AuthenticationError(f"rank {self._rank} could not authenticate with "
                                      f"{self.describe(peer)}: {exc}") from None
        except TimeoutError:
            sock.close()
            raise HoraTimeoutError(
                f"rank {self._rank}: {self.describe(peer)} accepted the data connection but did "
                f"not complete the handshake in time; it may be stuck. {TIMEOUT_HINT}") from None
        except (OSError, EOFError) as exc:
            sock.close()
            raise TransportError(f"rank {self._rank} lost its new data connection to "
                                 f"{self.describe(peer)} ({exc}): {LOST_HINT}") from None
        except BaseException:
            sock.close()
            raise
        return sock

    def _listen(self) -> None:
        poller = select.poll()
        poller.register(self._listener, _POLLIN)
        poller.register(self._wake_r, _POLLIN)
        while not self._closed:
            try:
                events = poller.poll()
            except OSError:
                return
            for fd, _ in events:
                if fd == self._wake_r.fileno() or self._closed:
                    return
                try:
                    sock, addr = self._listener.accept()
                except OSError:
                    continue
                threading.Thread(target=self._handshake_in, args=(sock, addr), daemon=True,
                                 name="hora-tcp-accept").start()

    def _handshake_in(self, sock: socket.socket, addr: Any) -> None:
        deadline = time.monotonic() + 30.0
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            auth.server_handshake(sock, self._secret, deadline, self._context)
            magic, peer, size, channel = _HELLO.unpack(recv_bytes(sock, _HELLO.size, deadline))
            with self._cond:
                ok = (magic == _HELLO_MAGIC and size == self._size and channel == DATA
                      and self._rank < peer < size and peer not in self._accepted
                      and peer not in self._taken and not self._closed)
            if not ok:
                send_all(sock, _REJECT, deadline)
                raise TransportError(f"rank {peer} from {addr[0]}:{addr[1]}: unexpected data "
                                     "connection")
            send_all(sock, _ACCEPT, deadline)
        except (AuthenticationError, TransportError, OSError, EOFError) as exc:
            log.warning("rank %d refused a data connection: %s", self._rank, exc)
            sock.close()
            return
        with self._cond:
            if self._closed:
                sock.close()
                return
            self._accepted[peer] = sock
            self._cond.notify_all()

    def close(self) -> None:
        """Stop accepting; close the listener and connections nobody took. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            left = list(self._accepted.values())
            self._accepted.clear()
            self._cond.notify_all()
        try:
            self._wake_w.send(b"\x00")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        for sock in (*left, self._listener, self._wake_r, self._wake_w):
            sock.close()


__all__ = ["CONTROL", "DATA", "LOST_HINT", "TIMEOUT_HINT", "LazyLinks"]
