"""Fuzzing the rendezvous store as a protocol, not just its frame parser.

``test_kvstore.py`` already fuzzes :func:`decode_request` on bytes and a live server on single
random frames. This adds sequences:

* a stateful model test: random SET / GET / DELETE / ADD from several authenticated clients,
  interleaved with hostile connections (unauthenticated garbage, a wrong secret, a half-finished
  handshake, authenticated clients sending malformed, truncated or oversized frames or vanishing
  mid-frame); after every step each good client's view must equal a dict model of the store;
* concurrency: hostile clients hammering the server while good clients count with ``add``;
* length fields: for any 32-bit length the frame reader allocates at most ``MAX_FRAME`` bytes
  and at most what the header claims, and never more than one frame's worth per connection.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hora._util import auth
from hora.errors import FrameError, RendezvousError, RendezvousTimeoutError
from hora.rendezvous import store_wire
from hora.rendezvous.kvstore import KVStoreServer
from hora.rendezvous.store_client import KVStoreClient
from hora.rendezvous.store_wire import (
    AUTH_CONTEXT,
    MAX_FRAME,
    OK,
    OP_ADD,
    OP_DELETE,
    OP_GET,
    OP_SET,
    StoreRequest,
    decode_request,
    encode_request,
)

SECRET = b"fuzz-secret"
_SCOPES = st.sampled_from(["global", "tcp.0", "s"])
_KEYS = st.sampled_from(["0", "1", "n", "addr", "\u00e9"])
_VALUES = st.one_of(st.binary(max_size=40), st.integers(-5, 5).map(lambda i: str(i).encode()),
                    st.just(str(2**63 - 1).encode()))


def _authed(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    auth.client_handshake(sock, SECRET, time.monotonic() + 5.0, AUTH_CONTEXT)
    return sock


def _dropped(sock: socket.socket, within: float = 3.0) -> bool:
    """True once the server has closed ``sock`` (EOF or reset) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _malformed_payloads() -> st.SearchStrategy[bytes]:
    bad_op = st.binary(min_size=1, max_size=60).filter(lambda b: b[0] not in (1, 2, 3, 4))
    valid = st.builds(StoreRequest, st.sampled_from([OP_SET, OP_GET, OP_DELETE, OP_ADD]),
                      st.text(max_size=6), st.text(max_size=6), value=st.binary(max_size=8),
                      timeout=st.just(0.0), delta=st.integers(-3, 3)).map(encode_request)

    def broken(data: bytes, cut: int, extra: bytes) -> bytes:
        return data[:cut % len(data)] if not extra else data + extra

    wrecked = st.builds(broken, valid, st.integers(0, 100), st.binary(max_size=3))
    return st.one_of(bad_op, wrecked, st.just(b"")).filter(_is_malformed)


def _is_malformed(payload: bytes) -> bool:
    try:
        decode_request(payload)
    except FrameError:
        return True
    return False


class StoreProtocol(RuleBasedStateMachine):
    """Good clients against a dict model, with hostile connections between their requests."""

    def __init__(self) -> None:
        super().__init__()
        self.server = KVStoreServer(SECRET, "127.0.0.1", 0, auth_timeout=1.0,
                                    io_timeout=2.0).start()
        self.clients = [KVStoreClient("127.0.0.1", self.server.port, SECRET, timeout=5.0)
                        for _ in range(2)]
        self.model: dict[tuple[str, str], bytes] = {}
        self.leftovers: list[socket.socket] = []

    @initialize()
    def empty(self) -> None:
        assert self.clients[0].missing("s", ["0"]) == ["0"]

    # ---- good clients ----------------------------------------------------------------------------
    @rule(c=st.integers(0, 1), scope=_SCOPES, key=_KEYS, value=_VALUES)
    def set(self, c: int, scope: str, key: str, value: bytes) -> None:
        self.clients[c].set(scope, key, value)
        self.model[scope, key] = value

    @rule(c=st.integers(0, 1), scope=_SCOPES, key=_KEYS)
    def get(self, c: int, scope: str, key: str) -> None:
        if (scope, key) in self.model:
            assert self.clients[c].get(scope, key, timeout=0) == self.model[scope, key]
        else:
            with pytest.raises(RendezvousTimeoutError):
                self.clients[c].get(scope, key, timeout=0)

    @rule(c=st.integers(0, 1), scope=_SCOPES, key=_KEYS)
    def delete(self, c: int, scope: str, key: str) -> None:
        assert self.clients[c].delete(scope, key) == ((scope, key) in self.model)
        self.model.pop((scope, key), None)

    @rule(c=st.integers(0, 1), scope=_SCOPES, key=_KEYS,
          delta=st.one_of(st.integers(-3, 3), st.just(2**62), st.just(-(2**63))))
    def add(self, c: int, scope: str, key: str, delta: int) -> None:
        old = self.model.get((scope, key), b"0")
        try:
            new: int | None = int(old) + delta
        except ValueError:
            new = None
        if new is None or not -(2**63) <= new < 2**63:
            with pytest.raises(RendezvousError, match="non-integer|overflow"):
                self.clients[c].add(scope, key, delta)
            return
        assert self.clients[c].add(scope, key, delta) == new
        self.model[scope, key] = str(new).encode()

    @rule(scope=_SCOPES, key=_KEYS, value=_VALUES)
    def get_waits_for_a_set(self, scope: str, key: str, value: bytes) -> None:
        self.clients[0].delete(scope, key)
        got: list[bytes] = []
        waiter = threading.Thread(target=lambda: got.append(
            self.clients[1].get(scope, key, timeout=5.0)))
        waiter.start()
        time.sleep(0.01)
        self.clients[0].set(scope, key, value)
        waiter.join(5.0)
        assert got == [value]
        self.model[scope, key] = value

    # ---- hostile connections ---------------------------------------------------------------------
    @rule(data=st.binary(max_size=120), linger=st.booleans())
    def unauthenticated_garbage(self, data: bytes, linger: bool) -> None:
        sock = socket.create_connection(("127.0.0.1", self.server.port), timeout=5.0)
        try:
            sock.sendall(data)
        except OSError:
            pass
        if linger:  # stays connected: the server must not wait for it to serve others
            self.leftovers.append(sock)
        else:
            sock.close()

    @rule()
    def wrong_secret(self) -> None:
        with pytest.raises(RendezvousError, match="authenticate"):
            KVStoreClient("127.0.0.1", self.server.port, b"not-the-secret", timeout=2.0)

    @rule(cut=st.integers(0, len(auth.MAGIC) + auth.NONCE_BYTES + auth.MAC_BYTES - 1))
    def handshake_cut_short(self, cut: int) -> None:
        sock = socket.create_connection(("127.0.0.1", self.server.port), timeout=5.0)
        sock.recv(len(auth.MAGIC) + auth.NONCE_BYTES)
        sock.sendall((auth.MAGIC + b"\x00" * 64)[:cut])
        sock.close()

    @rule(payload=_malformed_payloads())
    def malformed_frame(self, payload: bytes) -> None:
        sock = _authed(self.server.port)
        sock.sendall(struct.pack("!I", len(payload)) + payload)
        assert _dropped(sock)
        sock.close()

    @rule(length=st.integers(MAX_FRAME + 1, 2**32 - 1))
    def oversized_length(self, length: int) -> None:
        sock = _authed(self.server.port)
        sock.sendall(struct.pack("!I", length))
        assert _dropped(sock)
        sock.close()

    @rule(req=st.builds(StoreRequest, st.just(OP_SET), _SCOPES, _KEYS, value=_VALUES),
          cut=st.integers(0, 200))
    def vanishes_mid_frame(self, req: StoreRequest, cut: int) -> None:
        frame = struct.pack("!I", len(encode_request(req))) + encode_request(req)
        sock = _authed(self.server.port)
        sock.sendall(frame[:cut % len(frame)])
        sock.close()  # the partial SET must not be applied

    @rule(reqs=st.lists(st.builds(StoreRequest, st.just(OP_SET), _SCOPES, _KEYS, value=_VALUES),
                        min_size=1, max_size=3))
    def pipelined_then_garbage(self, reqs: list[StoreRequest]) -> None:
        """Valid requests in one burst, then garbage: the valid ones are applied, in order."""
        sock = _authed(self.server.port)
        burst = b"".join(struct.pack("!I", len(p)) + p for p in map(encode_request, reqs))
        sock.sendall(burst + struct.pack("!I", 1) + b"\xff")
        got = b""
        sock.settimeout(3.0)
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                break
            got += chunk
        sock.close()
        assert got == struct.pack("!IB", 1, OK) * len(reqs)
        for r in reqs:
            self.model[r.scope, r.key] = r.value

    # ---- checks ----------------------------------------------------------------------------------
    @invariant()
    def good_clients_see_the_model(self) -> None:
        keys = ["0", "1", "n", "addr", "\u00e9"]
        for scope in ("global", "tcp.0", "s"):
            present = {k: v for (s, k), v in self.model.items() if s == scope}
            for c in self.clients:
                assert set(keys) - set(c.missing(scope, keys)) == set(present)
            assert self.clients[1].wait(scope, list(present), timeout=0) == present

    def teardown(self) -> None:
        for c in self.clients:
            c.close()
        for sock in self.leftovers:
            sock.close()
        self.server.close()


TestStoreProtocol = StoreProtocol.TestCase
TestStoreProtocol.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


def test_hostile_clients_never_disturb_good_ones() -> None:
    """Good clients count with add() while hostile connections come and go around them."""
    with KVStoreServer(SECRET, "127.0.0.1", 0, auth_timeout=0.5, io_timeout=1.0) as server:
        stop = threading.Event()

        def hostile(i: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    if n % 3 == 0:
                        sock = _authed(server.port)
                        sock.sendall(struct.pack("!I", 3) + bytes([9, i, n % 256]))
                    elif n % 3 == 1:
                        sock = socket.create_connection(("127.0.0.1", server.port), timeout=2)
                        sock.sendall(b"\x00" * (n % 50))
                    else:
                        sock = _authed(server.port)
                        sock.sendall(struct.pack("!I", MAX_FRAME + n))
                    sock.close()
                except OSError:
                    pass

        def good(c: KVStoreClient) -> int:
            worst = 0.0
            for _ in range(100):
                t0 = time.monotonic()
                c.add("ctr", "n", 1)
                worst = max(worst, time.monotonic() - t0)
            assert worst < 2.0
            return 100

        threads = [threading.Thread(target=hostile, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        clients = [KVStoreClient("127.0.0.1", server.port, SECRET, 5.0) for _ in range(3)]
        try:
            with ThreadPoolExecutor(3) as pool:
                assert sum(pool.map(good, clients)) == 300
            assert clients[0].get("ctr", "n") == b"300"
        finally:
            stop.set()
            for t in threads:
                t.join(5)
            for c in clients:
                c.close()


@settings(max_examples=200, deadline=2000)
@given(st.integers(0, 2**32 - 1), st.integers(0, 64))
def test_length_field_bounds_allocation(length: int, sent: int) -> None:
    """Whatever 32-bit length a peer claims, the reader allocates <= MAX_FRAME and <= length."""
    allocations: list[int] = []
    real = bytearray

    def watching(*args: Any) -> bytearray:
        if args and isinstance(args[0], int):
            allocations.append(args[0])
        return real(*args)

    a, b = socket.socketpair()
    store_wire.bytearray = watching  # type: ignore[attr-defined]
    try:
        a.sendall(struct.pack("!I", length) + b"x" * min(sent, length))
        a.close()
        try:
            payload = store_wire._recv_frame(b, time.monotonic() + 2.0, 2.0)
        except FrameError:
            assert length > MAX_FRAME
        except EOFError:
            assert min(sent, length) < length <= MAX_FRAME
        else:
            assert payload == b"x" * length
    finally:
        del store_wire.bytearray  # type: ignore[attr-defined]
        b.close()
    assert all(n <= MAX_FRAME and n <= max(length, 4) for n in allocations), allocations
