"""The TCP transport at scale: how many connections a rank holds, connections opened on first
use, the one-request rendezvous, and the control-plane simulator at small N."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hora.errors import HoraTimeoutError
from hora.rendezvous.kvstore import KVStoreServer
from hora.rendezvous.store_client import KVStoreClient
from hora.transports.tcp import TcpTransport
from hora.transports.tcp_mesh import eager_peers

SECRET = b"tcp-scale-secret"
ROOT = Path(__file__).resolve().parents[2]


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


def _world(server: KVStoreServer, cleanup: list[Any], hosts: list[str],
           timeout: float = 10.0) -> list[TcpTransport]:
    n = len(hosts)

    def make(rank: int) -> TcpTransport:
        store = KVStoreClient("127.0.0.1", server.port, SECRET, 10.0)
        cleanup.append(store)
        t = TcpTransport.create(rank, n, store, "s", SECRET, "127.0.0.1", hosts[rank], timeout)
        cleanup.append(t)
        return t

    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(make, range(n)))


def test_eager_peers_are_ring_neighbours_and_host_leaders() -> None:
    hosts = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    assert eager_peers(5, hosts) == {4, 6}
    assert eager_peers(4, hosts) == {3, 5, 0, 8}  # b's leader: a's and c's leaders
    assert eager_peers(0, hosts) == {11, 1, 4, 8}
    assert eager_peers(0, ["a", "a"]) == {1}
    assert eager_peers(0, ["a"]) == set()
    for p in range(len(hosts)):  # symmetric: both ends make the same connection
        for q in eager_peers(p, hosts):
            assert p in eager_peers(q, hosts)


@pytest.mark.timeout(60)
def test_connection_counts_are_not_a_full_mesh(server: KVStoreServer,
                                               cleanup: list[Any]) -> None:
    """12 ranks on 3 hosts: full mesh was 11 data connections per rank (66 in all); now each
    rank holds its ring neighbours and, on a host leader, the neighbouring leaders."""
    hosts = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    world = _world(server, cleanup, hosts)
    counts = [t.connection_counts() for t in world]
    for rank, (data, control) in enumerate(counts):
        assert data == len(eager_peers(rank, hosts)), (rank, counts)
        assert control == (11 if rank == 0 else 1)
    assert max(d for d, _ in counts) == 4
    assert sum(d for d, _ in counts) // 2 == 15  # 12 on the ring + 3 between the leaders


@pytest.mark.timeout(60)
def test_other_connections_open_on_first_use(server: KVStoreServer,
                                             cleanup: list[Any]) -> None:
    hosts = [f"h{r}" for r in range(6)]
    world = _world(server, cleanup, hosts)
    before = [t.connection_counts()[0] for t in world]
    # 0 <-> 3 are not ring neighbours (hosts have one rank each: every rank leads its host,
    # and the leaders' ring is the same ring): both ends ask at once, as a collective does.
    payload = np.arange(1000, dtype=np.float32)
    got = np.empty_like(payload)
    back = np.empty_like(payload)
    errors: list[BaseException] = []

    def low() -> None:
        try:
            world[0].sendrecv(3, payload, 3, back)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=low)
    thread.start()
    world[3].sendrecv(0, payload * 2, 0, got)
    thread.join(30)
    assert not errors
    assert np.array_equal(got, payload) and np.array_equal(back, payload * 2)
    assert world[0].connection_counts()[0] == before[0] + 1
    assert world[3].connection_counts()[0] == before[3] + 1
    # the connection stays: a second exchange uses it
    thread = threading.Thread(target=lambda: world[3].send(0, payload))
    thread.start()
    world[0].recv_into(3, got)
    thread.join(30)
    assert world[0].connection_counts()[0] == before[0] + 1


@pytest.mark.timeout(60)
def test_a_peer_that_never_connects_times_out_naming_it(server: KVStoreServer,
                                                        cleanup: list[Any]) -> None:
    world = _world(server, cleanup, [f"h{r}" for r in range(5)], timeout=0.5)
    with pytest.raises(HoraTimeoutError, match=r"rank 3 \(host h3\) to open its data"):
        world[1].recv_into(3, np.empty(4, np.uint8))


@pytest.mark.timeout(60)
def test_rendezvous_costs_one_store_wait_per_rank(server: KVStoreServer,
                                                  cleanup: list[Any]) -> None:
    """Every rank learns every address from the one list the last arriver published."""
    world = _world(server, cleanup, [f"h{r % 3}" for r in range(9)])
    store = KVStoreClient("127.0.0.1", server.port, SECRET, 10.0)
    cleanup.append(store)
    listed = json.loads(store.get("s", "all", 1.0))
    assert [e["hostname"] for e in listed] == [f"h{r % 3}" for r in range(9)]
    assert world[8].hostnames == [f"h{r % 3}" for r in range(9)]


@pytest.mark.timeout(120)
def test_control_plane_simulator_small() -> None:
    """benchmarks/control_plane_sim.py at N = 32 on 4 simulated hosts: the real rendezvous,
    negotiation through a real Coordinator, and the engine's cross-host cache (its CrossCache
    on every rank: marks combined by each host's leader, rank 0's messages relayed)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "control_plane_sim.py"), "--ranks", "32",
         "--hosts", "4", "--cycles", "6", "--timeout", "90", "--json", "/dev/stdout"],
        capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout[out.stdout.index("["):])[0]
    assert row["ranks"] == 32 and row["hosts"] == 4
    assert row["data_conns_max"] <= 4 and row["control_conns_rank0"] == 31
    per = row["rank0_per_cycle"]
    # a request from every rank; the responses relayed: one message per other host
    assert per["uncached_in"] == 31 and per["uncached_out"] == 3
    assert per["cached_in"] == 3 and per["cached_out"] == 3  # one message per other host
    assert row["cache_hosts"] == 4 and row["marks_from"] == 3  # the leaders only
    assert row["rendezvous_s"] < 30


def test_store_get_many_reads_keys_in_one_request(server: KVStoreServer,
                                                  cleanup: list[Any]) -> None:
    store = KVStoreClient("127.0.0.1", server.port, SECRET, 10.0)
    cleanup.append(store)
    store.set("m", "a", b"1")
    store.set("m", "b", b"")
    assert store.get_many("m", ["a", "b", "zz"]) == {"a": b"1", "b": b""}
    assert store.get_many("nothing", ["a"]) == {}
    assert store.get_many("m", []) == {}


@pytest.mark.timeout(60)
def test_a_peer_gone_before_first_use_is_lost_at_once(server: KVStoreServer,
                                                      cleanup: list[Any]) -> None:
    """Connecting to a lower rank whose transport closed: refused, a PeerLostError naming it
    at once (not a wait for the timeout)."""
    from hora.errors import PeerLostError

    world = _world(server, cleanup, [f"h{r}" for r in range(5)], timeout=20.0)
    world[1].close()
    with pytest.raises(PeerLostError, match=r"rank 1 \(host h1\) refused") as info:
        world[3].recv_into(1, np.empty(4, np.uint8))
    assert info.value.peer == 1
