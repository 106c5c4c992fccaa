"""The rendezvous key-value store: where ranks publish their addresses and find each other's.

The launcher (``hora run``) — or rank 0 when a foreign launcher (mpirun, Slurm, torchrun) started
the job — runs a :class:`KVStoreServer`; every rank connects a :class:`KVStoreClient`. Keys live in
scopes (``"global"``, ``"tcp.0"``, ...). A ``get`` blocks *server-side* until the key exists or its
timeout passes, so waiting costs no polling traffic; ``add`` is an atomic counter for barriers and
generations.

Every connection is authenticated with the job secret (:mod:`hora._util.auth`) before its first
request. The wire format is binary and length-prefixed::

    frame    = length:u32 | payload            (length <= MAX_FRAME, checked before allocating)
    request  = op:u8 | scope_len:u16 | scope | key_len:u16 | key | operand
               operand: SET -> value bytes; GET -> timeout:f64; DELETE -> none; ADD -> delta:i64
    response = status:u8 | body     (OK: value / i64 / existed:u8; MISSING; ERROR: utf-8 message)

A client that fails authentication or breaks the protocol is logged at warning level and dropped;
other clients are not disturbed.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from hora._util import auth
from hora._util.log import get_logger
from hora.errors import (
    AuthenticationError,
    FrameError,
    RendezvousError,
    RendezvousTimeoutError,
)
from hora.rendezvous.store_wire import (
    _I64,
    ERROR,
    MAX_FRAME,
    MISSING,
    OK,
    OP_ADD,
    OP_DELETE,
    OP_GET,
    OP_SET,
    StoreRequest,
    _recv_frame,
    _send_frame,
    decode_request,
    encode_request,
)

if TYPE_CHECKING:
    from typing_extensions import Self

log = get_logger(__name__)

MAX_WAIT_SECONDS = 24 * 3600.0
"""Longest server-side wait of one ``get``."""

AUTH_CONTEXT = b"hora-kvstore"

_TIMEOUT_HINT = ("HINT: the rank that publishes it may not have started, may have crashed, or may "
                 "be slow to start; raise HORA_START_TIMEOUT (hora run --start-timeout) if start-up"
                 " is slow.")


class KVStoreServer:
    """A threaded, authenticated key-value store server.

    Args:
        secret: the job secret clients must prove they know.
        host: address to bind (an interface address; ``"0.0.0.0"`` only when asked).
        port: port to bind; 0 picks a free one (read it from :attr:`port` after :meth:`start`).
        auth_timeout: seconds a new connection has to complete authentication.
        io_timeout: seconds a client has to finish sending a frame it started.
    """

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: int = 0, *,
                 auth_timeout: float = 10.0, io_timeout: float = 30.0) -> None:
        self._secret = secret
        self._host = host
        self._port = port
        self._auth_timeout = auth_timeout
        self._io_timeout = io_timeout
        self._data: dict[str, dict[str, bytes]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._accept_thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._conn_lock = threading.Lock()

    @property
    def host(self) -> str:
        """The bound address."""
        return self._host

    @property
    def port(self) -> int:
        """The bound port (the real one once started)."""
        return self._port

    def start(self) -> KVStoreServer:
        """Bind, listen and start serving in background threads. Returns ``self``.

        Raises:
            RendezvousError: the address cannot be bound (in use, not local), naming it.
        """
        try:
            listener = socket.create_server((self._host, self._port), backlog=128,
                                            family=_family(self._host))
        except OSError as exc:
            raise RendezvousError(
                f"cannot start the rendezvous store on {self._host}:{self._port}: {exc}. HINT: "
                "choose another port with HORA_RENDEZVOUS_PORT, or an address of this host with "
                "HORA_RENDEZVOUS_ADDR."
            ) from exc
        self._listener = listener
        self._port = listener.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"hora-kvstore-accept-{self._port}")
        self._accept_thread.start()
        log.debug("rendezvous store serving on %s:%d", self._host, self._port)
        return self

    def __enter__(self) -> Self:
        if self._listener is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving: wake every waiting request, close every connection, join the threads.

        Idempotent; returns within about a second even with clients blocked in ``get``.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=2.0)
        with self._conn_lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            _shutdown(conn)
        for thread in threads:
            thread.join(timeout=2.0)
        for sock in (self._listener, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()

    # ---- serving -------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._closed:
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r or self._closed:
                        return
                    try:
                        conn, addr = self._listener.accept()
                    except OSError:
                        continue
                    thread = threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                                              name=f"hora-kvstore-conn-{addr[1]}")
                    with self._conn_lock:
                        self._conns.add(conn)
                        self._threads.add(thread)
                    thread.start()
        finally:
            sel.close()

    def _serve(self, conn: socket.socket, addr: tuple[str, int]) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            auth.server_handshake(conn, self._secret, time.monotonic() + self._auth_timeout,
                                  AUTH_CONTEXT)
            while not self._closed:
                payload = _recv_frame(conn, None, self._io_timeout)
                if payload is None:
                    break
                response = self._handle(decode_request(payload))
                _send_frame(conn, response, time.monotonic() + self._io_timeout)
        except AuthenticationError as exc:
            if not self._closed:
                log.warning("rendezvous store refused a connection: %s", exc)
        except FrameError as exc:
            log.warning("rendezvous store dropped client %s: protocol error: %s", peer, exc)
        except (OSError, EOFError) as exc:
            if not self._closed:
                log.debug("rendezvous store client %s disconnected: %s", peer, exc)
        except Exception:  # a bug here must not kill the server silently
            log.exception("rendezvous store: internal error serving %s; dropped it", peer)
        finally:
            conn.close()
            with self._conn_lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())

    def _handle(self, req: StoreRequest) -> bytes:
        with self._cond:
            scope = self._data.get(req.scope)
            if req.op == OP_SET:
                self._data.setdefault(req.scope, {})[req.key] = req.value
                self._cond.notify_all()
                return bytes([OK])
            if req.op == OP_GET:
                end = time.monotonic() + min(req.timeout, MAX_WAIT_SECONDS)
                while True:
                    scope = self._data.get(req.scope)
                    if scope is not None and req.key in scope:
                        return bytes([OK]) + scope[req.key]
                    if self._closed:
                        return bytes([ERROR]) + b"the store is shutting down (the launcher or " \
                            b"rank 0 that serves it is exiting)"
                    left = end - time.monotonic()
                    if left <= 0:
                        return bytes([MISSING])
                    self._cond.wait(left)
            if req.op == OP_DELETE:
                existed = scope is not None and scope.pop(req.key, None) is not None
                if scope is not None and not scope:
                    del self._data[req.scope]
                return bytes([OK, int(existed)])
            # OP_ADD
            old = b"0" if scope is None else scope.get(req.key, b"0")
            try:
                value = int(old) + req.delta
            except ValueError:
                return bytes([ERROR]) + (f"key {req.key!r} in scope {req.scope!r} holds a "
                                         "non-integer value; add() needs a counter").encode()
            if not -(2**63) <= value < 2**63:
                return bytes([ERROR]) + f"counter {req.key!r} would overflow 64 bits".encode()
            self._data.setdefault(req.scope, {})[req.key] = str(value).encode()
            self._cond.notify_all()
            return bytes([OK]) + _I64.pack(value)


class KVStoreClient:
    """A connection to a :class:`KVStoreServer`. Thread-safe: one request at a time (a lock).

    The connection is made in the constructor, retrying until ``timeout`` passes (the server may
    not be up yet). A connection broken mid-request is re-made on the next call.

    Args:
        host: the server's address.
        port: the server's port.
        secret: the job secret.
        timeout: seconds allowed to connect, and the default wait of :meth:`get` / :meth:`wait`.

    Raises:
        RendezvousError: the server could not be reached or authenticated with before the
            deadline (names ``host:port``).
    """

    def __init__(self, host: str, port: int, secret: bytes, timeout: float = 30.0) -> None:
        self._host = host
        self._port = port
        self._secret = secret
        self._timeout = timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        with self._lock:
            self._connect(time.monotonic() + timeout)

    @property
    def address(self) -> str:
        """``host:port`` of the server."""
        return f"{self._host}:{self._port}"

    @property
    def timeout(self) -> float:
        """The default timeout in seconds."""
        return self._timeout

    def _connect(self, deadline: float) -> socket.socket:
        delay = 0.02
        last: BaseException | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                sock = socket.create_connection((self._host, self._port), timeout=left)
            except OSError as exc:
                last = exc
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.5)
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                auth.client_handshake(sock, self._secret, deadline, AUTH_CONTEXT)
            except AuthenticationError as exc:
                sock.close()
                raise RendezvousError(
                    f"could not authenticate with the rendezvous store at {self.address}: {exc}"
                ) from exc
            except BaseException:
                sock.close()
                raise
            self._sock = sock
            return sock
        raise RendezvousError(
            f"could not connect to the rendezvous store at {self.address} within "
            f"{self._timeout:.1f} s (last error: {last}). HINT: check that the launcher (or "
            "rank 0) is running and that HORA_RENDEZVOUS_ADDR/HORA_RENDEZVOUS_PORT point at it "
            "and are reachable from this host; raise HORA_START_TIMEOUT if start-up is slow."
        )

    def _call(self, req: StoreRequest, wait: float = 0.0) -> tuple[int, bytes]:
        payload = encode_request(req)
        with self._lock:
            deadline = time.monotonic() + wait + self._timeout
            sock = self._sock or self._connect(deadline)
            try:
                _send_frame(sock, payload, deadline)
                response = _recv_frame(sock, deadline, self._timeout)
                if not response:
                    raise EOFError("the store closed the connection")
            except (OSError, EOFError, FrameError) as exc:
                sock.close()
                self._sock = None
                raise RendezvousError(
                    f"lost the connection to the rendezvous store at {self.address} ({exc}). "
                    "HINT: the launcher (or rank 0, which serves the store without a launcher) "
                    "probably exited; see its output."
                ) from exc
        status, body = response[0], response[1:]
        if status == ERROR:
            raise RendezvousError(f"rendezvous store at {self.address}: {body.decode()}")
        return status, body

    def set(self, scope: str, key: str, value: bytes) -> None:
        """Store ``value`` under ``scope``/``key`` (overwrites), waking any waiting ``get``.

        Raises:
            RendezvousError: the store is unreachable.
        """
        self._call(StoreRequest(OP_SET, scope, key, value=bytes(value)))

    def get(self, scope: str, key: str, timeout: float | None = None) -> bytes:
        """The value of ``scope``/``key``, waiting up to ``timeout`` s for it to appear.

        Args:
            timeout: seconds to wait (None: the client's default; 0: do not wait).

        Raises:
            RendezvousTimeoutError: the key did not appear in time (names scope, key, the knob).
            RendezvousError: the store is unreachable.
        """
        wait = self._timeout if timeout is None else max(0.0, timeout)
        status, body = self._call(StoreRequest(OP_GET, scope, key, timeout=wait), wait)
        if status != OK:
            raise RendezvousTimeoutError(
                f"key {key!r} in scope {scope!r} did not appear in the rendezvous store at "
                f"{self.address} within {wait:.1f} s. {_TIMEOUT_HINT}"
            )
        return body

    def wait(self, scope: str, keys: Iterable[str], timeout: float | None = None
             ) -> dict[str, bytes]:
        """Wait until every key of ``keys`` exists in ``scope``; returns their values.

        Raises:
            RendezvousTimeoutError: some keys did not appear in time; the message lists them.
            RendezvousError: the store is unreachable.
        """
        wanted = list(keys)
        wait = self._timeout if timeout is None else max(0.0, timeout)
        deadline = time.monotonic() + wait
        values: dict[str, bytes] = {}
        for key in wanted:
            try:
                values[key] = self.get(scope, key, max(0.0, deadline - time.monotonic()))
            except RendezvousTimeoutError:
                missing = self.missing(scope, wanted)
                shown = ", ".join(missing[:32]) + (" ..." if len(missing) > 32 else "")
                raise RendezvousTimeoutError(
                    f"{len(missing)} of {len(wanted)} keys in scope {scope!r} did not appear in "
                    f"the rendezvous store at {self.address} within {wait:.1f} s; missing: "
                    f"{shown}. {_TIMEOUT_HINT}"
                ) from None
        return values

    def missing(self, scope: str, keys: Iterable[str]) -> list[str]:
        """Those of ``keys`` that do not exist in ``scope`` right now (no waiting).

        Raises:
            RendezvousError: the store is unreachable.
        """
        return [k for k in keys if self._call(StoreRequest(OP_GET, scope, k, timeout=0.0))[0] != OK]

    def delete(self, scope: str, key: str) -> bool:
        """Remove ``scope``/``key``; returns whether it existed.

        Raises:
            RendezvousError: the store is unreachable.
        """
        _, body = self._call(StoreRequest(OP_DELETE, scope, key))
        return body == b"\x01"

    def add(self, scope: str, key: str, delta: int = 1) -> int:
        """Atomically add ``delta`` to the integer counter at ``scope``/``key`` (absent = 0).

        Returns:
            The new value. ``get`` on the key returns it as ASCII decimal.

        Raises:
            RendezvousError: the store is unreachable or the key holds a non-integer value.
        """
        _, body = self._call(StoreRequest(OP_ADD, scope, key, delta=delta))
        value: int = _I64.unpack(body)[0]
        return value

    def close(self) -> None:
        """Close the connection. Idempotent."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


__all__ = ["ERROR", "MAX_FRAME", "MISSING", "OK", "OP_ADD", "OP_DELETE", "OP_GET", "OP_SET",
           "FrameError", "KVStoreClient", "KVStoreServer", "StoreRequest", "decode_request",
           "encode_request"]
