"""The rendezvous key-value store (its server): where ranks publish addresses and find others'.

The launcher (``hora run``) — or rank 0 when a foreign launcher (mpirun, Slurm, torchrun) started
the job — runs a :class:`KVStoreServer`; every rank connects a
:class:`~hora.rendezvous.store_client.KVStoreClient`. Keys live in scopes (``"global"``,
``"tcp.0"``, ...). A ``get`` blocks *server-side* until the key exists or its timeout passes, so
waiting costs no polling traffic; ``add`` is an atomic counter for barriers and generations.

Every connection is authenticated with the job secret (:mod:`hora._util.auth`) before its first
request. The wire format is binary and length-prefixed::

    frame    = length:u32 | payload            (length <= MAX_FRAME, checked before allocating)
    request  = op:u8 | scope_len:u16 | scope | key_len:u16 | key | operand
               operand: SET -> value bytes; GET -> timeout:f64; DELETE -> none; ADD -> delta:i64;
               MGET -> keys joined by NUL (key empty)
    response = status:u8 | body     (OK: value / i64 / existed:u8 / MGET: per key
               length:u32 | value, 0xFFFFFFFF for an absent key; MISSING; ERROR: utf-8 message)

A client that fails authentication or breaks the protocol is logged at warning level and dropped;
other clients are not disturbed.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from typing import TYPE_CHECKING

from hora._util import auth
from hora._util.log import get_logger
from hora.errors import AuthenticationError, FrameError, RendezvousError
from hora.rendezvous.store_wire import (
    _I64,
    AUTH_CONTEXT,
    ERROR,
    MISSING,
    OK,
    OP_DELETE,
    OP_GET,
    OP_MGET,
    OP_SET,
    StoreRequest,
    _recv_frame,
    _send_frame,
    decode_request,
    encode_values,
)

if TYPE_CHECKING:
    from typing_extensions import Self

log = get_logger(__name__)

MAX_WAIT_SECONDS = 24 * 3600.0
"""Longest server-side wait of one ``get``."""

_BACKLOG = 4096
"""Listen backlog (the kernel caps it at ``net.core.somaxconn``): every rank of a job connects
at once; a full accept queue silently drops a client's final ACK, and that client then waits
for a challenge the server never saw (a thousand ranks against a backlog of 128 did)."""


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
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        # Waiters per (scope, key), sharing the one lock: a set or add wakes only the gets of
        # that key (with a thousand ranks blocked in a get, waking all of them on every set
        # is a million wake-ups per rendezvous).
        self._key_conds: dict[tuple[str, str], tuple[threading.Condition, list[int]]] = {}
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
            listener = socket.create_server((self._host, self._port), backlog=_BACKLOG,
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
            for cond, _ in self._key_conds.values():
                cond.notify_all()
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
                self._notify(req.scope, req.key)
                return bytes([OK])
            if req.op == OP_GET:
                end = time.monotonic() + min(req.timeout, MAX_WAIT_SECONDS)
                waiting: tuple[threading.Condition, list[int]] | None = None
                try:
                    while True:
                        scope = self._data.get(req.scope)
                        if scope is not None and req.key in scope:
                            return bytes([OK]) + scope[req.key]
                        if self._closed:
                            return bytes([ERROR]) + b"the store is shutting down (the " \
                                b"launcher or rank 0 that serves it is exiting)"
                        left = end - time.monotonic()
                        if left <= 0:
                            return bytes([MISSING])
                        if waiting is None:
                            waiting = self._key_conds.get((req.scope, req.key))
                            if waiting is None:
                                waiting = (threading.Condition(self._lock), [0])
                                self._key_conds[(req.scope, req.key)] = waiting
                            waiting[1][0] += 1
                        waiting[0].wait(left)
                finally:
                    if waiting is not None:
                        waiting[1][0] -= 1
                        if not waiting[1][0]:
                            self._key_conds.pop((req.scope, req.key), None)
            if req.op == OP_MGET:  # every key at once, present or not (no waiting)
                scope = self._data.get(req.scope) or {}
                return bytes([OK]) + encode_values([scope.get(k) for k in req.keys])
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
            self._notify(req.scope, req.key)
            return bytes([OK]) + _I64.pack(value)

    def _notify(self, scope: str, key: str) -> None:
        """Wake the gets waiting for ``scope``/``key`` (the lock is held)."""
        waiting = self._key_conds.get((scope, key))
        if waiting is not None:
            waiting[0].notify_all()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


__all__ = ["MAX_WAIT_SECONDS", "KVStoreServer"]
