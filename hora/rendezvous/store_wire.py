"""The rendezvous store's wire format (see :mod:`hora.rendezvous.kvstore` for the grammar):
length-prefixed frames, and the binary requests inside them. Every length is checked before
anything is allocated, and every malformed payload raises :class:`~hora.errors.FrameError`."""

from __future__ import annotations

import math
import socket
import struct
import time
from dataclasses import dataclass

from hora._util.net import recv_exact, send_all
from hora.errors import FrameError

MAX_FRAME = 64 * 1024 * 1024 + 1024
"""Largest frame payload either side accepts; a longer length field drops the connection."""

AUTH_CONTEXT = b"hora-kvstore"
"""The context both ends of a store connection bind into the handshake (:mod:`hora._util.auth`)."""

OP_SET, OP_GET, OP_DELETE, OP_ADD, OP_MGET = 1, 2, 3, 4, 5
OK, MISSING, ERROR = 0, 1, 2

_LEN = struct.Struct("!I")
_U16 = struct.Struct("!H")
_F64 = struct.Struct("!d")
_I64 = struct.Struct("!q")
_U32 = struct.Struct("!I")
MGET_ABSENT = 0xFFFFFFFF
"""Length that marks an absent key in an MGET response."""


@dataclass(frozen=True)
class StoreRequest:
    """One decoded store request."""

    op: int
    scope: str
    key: str
    value: bytes = b""
    timeout: float = 0.0
    delta: int = 0
    keys: tuple[str, ...] = ()  # MGET: the keys (``key`` is empty)


def encode_request(req: StoreRequest) -> bytes:
    """The payload bytes (without length prefix) for ``req``.

    Raises:
        FrameError: the scope or key is longer than 65535 bytes, or the op is unknown.
    """
    parts = [bytes([req.op])]
    for name in (req.scope, req.key):
        raw = name.encode()
        if len(raw) > 0xFFFF:
            raise FrameError(f"scope/key name longer than 65535 bytes: {name[:40]!r}...")
        parts += [_U16.pack(len(raw)), raw]
    if req.op == OP_SET:
        parts.append(req.value)
    elif req.op == OP_MGET:
        parts.append("\0".join(req.keys).encode())
    elif req.op == OP_GET:
        parts.append(_F64.pack(req.timeout))
    elif req.op == OP_ADD:
        parts.append(_I64.pack(req.delta))
    elif req.op != OP_DELETE:
        raise FrameError(f"unknown op {req.op}")
    return b"".join(parts)


def _name(payload: memoryview, offset: int) -> tuple[str, int]:
    if offset + 2 > len(payload):
        raise FrameError("truncated name length")
    (n,) = _U16.unpack_from(payload, offset)
    offset += 2
    if offset + n > len(payload):
        raise FrameError("truncated name")
    try:
        return bytes(payload[offset:offset + n]).decode(), offset + n
    except UnicodeDecodeError:
        raise FrameError("name is not valid UTF-8") from None


def decode_request(payload: bytes | bytearray | memoryview) -> StoreRequest:
    """Parse a request payload (the bytes after the length prefix).

    Raises:
        FrameError: anything malformed: unknown op, truncated fields, bad UTF-8, trailing bytes,
            a negative or non-finite timeout.
    """
    view = memoryview(payload).cast("B")
    if len(view) < 1:
        raise FrameError("empty request")
    op = view[0]
    scope, offset = _name(view, 1)
    key, offset = _name(view, offset)
    rest = view[offset:]
    if op == OP_SET:
        return StoreRequest(op, scope, key, value=bytes(rest))
    if op == OP_MGET:
        try:
            keys = tuple(bytes(rest).decode().split("\0")) if len(rest) else ()
        except UnicodeDecodeError:
            raise FrameError("MGET keys are not valid UTF-8") from None
        return StoreRequest(op, scope, key, keys=keys)
    if op == OP_GET:
        if len(rest) != _F64.size:
            raise FrameError("GET needs exactly an 8-byte timeout")
        (timeout,) = _F64.unpack(rest)
        if not math.isfinite(timeout) or timeout < 0:
            raise FrameError(f"invalid GET timeout {timeout}")
        return StoreRequest(op, scope, key, timeout=timeout)
    if op == OP_DELETE:
        if len(rest):
            raise FrameError("DELETE takes no operand")
        return StoreRequest(op, scope, key)
    if op == OP_ADD:
        if len(rest) != _I64.size:
            raise FrameError("ADD needs exactly an 8-byte delta")
        return StoreRequest(op, scope, key, delta=_I64.unpack(rest)[0])
    raise FrameError(f"unknown op {op}")


def encode_values(values: list[bytes | None]) -> bytes:
    """An MGET response body: per key, ``length:u32 | value`` (``MGET_ABSENT``: no value)."""
    parts = []
    for value in values:
        if value is None:
            parts.append(_U32.pack(MGET_ABSENT))
        else:
            parts += [_U32.pack(len(value)), value]
    return b"".join(parts)


def decode_values(body: bytes, count: int) -> list[bytes | None]:
    """Inverse of :func:`encode_values` for ``count`` keys.

    Raises:
        FrameError: truncated or with bytes left over.
    """
    out: list[bytes | None] = []
    offset = 0
    for _ in range(count):
        if offset + 4 > len(body):
            raise FrameError("truncated MGET response")
        (length,) = _U32.unpack_from(body, offset)
        offset += 4
        if length == MGET_ABSENT:
            out.append(None)
            continue
        if offset + length > len(body):
            raise FrameError("truncated MGET value")
        out.append(body[offset:offset + length])
        offset += length
    if offset != len(body):
        raise FrameError("MGET response has bytes left over")
    return out


def _recv_frame(sock: socket.socket, deadline: float | None, io_timeout: float) -> bytes | None:
    """One frame's payload; None on a clean EOF before the length. ``deadline`` None: wait idle.

    Raises:
        FrameError: the length field exceeds :data:`MAX_FRAME` (nothing is allocated).
        TimeoutError, EOFError, OSError: from the socket.
    """
    header = bytearray(_LEN.size)
    view = memoryview(header)
    if deadline is None:
        sock.settimeout(None)
        n = sock.recv_into(view)
        if n == 0:
            return None
        if n < len(view):
            recv_exact(sock, view[n:], time.monotonic() + io_timeout)
        deadline = time.monotonic() + io_timeout
    else:
        recv_exact(sock, view, deadline)
    (length,) = _LEN.unpack(header)
    if length > MAX_FRAME:
        raise FrameError(f"frame length {length} exceeds the limit of {MAX_FRAME} bytes")
    payload = bytearray(length)
    recv_exact(sock, memoryview(payload), deadline)
    return bytes(payload)


def _send_frame(sock: socket.socket, payload: bytes, deadline: float) -> None:
    if len(payload) > MAX_FRAME:
        raise FrameError(f"frame of {len(payload)} bytes exceeds the limit of {MAX_FRAME}")
    send_all(sock, _LEN.pack(len(payload)) + payload, deadline)
