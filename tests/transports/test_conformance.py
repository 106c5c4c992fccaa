"""One conformance suite for every transport: the behaviour the engine and collectives rely on.

Each test gets ``make_world(n, timeout)`` for one transport kind:

* ``tcp``: ``n`` :class:`~hora.transports.tcp.TcpTransport` objects built in threads of this
  process against a :class:`~hora.rendezvous.kvstore.KVStoreServer` on 127.0.0.1;
* ``loopback``: :func:`hora.transports.loopback.make_world`.

Every world is closed in teardown; every blocking step runs under a join deadline.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from hora.collectives.comm import Comm
from hora.errors import HoraError, HoraTimeoutError, PeerLostError
from hora.transports.base import Transport

MakeWorld = Callable[..., list[Transport]]
SECRET = b"conformance-secret"


def _tcp_factory(cleanup: list[Any]) -> MakeWorld:
    from hora.rendezvous.kvstore import KVStoreServer
    from hora.rendezvous.store_client import KVStoreClient
    from hora.transports.tcp import TcpTransport

    def make(n: int, timeout: float = 10.0) -> list[Transport]:
        server = KVStoreServer(SECRET, "127.0.0.1", 0).start()
        cleanup.append(server)
        stores = [KVStoreClient("127.0.0.1", server.port, SECRET, 10.0) for _ in range(n)]
        cleanup.extend(stores)

        def build(rank: int) -> Transport:
            return TcpTransport.create(rank, n, stores[rank], "conformance", SECRET, "127.0.0.1",
                                       f"host{rank}", timeout, connect_timeout=10.0)

        with ThreadPoolExecutor(max_workers=n) as pool:
            world = list(pool.map(build, range(n)))
        cleanup.extend(world)
        return world

    return make


def _loopback_factory(cleanup: list[Any]) -> MakeWorld:
    try:
        loopback = importlib.import_module("hora.transports.loopback")
    except ImportError as exc:  # being written in parallel; skip rather than fail
        pytest.skip(f"hora.transports.loopback is not available yet: {exc}")

    def make(n: int, timeout: float = 10.0) -> list[Transport]:
        world: list[Transport] = loopback.make_world(n, timeout=timeout)
        cleanup.extend(world)
        return world

    return make


@pytest.fixture(params=["tcp", "loopback"])
def make_world(request: pytest.FixtureRequest) -> Iterator[MakeWorld]:
    cleanup: list[Any] = []
    factory = _tcp_factory if request.param == "tcp" else _loopback_factory
    yield factory(cleanup)
    for obj in reversed(cleanup):
        obj.close()


def run_ranks(world: list[Transport], fn: Callable[[Transport], Any],
              timeout: float = 30.0) -> list[Any]:
    """Run ``fn(transport)`` for every rank at once; re-raise the first failure."""
    results: list[Any] = [None] * len(world)
    errors: list[BaseException] = []

    def body(t: Transport) -> None:
        try:
            results[t.rank] = fn(t)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(t,), daemon=True) for t in world]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def _payload(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


# ---- identity ----------------------------------------------------------------------------------

def test_identity_and_describe(make_world: MakeWorld) -> None:
    world = make_world(3)
    for rank, t in enumerate(world):
        assert (t.rank, t.size) == (rank, 3)
        comm = t.comm()
        assert isinstance(comm, Comm)
        assert (comm.rank, comm.size) == (rank, 3)
        for peer in range(3):
            assert f"rank {peer}" in t.describe(peer)
            assert f"rank {peer}" in comm.describe(peer)


def test_single_rank_world(make_world: MakeWorld) -> None:
    (t,) = make_world(1)
    assert (t.rank, t.size) == (0, 1)
    assert t.recv_control(0.05) is None
    t.close()


# ---- data plane --------------------------------------------------------------------------------

def test_messages_arrive_in_order(make_world: MakeWorld) -> None:
    world = make_world(2)
    messages = [_payload(n, n) for n in (1, 5, 1000, 3, 70000)]

    def body(t: Transport) -> list[bytes]:
        comm = t.comm()
        if t.rank == 0:
            for m in messages:
                comm.send(1, m)
            return []
        got = []
        for m in messages:
            buf = np.empty_like(m)
            comm.recv_into(0, buf)
            got.append(buf.tobytes())
        return got

    assert run_ranks(world, body)[1] == [m.tobytes() for m in messages]


@pytest.mark.parametrize("nbytes", [0, 1, 7, 4096, 65537, 3 * 1024 * 1024 + 5])
def test_sizes_both_directions(make_world: MakeWorld, nbytes: int) -> None:
    world = make_world(2)
    sent = [_payload(nbytes, 10), _payload(nbytes, 11)]

    def body(t: Transport) -> bytes:
        comm, peer = t.comm(), 1 - t.rank
        buf = np.zeros(nbytes, np.uint8)
        if t.rank == 0:
            comm.send(peer, sent[0])
            comm.recv_into(peer, buf)
        else:
            comm.recv_into(peer, buf)
            comm.send(peer, sent[1])
        return buf.tobytes()

    got = run_ranks(world, body)
    assert got[1] == sent[0].tobytes()
    assert got[0] == sent[1].tobytes()


def test_typed_and_multidimensional_buffers(make_world: MakeWorld) -> None:
    world = make_world(2)
    src = np.arange(24, dtype=np.float64).reshape(2, 3, 4)

    def body(t: Transport) -> np.ndarray | None:
        if t.rank == 0:
            t.comm().send(1, src)
            t.comm().send(1, memoryview(src.tobytes()))
            return None
        out = np.zeros((2, 3, 4), np.float64)
        raw = bytearray(src.nbytes)
        t.comm().recv_into(0, out)
        t.comm().recv_into(0, raw)
        assert bytes(raw) == src.tobytes()
        return out

    np.testing.assert_array_equal(run_ranks(world, body)[1], src)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("nbytes", [0, 13, 1024 * 1024 + 3])
def test_sendrecv_ring_does_not_deadlock(make_world: MakeWorld, n: int, nbytes: int) -> None:
    world = make_world(n)
    steps = 3

    def body(t: Transport) -> list[bytes]:
        comm, r = t.comm(), t.rank
        got = []
        for step in range(steps):
            out = _payload(nbytes, 100 * step + r)
            buf = np.zeros(nbytes, np.uint8)
            comm.sendrecv((r + 1) % n, out, (r - 1) % n, buf)
            got.append(buf.tobytes())
        return got

    results = run_ranks(world, body)
    for r in range(n):
        left = (r - 1) % n
        assert results[r] == [_payload(nbytes, 100 * s + left).tobytes() for s in range(steps)]


def test_sendrecv_pairwise_exchange_large(make_world: MakeWorld) -> None:
    """Both ranks of a pair send 8 MiB to each other at once: far beyond socket buffers."""
    world = make_world(2)
    nbytes = 8 * 1024 * 1024

    def body(t: Transport) -> bool:
        peer = 1 - t.rank
        buf = np.zeros(nbytes, np.uint8)
        t.comm().sendrecv(peer, _payload(nbytes, t.rank), peer, buf)
        return bool(np.array_equal(buf, _payload(nbytes, peer)))

    assert run_ranks(world, body) == [True, True]


def test_sendrecv_with_different_peers_and_sizes(make_world: MakeWorld) -> None:
    """Ring step with unequal chunk sizes (as in a ring allreduce of an odd-sized buffer)."""
    world = make_world(3)
    sizes = [100_000, 100_001, 99_999]

    def body(t: Transport) -> bytes:
        r = t.rank
        buf = np.zeros(sizes[(r - 1) % 3], np.uint8)
        t.comm().sendrecv((r + 1) % 3, _payload(sizes[r], r), (r - 1) % 3, buf)
        return buf.tobytes()

    results = run_ranks(world, body)
    for r in range(3):
        left = (r - 1) % 3
        assert results[r] == _payload(sizes[left], left).tobytes()


# ---- control plane -----------------------------------------------------------------------------

def test_control_messages_both_ways(make_world: MakeWorld) -> None:
    n = 4
    world = make_world(n)
    big = bytes(_payload(1024 * 1024 + 1, 5))

    def body(t: Transport) -> Any:
        if t.rank == 0:
            for peer in range(1, n):
                t.send_control(peer, f"to {peer}".encode())
                t.send_control(peer, b"")
            t.send_control(1, big)
            got = [t.recv_control(10.0) for _ in range(2 * (n - 1))]
            return sorted((m[0], m[1]) for m in got if m is not None)
        first, second = t.recv_control(10.0), t.recv_control(10.0)
        assert first == (0, f"to {t.rank}".encode())
        assert second == (0, b"")
        if t.rank == 1:
            assert t.recv_control(10.0) == (0, big)
        t.send_control(0, f"from {t.rank}".encode())
        t.send_control(0, bytes([t.rank]) * 3)
        return None

    got = run_ranks(world, body)[0]
    expected = sorted([(p, f"from {p}".encode()) for p in range(1, n)]
                      + [(p, bytes([p]) * 3) for p in range(1, n)])
    assert got == expected


def test_control_messages_from_one_sender_keep_order(make_world: MakeWorld) -> None:
    world = make_world(2)
    for i in range(50):
        world[1].send_control(0, str(i).encode())
    got = [world[0].recv_control(5.0) for _ in range(50)]
    assert got == [(1, str(i).encode()) for i in range(50)]


def test_control_only_between_rank0_and_others(make_world: MakeWorld) -> None:
    world = make_world(3)
    with pytest.raises((ValueError, HoraError)):
        world[1].send_control(2, b"x")


def test_recv_control_times_out_with_none(make_world: MakeWorld) -> None:
    world = make_world(2)
    start = time.monotonic()
    assert world[0].recv_control(0.2) is None
    assert world[1].recv_control(0.0) is None
    assert 0.15 <= time.monotonic() - start < 3.0


def test_wake_interrupts_recv_control(make_world: MakeWorld) -> None:
    world = make_world(2)
    for t in world:
        timer = threading.Timer(0.2, t.wake)
        timer.start()
        start = time.monotonic()
        assert t.recv_control(20.0) is None
        assert time.monotonic() - start < 5.0
        timer.join()


def test_wake_before_recv_control_is_not_lost(make_world: MakeWorld) -> None:
    world = make_world(2)
    world[0].wake()
    world[0].wake()
    start = time.monotonic()
    assert world[0].recv_control(20.0) is None
    assert time.monotonic() - start < 5.0
    world[1].send_control(0, b"after")
    assert world[0].recv_control(5.0) == (1, b"after")


def test_wake_from_many_threads(make_world: MakeWorld) -> None:
    world = make_world(2)
    threads = [threading.Thread(target=world[1].wake) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert world[1].recv_control(5.0) is None


# ---- failures ----------------------------------------------------------------------------------

def test_peer_close_fails_data_receive_naming_the_rank(make_world: MakeWorld) -> None:
    world = make_world(3)
    world[2].close()
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="rank 2"):
        world[0].comm().recv_into(2, bytearray(16))
    with pytest.raises(PeerLostError, match="rank 2"):
        world[1].comm().sendrecv(2, b"x" * 8, 2, bytearray(8))
    assert time.monotonic() - start < 5.0


def test_peer_close_after_partial_data(make_world: MakeWorld) -> None:
    world = make_world(2)
    world[1].comm().send(0, b"abc")
    world[1].close()
    buf = bytearray(10)
    with pytest.raises(PeerLostError, match="rank 1"):
        world[0].comm().recv_into(1, buf)


def test_peer_close_fails_control_after_its_messages(make_world: MakeWorld) -> None:
    world = make_world(3)
    world[2].send_control(0, b"last words")
    world[2].close()
    assert world[0].recv_control(5.0) == (2, b"last words")
    with pytest.raises(PeerLostError, match="rank 2"):
        world[0].recv_control(5.0)


def test_rank0_close_fails_control_on_others(make_world: MakeWorld) -> None:
    world = make_world(2)
    world[0].close()
    with pytest.raises(PeerLostError, match="rank 0"):
        world[1].recv_control(5.0)


def test_silent_peer_times_out_naming_it(make_world: MakeWorld) -> None:
    world = make_world(2, timeout=0.3)
    start = time.monotonic()
    with pytest.raises(HoraTimeoutError, match="rank 1"):
        world[0].comm().recv_into(1, bytearray(8))
    with pytest.raises(HoraTimeoutError, match="rank 0"):
        world[1].comm().sendrecv(0, b"", 0, bytearray(8))
    assert time.monotonic() - start < 5.0


def test_close_is_idempotent_and_wakes(make_world: MakeWorld) -> None:
    world = make_world(2)
    result: list[Any] = []

    def wait() -> None:
        try:
            result.append(world[0].recv_control(20.0))
        except HoraError as exc:  # a transport may report its own close as an error
            result.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.1)
    world[0].close()
    thread.join(5.0)
    assert not thread.is_alive()
    world[0].close()
    world[1].close()
