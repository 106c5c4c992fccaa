"""The rendezvous key-value store: operations, waiting, authentication, hostile clients, framing."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hora._util import auth
from hora._util.net import free_port
from hora.errors import FrameError, RendezvousError, RendezvousTimeoutError
from hora.rendezvous import store_wire
from hora.rendezvous.kvstore import KVStoreServer
from hora.rendezvous.store_client import KVStoreClient
from hora.rendezvous.store_wire import (
    AUTH_CONTEXT,
    MAX_FRAME,
    OP_ADD,
    OP_DELETE,
    OP_GET,
    OP_SET,
    StoreRequest,
    decode_request,
    encode_request,
)

SECRET = b"kv-secret"


@pytest.fixture
def server() -> Iterator[KVStoreServer]:
    with KVStoreServer(SECRET, "127.0.0.1", 0, auth_timeout=1.0) as srv:
        yield srv


@pytest.fixture
def client(server: KVStoreServer) -> Iterator[KVStoreClient]:
    with KVStoreClient("127.0.0.1", server.port, SECRET, timeout=5.0) as c:
        yield c


def _authed_socket(server: KVStoreServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5.0)
    auth.client_handshake(sock, SECRET, time.monotonic() + 5.0, AUTH_CONTEXT)
    return sock


def _closed_by_server(sock: socket.socket, within: float = 3.0) -> bool:
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


# ---- operations --------------------------------------------------------------------------------

def test_set_get_delete(client: KVStoreClient) -> None:
    client.set("scope", "k", b"value\x00\xff")
    assert client.get("scope", "k") == b"value\x00\xff"
    client.set("scope", "k", b"")
    assert client.get("scope", "k", timeout=0) == b""
    assert client.delete("scope", "k") is True
    assert client.delete("scope", "k") is False
    with pytest.raises(RendezvousTimeoutError):
        client.get("scope", "k", timeout=0)


def test_scopes_are_separate(client: KVStoreClient) -> None:
    client.set("a", "k", b"1")
    client.set("b", "k", b"2")
    assert (client.get("a", "k"), client.get("b", "k")) == (b"1", b"2")


def test_large_value(client: KVStoreClient) -> None:
    value = bytes(range(256)) * 40_000
    client.set("s", "big", value)
    assert client.get("s", "big") == value


def test_get_waits_server_side_for_a_later_set(server: KVStoreServer,
                                                client: KVStoreClient) -> None:
    def later() -> None:
        time.sleep(0.3)
        with KVStoreClient("127.0.0.1", server.port, SECRET, 5.0) as other:
            other.set("s", "late", b"here")

    thread = threading.Thread(target=later)
    thread.start()
    start = time.monotonic()
    assert client.get("s", "late", timeout=10.0) == b"here"
    assert 0.2 < time.monotonic() - start < 5.0
    thread.join()


def test_get_timeout_names_scope_key_and_knob(client: KVStoreClient) -> None:
    start = time.monotonic()
    with pytest.raises(RendezvousTimeoutError,
                       match=r"key 'nope' in scope 'sc'.*HORA_START_TIMEOUT"):
        client.get("sc", "nope", timeout=0.3)
    assert 0.25 < time.monotonic() - start < 3.0


def test_wait_returns_values_and_lists_missing_keys(client: KVStoreClient) -> None:
    client.set("w", "0", b"a")
    client.set("w", "2", b"c")
    with pytest.raises(RendezvousTimeoutError, match=r"2 of 4 keys.*missing: 1, 3"):
        client.wait("w", ["0", "1", "2", "3"], timeout=0.3)
    client.set("w", "1", b"b")
    client.set("w", "3", b"d")
    assert client.wait("w", ["0", "1", "2", "3"], timeout=1.0) == {
        "0": b"a", "1": b"b", "2": b"c", "3": b"d"}
    assert client.missing("w", ["0", "9"]) == ["9"]


def test_add_is_atomic_across_clients(server: KVStoreServer) -> None:
    clients = [KVStoreClient("127.0.0.1", server.port, SECRET, 5.0) for _ in range(4)]
    try:
        def bump(c: KVStoreClient) -> list[int]:
            return [c.add("ctr", "n", 1) for _ in range(100)]

        with ThreadPoolExecutor(4) as pool:
            seen = [v for vals in pool.map(bump, clients) for v in vals]
        assert sorted(seen) == list(range(1, 401))
        assert clients[0].get("ctr", "n") == b"400"
        assert clients[0].add("ctr", "n", -400) == 0
    finally:
        for c in clients:
            c.close()


def test_add_wakes_waiters_and_rejects_non_counters(client: KVStoreClient) -> None:
    assert client.add("c", "fresh", 5) == 5
    client.set("c", "text", b"hello")
    with pytest.raises(RendezvousError, match="non-integer"):
        client.add("c", "text", 1)
    client.set("c", "max", str(2**63 - 1).encode())
    with pytest.raises(RendezvousError, match="overflow"):
        client.add("c", "max", 1)


def test_client_is_thread_safe(client: KVStoreClient) -> None:
    def work(i: int) -> bytes:
        client.set("t", str(i), str(i).encode())
        return client.get("t", str(i))

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(work, range(64))) == [str(i).encode() for i in range(64)]


# ---- connecting --------------------------------------------------------------------------------

def test_client_retries_until_the_server_is_up() -> None:
    port = free_port()
    started: list[KVStoreServer] = []

    def start_late() -> None:
        time.sleep(0.4)
        started.append(KVStoreServer(SECRET, "127.0.0.1", port).start())

    thread = threading.Thread(target=start_late)
    thread.start()
    try:
        with KVStoreClient("127.0.0.1", port, SECRET, timeout=10.0) as c:
            c.set("s", "k", b"v")
            assert c.get("s", "k") == b"v"
    finally:
        thread.join()
        for srv in started:
            srv.close()


def test_unreachable_store_names_address_and_hint() -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=rf"127\.0\.0\.1:{port}.*HORA_RENDEZVOUS_ADDR"):
        KVStoreClient("127.0.0.1", port, SECRET, timeout=0.5)
    assert time.monotonic() - start < 3.0


def test_lost_server_is_reported(server: KVStoreServer) -> None:
    c = KVStoreClient("127.0.0.1", server.port, SECRET, timeout=1.0)
    server.close()
    with pytest.raises(RendezvousError, match="probably exited"):
        c.set("s", "k", b"v")
    c.close()


def test_close_is_prompt_with_blocked_getters(server: KVStoreServer) -> None:
    errors: list[BaseException] = []

    def blocked() -> None:
        with KVStoreClient("127.0.0.1", server.port, SECRET, timeout=2.0) as c:
            try:
                c.get("s", "never", timeout=30.0)
            except RendezvousError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=blocked) for _ in range(3)]
    for th in threads:
        th.start()
    time.sleep(0.3)
    start = time.monotonic()
    server.close()
    assert time.monotonic() - start < 3.0
    for th in threads:
        th.join(5.0)
        assert not th.is_alive()
    assert len(errors) == 3
    assert not any(isinstance(e, RendezvousTimeoutError) for e in errors)
    server.close()  # idempotent


def test_port_in_use_is_a_clear_error(server: KVStoreServer) -> None:
    with pytest.raises(RendezvousError, match=rf"{server.port}.*HORA_RENDEZVOUS_PORT"):
        KVStoreServer(SECRET, "127.0.0.1", server.port).start()


# ---- hostile clients ---------------------------------------------------------------------------

def test_wrong_secret_refused_and_others_unaffected(server: KVStoreServer,
                                                    client: KVStoreClient,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hora.rendezvous.kvstore"):
        with pytest.raises(RendezvousError, match="authenticate.*secret"):
            KVStoreClient("127.0.0.1", server.port, b"wrong", timeout=2.0)
        client.set("s", "k", b"still fine")
        assert client.get("s", "k") == b"still fine"
        time.sleep(0.1)
    assert "refused a connection" in caplog.text
    assert SECRET.decode() not in caplog.text and SECRET.hex() not in caplog.text


def test_garbage_client_refused(server: KVStoreServer, client: KVStoreClient) -> None:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5.0)
    sock.sendall(b"GET /global/0 HTTP/1.1\r\nHost: x\r\n\r\n" * 4)
    assert _closed_by_server(sock)
    sock.close()
    client.set("s", "k", b"v")
    assert client.get("s", "k") == b"v"


def test_silent_client_does_not_block_others(server: KVStoreServer) -> None:
    silent = socket.create_connection(("127.0.0.1", server.port), timeout=5.0)
    try:
        start = time.monotonic()
        with KVStoreClient("127.0.0.1", server.port, SECRET, timeout=5.0) as good:
            good.set("s", "k", b"v")
            assert good.get("s", "k") == b"v"
        assert time.monotonic() - start < 0.9  # served before the silent one's auth deadline
        silent.recv(len(auth.MAGIC) + auth.NONCE_BYTES)
        assert _closed_by_server(silent, within=5.0)  # dropped at auth_timeout (1 s)
    finally:
        silent.close()


def test_huge_length_field_is_rejected_without_allocating(
        server: KVStoreServer, client: KVStoreClient, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    allocations: list[int] = []
    real_bytearray = bytearray

    def watching_bytearray(*args: object) -> bytearray:
        if args and isinstance(args[0], int):
            allocations.append(args[0])
        return real_bytearray(*args)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(store_wire, "bytearray", watching_bytearray, raising=False)
    with caplog.at_level(logging.WARNING, logger="hora.rendezvous.kvstore"):
        sock = _authed_socket(server)
        sock.sendall(struct.pack("!I", 0xFFFFFFFF))
        assert _closed_by_server(sock)
        sock.close()
        client.set("s", "after", b"ok")
        assert client.get("s", "after") == b"ok"
    assert "exceeds the limit" in caplog.text
    assert max(allocations) <= MAX_FRAME


def test_malformed_request_drops_only_that_client(server: KVStoreServer,
                                                  client: KVStoreClient) -> None:
    sock = _authed_socket(server)
    payload = b"\x09garbage"
    sock.sendall(struct.pack("!I", len(payload)) + payload)
    assert _closed_by_server(sock)
    sock.close()
    assert client.add("s", "n") == 1


# ---- framing -----------------------------------------------------------------------------------

_names = st.text(max_size=40)
_requests = st.one_of(
    st.builds(StoreRequest, st.just(OP_SET), _names, _names, value=st.binary(max_size=200)),
    st.builds(StoreRequest, st.just(OP_GET), _names, _names,
              timeout=st.floats(min_value=0, max_value=1e6, allow_nan=False)),
    st.builds(StoreRequest, st.just(OP_DELETE), _names, _names),
    st.builds(StoreRequest, st.just(OP_ADD), _names, _names,
              delta=st.integers(min_value=-(2**63), max_value=2**63 - 1)),
)


@settings(max_examples=200, deadline=1000)
@given(_requests)
def test_encode_decode_round_trip(req: StoreRequest) -> None:
    assert decode_request(encode_request(req)) == req


@settings(max_examples=200, deadline=1000)
@given(st.binary(max_size=300))
def test_decoder_accepts_or_raises_frame_error(data: bytes) -> None:
    try:
        req = decode_request(data)
    except FrameError:
        return
    assert req.op in (OP_SET, OP_GET, OP_DELETE, OP_ADD)


@settings(max_examples=200, deadline=1000)
@given(_requests, st.integers(min_value=0, max_value=400), st.binary(min_size=1, max_size=4))
def test_decoder_on_mutated_requests(req: StoreRequest, position: int, junk: bytes) -> None:
    raw = bytearray(encode_request(req))
    pos = position % (len(raw) + 1)
    raw[pos:pos + len(junk)] = junk
    try:
        decode_request(bytes(raw))
    except FrameError:
        pass


@settings(max_examples=40, deadline=5000,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64))
def test_live_server_survives_random_frames(server: KVStoreServer, client: KVStoreClient,
                                            payload: bytes) -> None:
    sock = _authed_socket(server)
    try:
        sock.sendall(struct.pack("!I", len(payload)) + payload)
        sock.settimeout(3.0)
        sock.recv(1)  # a response, or EOF after a protocol error; the server must not hang
    except (ConnectionResetError, TimeoutError):
        pass
    finally:
        sock.close()
    client.set("fuzz", "alive", b"1")
    assert client.get("fuzz", "alive", timeout=1.0) == b"1"


def test_wait_arrivals_waits_while_keys_keep_arriving(client: KVStoreClient,
                                                      server: KVStoreServer) -> None:
    """A slow but steady start: 8 keys, one every 0.15 s (1.2 s in all), with 0.5 s allowed
    without progress. A fixed 0.5 s deadline would fail; the progress-aware one succeeds."""
    keys = [str(i) for i in range(8)]

    def publish() -> None:
        with KVStoreClient("127.0.0.1", server.port, SECRET, 5.0) as other:
            for k in reversed(keys):  # the waiter looks at key 0 first: it arrives last
                time.sleep(0.15)
                other.set("steady", k, k.encode())
                other.add("steady", "n", 1)

    t = threading.Thread(target=publish, daemon=True)
    t.start()
    start = time.monotonic()
    got = client.wait_arrivals("steady", keys, idle=0.5, deadline=start + 20, counter="n",
                               check_every=0.1)
    t.join(5)
    assert got == {k: k.encode() for k in keys}
    assert time.monotonic() - start > 0.5  # (longer than the idle limit: progress counted)


def test_wait_arrivals_fails_when_nothing_arrives_naming_the_missing_keys(
        client: KVStoreClient) -> None:
    client.set("stuck", "0", b"x")
    client.set("stuck", "2", b"x")
    with pytest.raises(RendezvousTimeoutError,
                       match=r"2 of 4 keys .* \(none arrived for 0\.4 s\); missing: 1, 3"):
        client.wait_arrivals("stuck", ["0", "1", "2", "3"], idle=0.4,
                             deadline=time.monotonic() + 20, counter="n", check_every=0.1)


def test_wait_arrivals_stops_at_its_overall_deadline_even_with_progress(
        client: KVStoreClient, server: KVStoreServer) -> None:
    stop = threading.Event()

    def trickle() -> None:
        with KVStoreClient("127.0.0.1", server.port, SECRET, 5.0) as other:
            for i in range(1, 100):
                if stop.wait(0.1):
                    return
                other.set("cap", str(i), b"x")
                other.add("cap", "n", 1)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        with pytest.raises(RendezvousTimeoutError, match="overall limit"):
            client.wait_arrivals("cap", ["0"] + [str(i) for i in range(1, 100)], idle=0.5,
                                 deadline=time.monotonic() + 1.0, counter="n", check_every=0.1)
    finally:
        stop.set()
        t.join(5)
