"""Mutual HMAC challenge/response: good peers pass; wrong, garbage and silent peers are refused."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hora._util import auth
from hora.errors import AuthenticationError

SECRET = b"\x01\x02correct horse battery staple"


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def _both(server: Callable[[], Any], client: Callable[[], Any]
          ) -> tuple[BaseException | None, BaseException | None]:
    """Run both sides concurrently; return (server error, client error)."""
    errors: list[BaseException | None] = [None, None]

    def run(i: int, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate((server, client))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10.0)
        assert not th.is_alive()
    return errors[0], errors[1]


def _deadline(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


def test_same_secret_succeeds(pair: tuple[socket.socket, socket.socket]) -> None:
    s, c = pair
    errs = _both(lambda: auth.server_handshake(s, SECRET, _deadline()),
                 lambda: auth.client_handshake(c, SECRET, _deadline()))
    assert errs == (None, None)
    s.sendall(b"after")  # the stream is usable afterwards, nothing left unread
    assert c.recv(5) == b"after"


def test_same_context_succeeds(pair: tuple[socket.socket, socket.socket]) -> None:
    s, c = pair
    errs = _both(lambda: auth.server_handshake(s, SECRET, _deadline(), b"data/3"),
                 lambda: auth.client_handshake(c, SECRET, _deadline(), b"data/3"))
    assert errs == (None, None)


def test_wrong_secret_refused_on_both_sides(pair: tuple[socket.socket, socket.socket]) -> None:
    s, c = pair
    server_err, client_err = _both(
        lambda: auth.server_handshake(s, SECRET, _deadline()),
        lambda: auth.client_handshake(c, b"not the secret", _deadline()))
    assert isinstance(server_err, AuthenticationError)
    assert "does not know this job's secret" in str(server_err)
    assert isinstance(client_err, AuthenticationError)
    assert "rejected" in str(client_err) and "HORA_SECRET_KEY" in str(client_err)
    for err in (server_err, client_err):
        assert SECRET.hex() not in str(err) and "horse" not in str(err)


def test_context_mismatch_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    s, c = pair
    server_err, client_err = _both(
        lambda: auth.server_handshake(s, SECRET, _deadline(), b"data"),
        lambda: auth.client_handshake(c, SECRET, _deadline(), b"control"))
    assert isinstance(server_err, AuthenticationError)
    assert isinstance(client_err, AuthenticationError)


def test_garbage_client_refused_at_once(pair: tuple[socket.socket, socket.socket]) -> None:
    s, c = pair
    c.sendall(b"GET / HTTP/1.1\r\n" * 8)
    start = time.monotonic()
    with pytest.raises(AuthenticationError, match="not speaking hora's authentication"):
        auth.server_handshake(s, SECRET, _deadline())
    assert time.monotonic() - start < 1.0


def test_silent_client_refused_by_deadline(pair: tuple[socket.socket, socket.socket]) -> None:
    s, _ = pair
    start = time.monotonic()
    with pytest.raises(AuthenticationError, match="did not complete authentication in time"):
        auth.server_handshake(s, SECRET, _deadline(0.3))
    assert 0.25 < time.monotonic() - start < 2.0


def test_client_that_hangs_up_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    s, c = pair
    c.sendall(auth.MAGIC + b"x" * 10)
    c.close()
    with pytest.raises(AuthenticationError, match="closed the connection"):
        auth.server_handshake(s, SECRET, _deadline())


def test_garbage_server_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    s, c = pair
    s.sendall(b"SSH-2.0-OpenSSH_9.6\r\n" + b"\0" * 64)
    with pytest.raises(AuthenticationError, match="not a hora endpoint"):
        auth.client_handshake(c, SECRET, _deadline())


def test_silent_server_refused_by_deadline(pair: tuple[socket.socket, socket.socket]) -> None:
    _, c = pair
    start = time.monotonic()
    with pytest.raises(AuthenticationError, match="in time"):
        auth.client_handshake(c, SECRET, _deadline(0.3))
    assert time.monotonic() - start < 2.0


def test_server_without_the_secret_cannot_impersonate(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """A fake server that accepts anything but cannot compute the server MAC is refused."""
    s, c = pair

    def fake_server() -> None:
        s.sendall(auth.MAGIC + b"n" * auth.NONCE_BYTES)
        s.recv(len(auth.MAGIC) + auth.NONCE_BYTES + auth.MAC_BYTES)
        s.sendall(auth.ACCEPT + b"m" * auth.MAC_BYTES)

    server_err, client_err = _both(fake_server, lambda: auth.client_handshake(c, SECRET,
                                                                              _deadline()))
    assert server_err is None
    assert isinstance(client_err, AuthenticationError)
    assert "could not prove" in str(client_err)


def test_invalid_verdict_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    s, c = pair

    def odd_server() -> None:
        s.sendall(auth.MAGIC + b"n" * auth.NONCE_BYTES)
        s.recv(len(auth.MAGIC) + auth.NONCE_BYTES + auth.MAC_BYTES)
        s.sendall(b"\x07")

    _, client_err = _both(odd_server, lambda: auth.client_handshake(c, SECRET, _deadline()))
    assert isinstance(client_err, AuthenticationError)
    assert "invalid" in str(client_err)


def test_replayed_client_response_is_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    """A recorded client answer does not work against a fresh server nonce."""
    s, c = pair
    recorded: list[bytes] = []

    def recording_server() -> None:
        s.sendall(auth.MAGIC + b"\x00" * auth.NONCE_BYTES)
        recorded.append(s.recv(len(auth.MAGIC) + auth.NONCE_BYTES + auth.MAC_BYTES))
        s.sendall(auth.REJECT)

    _both(recording_server, lambda: auth.client_handshake(c, SECRET, _deadline()))
    s2, c2 = socket.socketpair()
    try:
        def replay() -> None:
            c2.recv(len(auth.MAGIC) + auth.NONCE_BYTES)
            c2.sendall(recorded[0])

        server_err, _ = _both(lambda: auth.server_handshake(s2, SECRET, _deadline()), replay)
        assert isinstance(server_err, AuthenticationError)
    finally:
        s2.close()
        c2.close()


def test_empty_secret_is_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    s, c = pair
    with pytest.raises(AuthenticationError, match="empty"):
        auth.server_handshake(s, b"", _deadline())
    with pytest.raises(AuthenticationError, match="empty"):
        auth.client_handshake(c, b"", _deadline())
