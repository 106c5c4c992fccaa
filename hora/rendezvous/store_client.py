"""The rendezvous store's client: one authenticated connection per rank to a store server.

:class:`KVStoreClient` connects (retrying until the server is up), sends requests in the
:mod:`hora.rendezvous.store_wire` format, and turns failures into
:class:`~hora.errors.RendezvousError` messages that name the store and the remedy. The server and
the store's semantics are in :mod:`hora.rendezvous.kvstore`.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from hora._util import auth
from hora.errors import (
    AuthenticationError,
    FrameError,
    RendezvousError,
    RendezvousTimeoutError,
)
from hora.rendezvous.store_wire import (
    _I64,
    AUTH_CONTEXT,
    ERROR,
    OK,
    OP_ADD,
    OP_DELETE,
    OP_GET,
    OP_MGET,
    OP_SET,
    StoreRequest,
    _recv_frame,
    _send_frame,
    decode_values,
    encode_request,
)

if TYPE_CHECKING:
    from typing_extensions import Self

_TIMEOUT_HINT = ("HINT: the rank that publishes it may not have started, may have crashed, or may "
                 "be slow to start; raise HORA_START_TIMEOUT (hora run --start-timeout) if start-up"
                 " is slow.")


class KVStoreClient:
    """A connection to a :class:`~hora.rendezvous.kvstore.KVStoreServer`.

    Thread-safe: one request at a time (a lock). The connection is made in the constructor,
    retrying until ``timeout`` passes (the server may not be up yet). A connection broken
    mid-request is re-made on the next call.

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
        self._closed = False
        with self._lock:
            self._connect(time.monotonic() + timeout)

    @property
    def address(self) -> str:
        """``host:port`` of the server."""
        return f"{self._host}:{self._port}"

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

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

    def wait_arrivals(self, scope: str, keys: Iterable[str], idle: float, deadline: float,
                      *, counter: str, check_every: float = 1.0) -> dict[str, bytes]:
        """Wait until every key of ``keys`` exists in ``scope``, for as long as keys keep
        arriving: fail when none arrived for ``idle`` seconds, or at ``deadline`` (on the
        :func:`time.monotonic` clock) whatever happens. A slow but steady start (hundreds of
        ranks on a few cores, a slow shared file system) succeeds; a stuck one fails.

        Progress is read from the counter ``counter`` in ``scope`` (one request, however many
        keys): whoever sets a key adds 1 to it (:meth:`add`).

        Raises:
            RendezvousTimeoutError: keys still missing; the message lists them and says which
                limit passed.
            RendezvousError: the store is unreachable.
        """
        wanted = list(keys)
        values: dict[str, bytes] = {}
        idle_until = time.monotonic() + idle
        arrived = -1
        for key in wanted:
            while True:
                now = time.monotonic()
                left = min(idle_until, deadline) - now
                if left <= 0:
                    absent = self.missing(scope, wanted)
                    shown = ", ".join(absent[:32]) + (" ..." if len(absent) > 32 else "")
                    why = (f"none arrived for {idle:.1f} s" if idle_until <= deadline else
                           "start-up reached its overall limit")
                    raise RendezvousTimeoutError(
                        f"{len(absent)} of {len(wanted)} keys in scope {scope!r} did not appear "
                        f"in the rendezvous store at {self.address} ({why}); missing: {shown}. "
                        f"{_TIMEOUT_HINT}")
                try:
                    values[key] = self.get(scope, key, min(left, check_every))
                    idle_until = time.monotonic() + idle  # found one more: progress
                    break
                except RendezvousTimeoutError:
                    now_arrived = self.add(scope, counter, 0)
                    if now_arrived > arrived:  # progress: others arrived meanwhile
                        arrived = now_arrived
                        idle_until = time.monotonic() + idle
        return values

    def get_many(self, scope: str, keys: Iterable[str]) -> dict[str, bytes]:
        """The values of those of ``keys`` that exist in ``scope`` now, in one request (no
        waiting): the last rank to arrive reads every rank's address this way.

        Raises:
            RendezvousError: the store is unreachable or answered garbage.
        """
        wanted = list(keys)
        _, body = self._call(StoreRequest(OP_MGET, scope, "", keys=tuple(wanted)))
        try:
            values = decode_values(body, len(wanted))
        except FrameError as exc:
            raise RendezvousError(f"rendezvous store at {self.address}: {exc}") from None
        return {k: v for k, v in zip(wanted, values) if v is not None}

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

    def server_closed(self) -> bool:
        """Whether the server closed this client's idle connection (it exited or was killed:
        the kernel closes its sockets). Never blocks and never sends: False while a request is
        in flight on another thread, after :meth:`close`, or when the connection is already
        down (that request's caller got the error)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            sock = self._sock
            if sock is None or self._closed:
                return False
            if hasattr(select, "poll"):
                poller = select.poll()
                poller.register(sock, select.POLLIN)
                if not poller.poll(0):
                    return False
            elif not select.select([sock], [], [], 0)[0]:
                return False
            try:  # readable while idle: EOF (b""), a reset, or bytes the server never sends
                return sock.recv(1, socket.MSG_PEEK) == b""
            except BlockingIOError:
                return False
            except OSError:
                return True
        finally:
            self._lock.release()

    def close(self) -> None:
        """Close the connection. Idempotent."""
        with self._lock:
            self._closed = True
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["KVStoreClient"]
