"""Launcher-environment detection (hora run, Open MPI, MPICH, Slurm, torchrun) and bootstrap."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from hora._util.net import free_port
from hora.errors import RendezvousError
from hora.rendezvous import store_bootstrap
from hora.rendezvous.env import PORT_RANGE, WorldInfo, detect
from hora.rendezvous.slurm_lists import expand_nodelist, expand_tasks_per_node
from hora.rendezvous.store_bootstrap import bootstrap
from hora.rendezvous.topology import compute_topology

SECRET_HEX = "00112233445566778899aabbccddeeff"
HOSTS = ["a", "a", "b", "b", "b"]  # block layout: 2 ranks on host a, 3 on host b


def hora_env(rank: int, hosts: list[str] = HOSTS, prefix: str = "HORA") -> dict[str, str]:
    """What `hora run` exports for ``rank`` of a job laid out as ``hosts``."""
    slot = compute_topology(hosts)[rank]
    env = {f"{prefix}_{k}": str(v) for k, v in (
        ("RANK", slot.rank), ("SIZE", slot.size), ("LOCAL_RANK", slot.local_rank),
        ("LOCAL_SIZE", slot.local_size), ("CROSS_RANK", slot.cross_rank),
        ("CROSS_SIZE", slot.cross_size), ("HOSTNAME", slot.hostname))}
    env.update({"HORA_RENDEZVOUS_ADDR": "10.0.0.1", "HORA_RENDEZVOUS_PORT": "4567",
                "HORA_SECRET_KEY": SECRET_HEX})
    return env


def ompi_env(rank: int, hosts: list[str] = HOSTS, jobid: str = "1234") -> dict[str, str]:
    local = [i for i, h in enumerate(hosts) if h == hosts[rank]]
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(len(hosts)),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(local.index(rank)),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(len(local)), "OMPI_MCA_ess_base_jobid": jobid,
            "HORA_HOSTNAME": hosts[rank]}


def slurm_env(rank: int, hosts: list[str] = HOSTS) -> dict[str, str]:
    order = list(dict.fromkeys(hosts))
    counts = [hosts.count(h) for h in order]
    local = [i for i, h in enumerate(hosts) if h == hosts[rank]]
    per_node = ",".join(str(c) for c in counts)
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(len(hosts)),
            "SLURM_STEP_NUM_TASKS": str(len(hosts)), "SLURM_LOCALID": str(local.index(rank)),
            "SLURM_NODEID": str(order.index(hosts[rank])), "SLURM_STEP_TASKS_PER_NODE": per_node,
            "SLURM_STEP_NODELIST": ",".join(order), "SLURM_JOB_ID": "777",
            "SLURM_STEP_ID": "0", "SLURMD_NODENAME": hosts[rank]}


def torchrun_env(rank: int, local_size: int = 2, nodes: int = 2) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(local_size * nodes),
            "LOCAL_RANK": str(rank % local_size), "LOCAL_WORLD_SIZE": str(local_size),
            "GROUP_RANK": str(rank // local_size), "GROUP_WORLD_SIZE": str(nodes),
            "MASTER_ADDR": "master.example", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "run1", "HORA_HOSTNAME": f"n{rank // local_size}"}


# ---- single / hora run -------------------------------------------------------------------------

def test_nothing_means_single_process() -> None:
    info = detect({})
    assert (info.launcher, info.rank, info.size, info.local_rank, info.local_size) == (
        "single", 0, 1, 0, 1)
    assert info.store_host is None and not info.serve_store


def test_hora_run_env() -> None:
    info = detect(hora_env(3))
    assert info == WorldInfo(3, 5, 1, 3, 1, 2, "b", "hora", "10.0.0.1", 4567,
                             bytes.fromhex(SECRET_HEX), False)


def test_horovod_names_are_accepted() -> None:
    env = hora_env(1, prefix="HOROVOD")
    env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] = env.pop("HORA_RENDEZVOUS_ADDR")
    env["HOROVOD_GLOO_RENDEZVOUS_PORT"] = env.pop("HORA_RENDEZVOUS_PORT")
    info = detect(env)
    assert (info.rank, info.size, info.hostname, info.store_port) == (1, 5, "a", 4567)


def test_horovodrun_without_secret_explains() -> None:
    env = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "1.2.3.4",
           "HOROVOD_GLOO_RENDEZVOUS_PORT": "1234"}
    with pytest.raises(RendezvousError, match=r"hora run.*HORA_SECRET_KEY"):
        detect(env)


def test_hora_rank_without_store_address() -> None:
    with pytest.raises(RendezvousError, match="HORA_RENDEZVOUS_ADDR"):
        detect({"HORA_RANK": "0", "HORA_SIZE": "2"})
    assert detect({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1"}).store_host is None


@pytest.mark.parametrize("changes,match", [
    ({"HORA_RANK": "one"}, r"HORA_RANK='one' is not an integer"),
    ({"HORA_RANK": "5"}, r"HORA_RANK=5 is not smaller than HORA_SIZE=5"),
    ({"HORA_SIZE": "0"}, r"HORA_SIZE='0' must be >= 1"),
    ({"HORA_LOCAL_RANK": "-1"}, r"HORA_LOCAL_RANK='-1' must be >= 0"),
    ({"HORA_LOCAL_RANK": "3"}, r"HORA_LOCAL_RANK=3 is not smaller than HORA_LOCAL_SIZE=3"),
    ({"HORA_RENDEZVOUS_PORT": "http"}, r"HORA_RENDEZVOUS_PORT='http'"),
])
def test_malformed_values_name_the_variable(changes: dict[str, str], match: str) -> None:
    with pytest.raises(RendezvousError, match=match):
        detect(hora_env(3) | changes)


def test_bad_secret_is_named_but_not_shown() -> None:
    with pytest.raises(RendezvousError, match="HORA_SECRET_KEY is not a hex") as info:
        detect(hora_env(0) | {"HORA_SECRET_KEY": "zz-very-secret"})
    assert "very-secret" not in str(info.value)


def test_repr_hides_the_secret() -> None:
    info = detect(hora_env(0))
    assert SECRET_HEX not in repr(info) and "secret" not in repr(info)


# ---- MPI ---------------------------------------------------------------------------------------

def test_ompi_single_host_derives_a_shared_store() -> None:
    hosts = ["a"] * 3
    infos = [detect(ompi_env(r, hosts)) for r in range(3)]
    assert {i.launcher for i in infos} == {"mpirun"}
    assert {(i.store_host, i.store_port, i.secret) for i in infos} == {
        (infos[0].store_host, infos[0].store_port, infos[0].secret)}
    assert infos[0].store_host == "127.0.0.1"
    assert PORT_RANGE[0] <= (infos[0].store_port or 0) < PORT_RANGE[1]
    assert [i.serve_store for i in infos] == [True, False, False]
    assert [(i.local_rank, i.local_size) for i in infos] == [(0, 3), (1, 3), (2, 3)]
    other_job = detect(ompi_env(0, hosts, jobid="99"))
    assert (other_job.store_port, other_job.secret) != (infos[0].store_port, infos[0].secret)


def test_ompi_multi_host_needs_the_store_address() -> None:
    with pytest.raises(RendezvousError, match=r"mpirun -x HORA_RENDEZVOUS_ADDR"):
        detect(ompi_env(0))
    info = detect(ompi_env(4) | {"HORA_RENDEZVOUS_ADDR": "hostA"})
    assert (info.store_host, info.rank, info.serve_store) == ("hostA", 4, False)
    assert detect(ompi_env(0) | {"HORA_RENDEZVOUS_ADDR": "hostA"}).serve_store


def test_explicit_port_and_secret_win() -> None:
    info = detect(ompi_env(0, ["a"]) | {"HORA_RENDEZVOUS_PORT": "5000",
                                        "HORA_SECRET_KEY": SECRET_HEX})
    assert (info.store_port, info.secret) == (5000, bytes.fromhex(SECRET_HEX))


def test_a_hora_launcher_serving_the_store_stops_rank0_from_serving() -> None:
    info = detect(ompi_env(0, ["a", "a"]) | {"HORA_LAUNCHER": "hora"})
    assert not info.serve_store


def test_mpich_pmi_env() -> None:
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
           "PMI_KVSNAME": "kvs_42_0"}
    info = detect(env)
    assert (info.launcher, info.rank, info.size, info.local_rank, info.store_host) == (
        "mpirun", 1, 2, 1, "127.0.0.1")
    assert info.store_port == detect(env | {"PMI_RANK": "0", "MPI_LOCALRANKID": "0"}).store_port


def test_mpi_rank_out_of_range() -> None:
    with pytest.raises(RendezvousError, match="OMPI_COMM_WORLD_RANK=7 is not smaller"):
        detect(ompi_env(0, ["a"]) | {"OMPI_COMM_WORLD_RANK": "7"})


# ---- Slurm -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("node01", ["node01"]),
    ("node[01-03,7],other", ["node01", "node02", "node03", "node7", "other"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("gpu[009-011]", ["gpu009", "gpu010", "gpu011"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("x[1,3],y,z[5-5]", ["x1", "x3", "y", "z5"]),
    ("", []),
])
def test_expand_nodelist(text: str, expected: list[str]) -> None:
    assert expand_nodelist(text) == expected


@pytest.mark.parametrize("text", ["node[1-", "node]1[", "node[a-b]", "node[3-1]", "n[[1]]"])
def test_expand_nodelist_errors_name_the_variable(text: str) -> None:
    with pytest.raises(RendezvousError, match="SLURM_JOB_NODELIST"):
        expand_nodelist(text, "SLURM_JOB_NODELIST")


def test_expand_tasks_per_node() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(RendezvousError, match="SLURM_STEP_TASKS_PER_NODE"):
        expand_tasks_per_node("2(x)")


def test_slurm_multi_node() -> None:
    infos = [detect(slurm_env(r)) for r in range(len(HOSTS))]
    assert {i.launcher for i in infos} == {"slurm"}
    assert {i.store_host for i in infos} == {"a"}
    assert len({(i.store_port, i.secret) for i in infos}) == 1
    assert [i.local_size for i in infos] == [2, 2, 3, 3, 3]
    assert [i.serve_store for i in infos] == [True] + [False] * 4
    assert infos[3].hostname == "b"


def test_slurm_compressed_lists() -> None:
    env = slurm_env(0) | {"SLURM_STEP_NODELIST": "n[07-08]", "SLURM_STEP_TASKS_PER_NODE": "2,3"}
    assert detect(env).store_host == "n07"
    assert detect(slurm_env(4) | {"SLURM_STEP_TASKS_PER_NODE": "2,3"}).local_size == 3


def test_slurm_single_node_uses_loopback() -> None:
    info = detect(slurm_env(1, ["a", "a"]))
    assert (info.store_host, info.local_size) == ("127.0.0.1", 2)


def test_slurm_batch_script_without_step_is_single() -> None:
    env = slurm_env(0)
    del env["SLURM_STEP_ID"]
    assert detect(env).launcher == "single"


# ---- torchrun ----------------------------------------------------------------------------------

def test_torchrun_env() -> None:
    infos = [detect(torchrun_env(r)) for r in range(4)]
    assert {i.launcher for i in infos} == {"torchrun"}
    assert {(i.store_host, i.store_port) for i in infos} == {("master.example", 29501)}
    assert [(i.local_rank, i.cross_rank, i.cross_size) for i in infos] == [
        (0, 0, 2), (1, 0, 2), (0, 1, 2), (1, 1, 2)]
    assert [i.serve_store for i in infos] == [True, False, False, False]
    assert len({i.secret for i in infos}) == 1


def test_torchrun_port_override() -> None:
    info = detect(torchrun_env(0) | {"HORA_RENDEZVOUS_PORT": "31000"})
    assert info.store_port == 31000


def test_torchrun_single_node_uses_loopback() -> None:
    info = detect(torchrun_env(1, local_size=2, nodes=1))
    assert (info.store_host, info.store_port) == ("127.0.0.1", 29501)


# ---- topology agreement ------------------------------------------------------------------------

@pytest.mark.parametrize("launcher", ["hora", "mpirun", "slurm", "torchrun"])
def test_topology_agrees_with_hora_run(launcher: str) -> None:
    """Whatever a launcher states agrees with compute_topology over the ranks' host names, and
    filling the rest from it gives exactly what `hora run` would have exported."""
    hosts = ["n0", "n0", "n1", "n1"] if launcher == "torchrun" else HOSTS
    make = {"hora": lambda r: hora_env(r, hosts), "mpirun": lambda r: ompi_env(r, hosts),
            "slurm": lambda r: slurm_env(r, hosts), "torchrun": torchrun_env}[launcher]
    infos = [detect(make(r) | {"HORA_RENDEZVOUS_ADDR": "10.0.0.1"}) for r in range(len(hosts))]
    slots = compute_topology([i.hostname for i in infos])
    for info, slot in zip(infos, slots):
        stated = {f: getattr(info, f) for f in ("local_rank", "local_size", "cross_rank",
                                                "cross_size")}
        computed = {f: getattr(slot, f) for f in stated}
        assert {k: v for k, v in stated.items() if v is not None} == {
            k: v for k, v in computed.items() if stated[k] is not None}
        filled = {k: computed[k] if v is None else v for k, v in stated.items()}
        expected = detect(hora_env(info.rank, hosts))
        assert filled == {f: getattr(expected, f) for f in stated}


# ---- bootstrap ---------------------------------------------------------------------------------

def test_bootstrap_single_is_storeless() -> None:
    assert bootstrap(detect({}), timeout=1.0) == (None, None)


def test_bootstrap_serves_and_connects() -> None:
    port = free_port()
    base = ompi_env(0, ["a", "a"]) | {"HORA_RENDEZVOUS_PORT": str(port)}
    info0 = detect(base)
    info1 = detect(base | {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    client0, server = bootstrap(info0, timeout=5.0)
    assert server is not None and client0 is not None and server.port == port
    try:
        client1, no_server = bootstrap(info1, timeout=5.0)
        assert no_server is None and client1 is not None
        client1.set("g", "1", b"hello")
        assert client0.get("g", "1", timeout=2.0) == b"hello"
        client1.close()
    finally:
        client0.close()
        server.close()


def test_bootstrap_port_in_use_explains() -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        info = detect(ompi_env(0, ["a", "a"]) | {"HORA_RENDEZVOUS_PORT": str(port)})
        with pytest.raises(RendezvousError, match=rf"rank 0.*{port}.*HORA_RENDEZVOUS_PORT"):
            bootstrap(info, timeout=1.0)


def test_bind_address_for_loopback_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    assert store_bootstrap._bind_address("127.0.0.1") == "127.0.0.1"
    assert store_bootstrap._bind_address("localhost") == "127.0.0.1"
    monkeypatch.setattr(socket, "getaddrinfo",
                        lambda *a, **k: [(0, 0, 0, "", ("127.0.1.1", 0))])
    assert store_bootstrap._bind_address("myhost") == "0.0.0.0"
    monkeypatch.setattr(socket, "getaddrinfo",
                        lambda *a, **k: [(0, 0, 0, "", ("10.1.2.3", 0))])
    assert store_bootstrap._bind_address("myhost") == "10.1.2.3"


def test_worldinfo_is_frozen() -> None:
    info = detect({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.rank = 3  # type: ignore[misc]
