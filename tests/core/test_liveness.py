"""Liveness in one process: the engine wakes when a peer's heartbeat time is up (a loss is
declared at the timeout, not up to a heartbeat interval later), and a rank whose launcher's
store closed its connection fails naming the launcher; only launcher-served stores are
watched (never rank 0's store under mpirun, srun or torchrun)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import pytest

from hora.core.engine.liveness import LAUNCHER_CHECK_S, Liveness
from hora.errors import HoraInternalError, PeerLostError
from hora.rendezvous import launcher_watch
from hora.rendezvous.env import detect
from hora.rendezvous.kvstore import KVStoreServer
from hora.rendezvous.store_client import KVStoreClient

pytestmark = pytest.mark.timeout(60)


class _Transport:
    """What Liveness uses of a transport: who we are, and a control channel to send on."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.sent: list[tuple[int, bytes]] = []

    def send_control(self, peer: int, message: bytes) -> None:
        self.sent.append((peer, message))

    def describe(self, peer: int) -> str:
        return f"rank {peer} (host h)"


def _liveness(timeout: float, size: int = 2) -> Liveness:
    return Liveness(_Transport(0, size), timeout)  # type: ignore[arg-type]


def test_the_engine_wakes_when_the_first_peer_s_time_is_up() -> None:
    live = _liveness(1.0, size=3)
    now = time.monotonic()
    live._last_heard.update({1: now - 0.9, 2: now})  # rank 1 silent for 0.9 s
    wait = live.next_beat_in()
    assert wait is not None and 0.05 < wait <= 0.1 + 0.01  # its deadline, not the next beat
    time.sleep(wait)
    with pytest.raises(PeerLostError, match=r"rank 1 \(host h\) sent nothing for 1\.0 s, not even"
                                            r" a heartbeat \(HORA_HEARTBEAT_TIMEOUT_SECONDS=1\)"):
        live.beat()


def test_a_peer_heard_from_in_time_is_not_lost_and_gets_heartbeats() -> None:
    live = _liveness(0.4)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        live.heard(1)
        wait = live.next_beat_in()
        assert wait is not None and wait <= 0.1 + 0.01  # a heartbeat every quarter
        time.sleep(wait)
        live.beat()
    assert len(live._transport.sent) >= 8  # type: ignore[attr-defined]


def test_with_heartbeats_off_nothing_wakes_the_engine_unless_a_launcher_is_watched() -> None:
    assert not launcher_watch.active()
    assert _liveness(0.0).next_beat_in() is None
    live = _liveness(0.0, size=1)
    live.beat()  # nothing to do


@pytest.fixture
def store() -> Iterator[tuple[KVStoreServer, KVStoreClient]]:
    secret = secrets.token_bytes(32)
    server = KVStoreServer(secret, "127.0.0.1", 0).start()
    client = KVStoreClient(server.host, server.port, secret, timeout=5.0)
    yield server, client
    client.close()
    server.close()
    assert launcher_watch.check() is None and not launcher_watch.active()


def test_the_store_client_sees_its_server_go_without_blocking_or_sending(
        store: tuple[KVStoreServer, KVStoreClient]) -> None:
    server, client = store
    client.set("s", "k", b"v")
    assert not client.server_closed()
    with client._lock:  # a request in flight on another thread: no answer, no wait
        assert not client.server_closed()
    server.close()
    deadline = time.monotonic() + 5
    while not client.server_closed():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    client.close()
    assert not client.server_closed()


@pytest.mark.parametrize("heartbeat", [2.0, 0.0])
def test_a_watched_launcher_that_is_gone_fails_the_rank_naming_it(
        store: tuple[KVStoreServer, KVStoreClient], heartbeat: float) -> None:
    server, client = store
    launcher_watch.watch(client, "hora run, pid 4242")
    live = _liveness(heartbeat)
    wait = live.next_beat_in()
    assert wait is not None and wait <= (heartbeat / 4 if heartbeat else LAUNCHER_CHECK_S)
    live._next_check = 0.0  # due now
    live.beat()  # the launcher is there: nothing happens
    server.close()
    time.sleep(0.2)
    live._next_check = 0.0
    with pytest.raises(HoraInternalError, match=r"the launcher \(hora run, pid 4242\) is gone: "
                                                r"the rendezvous store it served at "
                                                r"127\.0\.0\.1:\d+ closed this rank's connection"):
        live.beat()
    client.close()
    assert launcher_watch.check() is None  # a closed client is no longer watched


# ---- which stores are watched ------------------------------------------------------------------

SECRET = {"HORA_SECRET_KEY": "ab" * 32}
HORA_RUN = {"HORA_RANK": "1", "HORA_SIZE": "2", "HORA_RENDEZVOUS_ADDR": "127.0.0.1",
            "HORA_RENDEZVOUS_PORT": "5000", **SECRET}
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "5000"}
MPIRUN = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
          "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
          "OMPI_MCA_ess_base_jobid": "7"}
SRUN = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1",
        "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "9", "SLURM_STEP_NODELIST": "n1",
        "SLURM_STEP_TASKS_PER_NODE": "2"}
LAUNCHED = {"HORA_LAUNCHER": "hora run", "HORA_LAUNCHER_PID": "4242"}


@pytest.mark.parametrize(("env", "owner"), [
    ({**HORA_RUN, **LAUNCHED}, "hora run, pid 4242"),
    ({**MPIRUN, **SECRET, **LAUNCHED, "HORA_RENDEZVOUS_ADDR": "127.0.0.1",
      "HORA_RENDEZVOUS_PORT": "5000"}, "hora run, pid 4242"),  # hora run --data-plane mpi
    ({**HORA_RUN, "HORA_LAUNCHER": "hora.spark.run"}, "hora.spark.run"),
    (HORA_RUN, "the launcher"),  # a harness serving the store itself
    (TORCHRUN, None), (MPIRUN, None), (SRUN, None),  # rank 0 serves the store
    ({**TORCHRUN, "RANK": "0"}, None), ({**MPIRUN, "OMPI_COMM_WORLD_RANK": "0"}, None),
], ids=["hora-run", "hora-run-mpi", "spark", "harness", "torchrun", "mpirun", "srun",
        "torchrun-rank0", "mpirun-rank0"])
def test_only_a_store_served_by_a_launcher_is_watched(env: dict[str, str],
                                                      owner: str | None) -> None:
    assert launcher_watch.owner(detect(env), env) == owner
