"""Mutual HMAC-SHA256 challenge/response authentication over a connected socket.

Every connection hora accepts — to the rendezvous store and between ranks — first runs this
handshake, so a process that does not know the per-job secret is refused before it can send a
single request (DESIGN.md decision 7). The secret itself never crosses the wire.

Protocol (all fixed-size, so a peer sending garbage is detected at once)::

    server -> client   MAGIC(8) | server_nonce(32)
    client -> server   MAGIC(8) | client_nonce(32) | HMAC(secret, "client" | context | sn | cn)
    server -> client   ACCEPT(1) | HMAC(secret, "server" | context | sn | cn)
                       or REJECT(1), then the server closes

Both sides prove knowledge of the secret over fresh nonces (from :mod:`secrets`), MACs are
compared in constant time, and ``context`` (e.g. a channel or scope name) is bound into both MACs
so a connection meant for one purpose cannot be replayed into another. A peer that sends nothing,
too little, or the wrong bytes is refused by ``deadline`` (a ``time.monotonic()`` value).

Leaf module: imports only :mod:`hora.errors` and :mod:`hora._util.net`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

from hora._util.net import recv_bytes, send_all
from hora.errors import AuthenticationError

MAGIC = b"HORAAUv1"
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
ACCEPT = b"\x01"
REJECT = b"\x00"

_HINT = ("HINT: every process of a job must share the same secret; processes started by "
         "`hora run` get it in HORA_SECRET_KEY — do not mix processes of different jobs.")


def _mac(secret: bytes, role: bytes, context: bytes, server_nonce: bytes,
         client_nonce: bytes) -> bytes:
    msg = b"hora-auth-v1\0" + role + b"\0" + len(context).to_bytes(4, "big") + context
    return hmac.new(secret, msg + server_nonce + client_nonce, hashlib.sha256).digest()


def _peer(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "a disconnected peer"
    if isinstance(name, tuple) and len(name) >= 2:
        return f"{name[0]}:{name[1]}"
    return f"local peer {name!r}" if name else "a local peer"


def _check_secret(secret: bytes) -> None:
    if not secret:
        raise AuthenticationError("the job secret is empty; hora refuses to authenticate with it")


def _recv(sock: socket.socket, nbytes: int, deadline: float, what: str, peer: str) -> bytes:
    try:
        return recv_bytes(sock, nbytes, deadline)
    except TimeoutError:
        raise AuthenticationError(
            f"{peer} did not complete authentication in time (waiting for {what}); refused"
        ) from None
    except EOFError as exc:
        raise AuthenticationError(
            f"{peer} closed the connection during authentication (waiting for {what}: {exc})"
        ) from None
    except OSError as exc:
        raise AuthenticationError(
            f"connection to {peer} failed during authentication ({what}): {exc}"
        ) from None


def _send(sock: socket.socket, data: bytes, deadline: float, peer: str) -> None:
    try:
        send_all(sock, data, deadline)
    except TimeoutError:
        raise AuthenticationError(f"sending to {peer} during authentication timed out") from None
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise AuthenticationError(
            f"{peer} closed the connection during authentication ({exc.strerror})"
        ) from None
    except OSError as exc:
        raise AuthenticationError(
            f"connection to {peer} failed during authentication: {exc}"
        ) from None


def server_handshake(sock: socket.socket, secret: bytes, deadline: float,
                     context: bytes = b"") -> None:
    """Authenticate the client at the other end of ``sock`` (the accepting side).

    Args:
        sock: a connected blocking socket; its timeout is changed.
        secret: the job secret (non-empty).
        deadline: ``time.monotonic()`` value by which the client must have answered.
        context: bytes both sides bind into the MACs (must be equal on both sides).

    Raises:
        AuthenticationError: the client sent garbage, nothing, or a wrong MAC, or the connection
            failed. The client has been sent a REJECT byte where possible; the caller closes.
    """
    _check_secret(secret)
    peer = _peer(sock)
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    _send(sock, MAGIC + server_nonce, deadline, peer)
    reply = _recv(sock, len(MAGIC) + NONCE_BYTES + MAC_BYTES, deadline, "the client's response",
                  peer)
    if reply[:len(MAGIC)] != MAGIC:
        raise AuthenticationError(
            f"{peer} is not speaking hora's authentication protocol (bad magic); refused"
        )
    client_nonce = reply[len(MAGIC):len(MAGIC) + NONCE_BYTES]
    client_mac = reply[len(MAGIC) + NONCE_BYTES:]
    expected = _mac(secret, b"client", context, server_nonce, client_nonce)
    if not hmac.compare_digest(client_mac, expected):
        try:
            sock.settimeout(0.5)
            sock.sendall(REJECT)
        except OSError:
            pass
        raise AuthenticationError(
            f"{peer} failed authentication: it does not know this job's secret "
            f"(or used a different channel); refused. {_HINT}"
        )
    server_mac = _mac(secret, b"server", context, server_nonce, client_nonce)
    _send(sock, ACCEPT + server_mac, deadline, peer)


def client_handshake(sock: socket.socket, secret: bytes, deadline: float,
                     context: bytes = b"") -> None:
    """Authenticate to the server at the other end of ``sock``, and it to us (connecting side).

    Args:
        sock: a connected blocking socket; its timeout is changed.
        secret: the job secret (non-empty).
        deadline: ``time.monotonic()`` value by which the handshake must be done.
        context: bytes both sides bind into the MACs (must be equal on both sides).

    Raises:
        AuthenticationError: the server is not a hora endpoint, rejected our MAC (different
            secret), proved no knowledge of the secret, or the connection failed or timed out.
    """
    _check_secret(secret)
    peer = _peer(sock)
    hello = _recv(sock, len(MAGIC) + NONCE_BYTES, deadline, "the server's challenge", peer)
    if hello[:len(MAGIC)] != MAGIC:
        raise AuthenticationError(
            f"{peer} is not a hora endpoint (unexpected greeting); is the address/port right?"
        )
    server_nonce = hello[len(MAGIC):]
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    mac = _mac(secret, b"client", context, server_nonce, client_nonce)
    _send(sock, MAGIC + client_nonce + mac, deadline, peer)
    status = _recv(sock, 1, deadline, "the server's verdict", peer)
    if status == REJECT:
        raise AuthenticationError(
            f"{peer} rejected this process's credentials: the job secret differs "
            f"(or the channel does). {_HINT}"
        )
    if status != ACCEPT:
        raise AuthenticationError(f"{peer} sent an invalid authentication verdict; refused")
    server_mac = _recv(sock, MAC_BYTES, deadline, "the server's proof", peer)
    expected = _mac(secret, b"server", context, server_nonce, client_nonce)
    if not hmac.compare_digest(server_mac, expected):
        raise AuthenticationError(
            f"{peer} could not prove it knows this job's secret; refusing to talk to it. {_HINT}"
        )


__all__ = ["client_handshake", "server_handshake"]
