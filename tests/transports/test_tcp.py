"""TCP-transport specifics beyond the conformance suite: set-up, authentication, real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from hora.errors import (
    AuthenticationError,
    HoraTimeoutError,
    PeerLostError,
    RendezvousTimeoutError,
    TransportError,
)
from hora.rendezvous.kvstore import KVStoreServer
from hora.rendezvous.store_client import KVStoreClient
from hora.transports import tcp
from hora.transports.base import MAX_CONTROL_MESSAGE
from hora.transports.tcp import TcpTransport

SECRET = b"tcp-test-secret"


@pytest.fixture
def server() -> Iterator[KVStoreServer]:
    with KVStoreServer(SECRET, "127.0.0.1", 0) as srv:
        yield srv


@pytest.fixture
def cleanup() -> Iterator[list[Any]]:
    objs: list[Any] = []
    yield objs
    for obj in reversed(objs):
        obj.close()


def _create(server: KVStoreServer, cleanup: list[Any], rank: int, size: int, *,
            secret: bytes = SECRET, scope: str = "s", timeout: float = 10.0,
            connect_timeout: float = 10.0) -> TcpTransport:
    store = KVStoreClient("127.0.0.1", server.port, SECRET, 10.0)
    cleanup.append(store)
    t = TcpTransport.create(rank, size, store, scope, secret, "127.0.0.1", f"host{rank}",
                            timeout, connect_timeout=connect_timeout)
    cleanup.append(t)
    return t


def _world(server: KVStoreServer, cleanup: list[Any], n: int, **kw: Any) -> list[TcpTransport]:
    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(lambda r: _create(server, cleanup, r, n, **kw), range(n)))


def test_hostnames_come_from_the_store(server: KVStoreServer, cleanup: list[Any]) -> None:
    world = _world(server, cleanup, 3)
    for t in world:
        assert t.hostnames == ["host0", "host1", "host2"]
        assert t.describe(2) == "rank 2 (host host2)"
        assert t.name == "tcp"


def test_missing_ranks_are_listed(server: KVStoreServer, cleanup: list[Any]) -> None:
    start = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match=r"3 of 4 ranks never published .*no rank "
                       r"arrived for 0.5 s\): ranks \[1, 2, 3\]\. They never started or never "
                       r"reached hora.init\(\).*HORA_START_TIMEOUT"):
        _create(server, cleanup, 0, 4, connect_timeout=0.5)
    assert time.monotonic() - start < 5.0


def test_a_slow_but_steady_start_succeeds(server: KVStoreServer, cleanup: list[Any]) -> None:
    """Ranks arrive 0.4 s apart (1.2 s from the first to the last) with 0.9 s allowed without
    a new rank: the start succeeds (a fixed 0.9 s deadline would fail the first rank)."""
    errors: list[BaseException] = []

    def late(rank: int) -> None:
        time.sleep(0.4 * rank)
        try:
            _create(server, cleanup, rank, 4, scope="steady", connect_timeout=0.9)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)

    threads = [threading.Thread(target=late, args=(r,)) for r in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(20.0)
    assert errors == []


def test_wrong_secret_is_refused(server: KVStoreServer, cleanup: list[Any]) -> None:
    errors: dict[int, BaseException] = {}

    def build(rank: int) -> None:
        try:
            _create(server, cleanup, rank, 2, secret=SECRET if rank == 0 else b"intruder",
                    connect_timeout=1.5)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors[rank] = exc

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10.0)
    assert isinstance(errors[1], AuthenticationError)
    assert "rank 0" in str(errors[1]) and "secret" in str(errors[1])
    assert isinstance(errors[0], HoraTimeoutError)
    assert "ranks [1] never connected" in str(errors[0])


def test_stray_connections_during_setup_do_not_disturb(server: KVStoreServer,
                                                       cleanup: list[Any]) -> None:
    """Garbage, a silent client and a wrong-secret client hit rank 0's listener mid set-up."""
    results: dict[int, TcpTransport] = {}
    t0 = threading.Thread(target=lambda: results.__setitem__(0, _create(server, cleanup, 0, 2)))
    t0.start()
    probe = KVStoreClient("127.0.0.1", server.port, SECRET, 5.0)
    cleanup.append(probe)
    entry = json.loads(probe.get("s", "0", timeout=5.0))
    strays = []
    for payload in (b"GET / HTTP/1.0\r\n\r\n" * 10, None):
        sock = socket.create_connection((entry["host"], entry["port"]), timeout=5.0)
        strays.append(sock)
        if payload:
            sock.sendall(payload)
    results[1] = _create(server, cleanup, 1, 2)
    t0.join(10.0)
    for sock in strays:
        sock.close()
    world = [results[0], results[1]]
    buf = bytearray(5)
    world[0].comm().send(1, b"hello")
    world[1].comm().recv_into(0, buf)
    assert bytes(buf) == b"hello"


def test_scopes_separate_generations(server: KVStoreServer, cleanup: list[Any]) -> None:
    first = _world(server, cleanup, 2, scope="gen1")
    second = _world(server, cleanup, 2, scope="gen2")
    for world in (first, second):
        world[1].send_control(0, b"x")
        assert world[0].recv_control(5.0) == (1, b"x")


def test_sendrecv_to_itself_copies(server: KVStoreServer, cleanup: list[Any]) -> None:
    world = _world(server, cleanup, 2)
    out = np.zeros(4, np.int32)
    world[0].comm().sendrecv(0, np.arange(4, dtype=np.int32), 0, out)
    assert out.tolist() == [0, 1, 2, 3]


def test_bad_buffers_and_peers(server: KVStoreServer, cleanup: list[Any]) -> None:
    world = _world(server, cleanup, 2)
    with pytest.raises(ValueError, match="C-contiguous"):
        world[0].comm().send(1, np.arange(10)[::2])
    with pytest.raises(ValueError, match="read-only"):
        world[0].comm().recv_into(1, b"immutable")
    with pytest.raises(ValueError, match="no data connection"):
        world[0].comm().send(7, b"x")
    with pytest.raises(TransportError, match="exceeds the limit"):
        world[1].send_control(0, bytes(MAX_CONTROL_MESSAGE + 1))


def test_closed_transport_refuses_use(server: KVStoreServer, cleanup: list[Any]) -> None:
    world = _world(server, cleanup, 2)
    world[0].close()
    with pytest.raises(TransportError, match="closed"):
        world[0].comm().send(1, b"x")
    with pytest.raises(TransportError, match="closed"):
        world[0].send_control(1, b"x")
    assert world[0].recv_control(1.0) is None


def test_oversized_control_frame_is_a_protocol_error(server: KVStoreServer,
                                                     cleanup: list[Any]) -> None:
    world = _world(server, cleanup, 2)
    raw = world[1]._control[0]  # a forged length field straight onto the wire
    raw.setblocking(True)
    raw.sendall((MAX_CONTROL_MESSAGE + 1).to_bytes(4, "big"))
    with pytest.raises(TransportError, match="over the limit"):
        world[0].recv_control(5.0)


def test_small_send_chunk_still_correct(server: KVStoreServer, cleanup: list[Any],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp, "SEND_CHUNK", 1000)
    world = _world(server, cleanup, 2)
    data = [np.random.default_rng(r).bytes(300_001) for r in range(2)]
    bufs = [bytearray(300_001) for _ in range(2)]

    def body(r: int) -> None:
        world[r].comm().sendrecv(1 - r, data[r], 1 - r, bufs[r])

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(body, range(2)))
    assert bytes(bufs[0]) == data[1] and bytes(bufs[1]) == data[0]


_CHILD = r"""
import sys, time
from hora.rendezvous.store_client import KVStoreClient
from hora.transports.tcp import TcpTransport
port, secret = int(sys.argv[1]), bytes.fromhex(sys.argv[2])
store = KVStoreClient("127.0.0.1", port, secret, 10.0)
t = TcpTransport.create(1, 2, store, "kill", secret, "127.0.0.1", "childhost", 10.0)
print("ready", flush=True)
time.sleep(60)
"""


def test_killed_process_is_reported_with_rank_and_host(server: KVStoreServer,
                                                       cleanup: list[Any]) -> None:
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(server.port), SECRET.hex()],
                             stdout=subprocess.PIPE, text=True)
    try:
        t = _create(server, cleanup, 0, 2, scope="kill")
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        errors: list[BaseException] = []

        def exchange() -> None:
            big = np.zeros(64 * 1024 * 1024, np.uint8)
            try:
                t.comm().sendrecv(1, big, 1, np.empty_like(big))
            except BaseException as exc:  # noqa: BLE001 - inspected below
                errors.append(exc)

        worker = threading.Thread(target=exchange)
        worker.start()
        time.sleep(0.2)
        os.kill(child.pid, signal.SIGKILL)
        worker.join(10.0)
        assert not worker.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], PeerLostError)
        assert "rank 1 (host childhost)" in str(errors[0])
        with pytest.raises(PeerLostError, match=r"rank 1 \(host childhost\)"):
            t.recv_control(5.0)
    finally:
        child.kill()
        child.wait(10.0)
        if child.stdout is not None:
            child.stdout.close()


def test_local_close_during_transfer_is_not_blamed_on_the_peer(server: KVStoreServer,
                                                                cleanup: list[Any]) -> None:
    world = _world(server, cleanup, 2)
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            world[0].comm().recv_into(1, bytearray(1024))
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(0.2)
    world[0].close()
    thread.join(5.0)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], TransportError)
    assert not isinstance(errors[0], PeerLostError)
    assert "closed" in str(errors[0])
