"""``hora run -H`` across real separate hosts: network namespaces, each with its own sshd.

A module-wide fixture makes three namespaces on a private bridge (``tests/_netns.py``): host 0
(10.77.0.11) runs the launcher, hosts 1 and 2 (10.77.0.12, .13) run sshd on port 2222 and the
remote ranks. Everything the ranks do goes over real sockets between different network stacks,
started by the system ``ssh``; the file system and process table are shared, so the ranks run
this Python and the tests can check every pid. Skipped (with the reason) without root, iproute2
or the OpenSSH server.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .helpers import PY, Launcher, Result, clean_env, wait_dead

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _netns  # noqa: E402  (tests/_netns.py, shared with benchmarks/multihost.py)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

WORKER = str(Path(__file__).with_name("multihost_worker.py"))
JOB_TIMEOUT = 40.0


@pytest.fixture(scope="session")
def cluster() -> Iterator[_netns.Cluster]:
    reason = _netns.unavailable(ssh=True)
    if reason is not None:
        pytest.skip(f"multi-host tests need network namespaces and sshd: {reason}")
    with _netns.Cluster(3) as made:
        yield made


def addr(cluster: _netns.Cluster, i: int) -> str:
    return cluster.hosts[i].address


def hora_run(cluster: _netns.Cluster, *args: str, cwd: Path | None = None,
             env: dict[str, str] | None = None) -> Launcher:
    """``hora run ARGS`` started on host 0 with the cluster's ssh key and port."""
    argv = cluster.hosts[0].argv(PY, "-m", "hora.runner", "run", "-p", str(_netns.SSH_PORT),
                                 "-i", cluster.identity, *args)
    launcher_env = clean_env(**(env or {}))
    launcher_env["PATH"] = f"{cluster.ssh_bin}:{launcher_env['PATH']}"
    return Launcher(argv=argv, env=launcher_env, cwd=cwd)


def no_leftovers(cluster: _netns.Cluster, timeout: float = 5.0) -> dict[str, list[str]]:
    """Processes still running in any namespace (other than sshd) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (left := cluster.leftovers()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {ns: [f"{p}: {_cmdline(p)}" for p in pids] for ns, pids in left.items()}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def test_ranks_on_two_hosts(cluster: _netns.Cluster, tmp_path: Path) -> None:
    h1, h2 = addr(cluster, 1), addr(cluster, 2)
    out = tmp_path / "logs"
    with hora_run(cluster, "-np", "3", "-H", f"{h1}:2,{h2}:1", "--verbose", "-x", "FROM_X=x1",
                  "--output-filename", str(out), PY, WORKER, "report", str(tmp_path),
                  cwd=tmp_path, env={"FROM_LAUNCHER": "yes", "CUDA_VISIBLE_DEVICES": "0"}
                  ) as launcher:
        result = launcher.wait(JOB_TIMEOUT)
    assert result.rc == 0, result.err
    reports = {r: json.loads(lines[0]) for r, lines in result.lines().items()}
    assert sorted(reports) == [0, 1, 2]
    expected = [(h1, 0, 2, 0, 2), (h1, 1, 2, 0, 1), (h2, 0, 1, 1, 2)]  # Horovod's definitions
    for rank, report in reports.items():
        env = report["env"]
        assert (env["HOROVOD_HOSTNAME"], report["local_rank"], report["local_size"],
                report["cross_rank"], report["cross_size"]) == expected[rank]
        assert (env["HOROVOD_RANK"], env["HOROVOD_LOCAL_RANK"]) == (
            str(rank), str(expected[rank][1]))
        assert report["sum"] == [3.0, 6.0, 9.0, 12.0]
        assert report["cwd"] == str(tmp_path)
        assert env["FROM_X"] == "x1" and env["FROM_LAUNCHER"] == "yes"
        assert env["CUDA_VISIBLE_DEVICES"] is None  # Horovod never forwards it to other hosts
        assert env["HORA_RENDEZVOUS_ADDR"] == addr(cluster, 0)
        assert report["secret_in_argv"] == []  # on no command line, on any host
    # --verbose also makes the ranks log (INFO) which data path they use: skip those lines; and
    # a login shell's pyenv set-up may complain on stderr when two logins rehash at once
    lines = {r: [ln for ln in got if " INFO rank " not in ln and ".pyenv" not in ln
                 and not ln.startswith("pyenv: ")]
             for r, got in result.lines("stderr").items()}
    assert lines == {r: [f"stderr line of rank {r}"] for r in range(3)}
    saved = (out / "rank.2" / "stderr").read_text().splitlines()
    assert [ln for ln in saved if " INFO rank " not in ln] == ["stderr line of rank 2"]
    messages = "\n".join(result.hora_messages())
    assert f"rendezvous store: {addr(cluster, 0)}:" in messages
    assert f"on {_netns.IFACE}: this host's address on the route to {h1}" in messages
    assert f"ssh check passed: {h1}" in messages
    assert no_leftovers(cluster) == {}


def test_hierarchical_allgather_two_hosts_two_ranks(cluster: _netns.Cluster,
                                                    tmp_path: Path) -> None:
    h1, h2 = addr(cluster, 1), addr(cluster, 2)
    with hora_run(cluster, "-np", "4", "-H", f"{h1}:2,{h2}:2", "--hierarchical-allgather",
                  "--verbose", PY, WORKER, "allgather", str(tmp_path)) as launcher:
        result = launcher.wait(JOB_TIMEOUT)
    assert result.rc == 0, result.err
    reports = {r: json.loads(lines[0]) for r, lines in result.lines().items()}
    assert reports == {r: {"rank": r, "wrong": []} for r in range(4)}
    logs = result.lines("stderr")
    assert all(any("process set of 4 ranks on 2 hosts: hierarchical allgather" in line
                   for line in logs[r]) for r in range(4)), result.err
    assert no_leftovers(cluster) == {}


def test_hierarchical_adasum_two_hosts_two_ranks(cluster: _netns.Cluster) -> None:
    """op=Adasum across hosts: each host's ranks averaged over shared memory, the two host
    means combined with Adasum over TCP; equal to numpy's on every rank (adasum_worker.py)."""
    h1, h2 = addr(cluster, 1), addr(cluster, 2)
    worker = str(Path(__file__).parents[1] / "integration" / "adasum_worker.py")
    with hora_run(cluster, "-np", "4", "-H", f"{h1}:2,{h2}:2", "--verbose", PY, worker,
                  "a,a,b,b", "hier") as launcher:
        result = launcher.wait(JOB_TIMEOUT)
    assert result.rc == 0, result.err
    assert {r: lines for r, lines in result.lines().items()} == {r: [f"OK {r}"] for r in range(4)}
    logs = result.lines("stderr")
    assert all(any("data path: shard" in line for line in logs[r]) for r in range(4)), result.err
    assert no_leftovers(cluster) == {}


def test_network_interface_and_a_local_rank(cluster: _netns.Cluster, tmp_path: Path) -> None:
    h0, h2 = addr(cluster, 0), addr(cluster, 2)
    with hora_run(cluster, "-np", "2", "-H", f"{h0}:1,{h2}:1", "--network-interface",
                  _netns.IFACE, "--verbose", PY, WORKER, "report", str(tmp_path)) as launcher:
        result = launcher.wait(JOB_TIMEOUT)
    assert result.rc == 0, result.err
    reports = {r: json.loads(lines[0]) for r, lines in result.lines().items()}
    assert [reports[r]["env"]["HOROVOD_HOSTNAME"] for r in (0, 1)] == [h0, h2]
    assert {reports[r]["env"]["HORA_GLOO_IFACE"] for r in (0, 1)} == {_netns.IFACE}
    assert reports[1]["sum"] == [1.0, 3.0, 5.0, 7.0]
    assert (f"rendezvous store: {h0}:" in result.err
            and f"the address of network interface {_netns.IFACE}" in result.err)
    assert f"remote hosts (over ssh): {h2}" in result.err  # host 0 itself is not ssh'd into


def test_killed_remote_rank_stops_every_host(cluster: _netns.Cluster, tmp_path: Path) -> None:
    h1, h2 = addr(cluster, 1), addr(cluster, 2)
    with hora_run(cluster, "-np", "3", "-H", f"{h1}:2,{h2}:1", PY, WORKER, "die",
                  str(tmp_path), "2") as launcher:
        pids = launcher.read_pids([tmp_path / f"pid.{r}" for r in range(3)], timeout=30)
        result: Result = launcher.wait(JOB_TIMEOUT)
    assert result.rc == 128 + signal.SIGKILL
    messages = "\n".join(result.hora_messages())
    assert f"rank 2 of 3 on {h2} exited with code 137" in messages
    assert "stopping the other 2 rank(s)" in messages
    assert f"rank 2 on {h2} was killed by SIGKILL (9)" in result.err
    assert wait_dead(pids, 5.0) == []
    assert no_leftovers(cluster) == {}


def test_signal_to_the_launcher_stops_remote_ranks(cluster: _netns.Cluster,
                                                   tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# two hosts\n{addr(cluster, 1)} slots=1\n\n{addr(cluster, 2)} slots=1\n")
    with hora_run(cluster, "-np", "2", "--hostfile", str(hostfile), PY, WORKER, "hold",
                  str(tmp_path)) as launcher:
        pids = launcher.read_pids([tmp_path / f"pid.{r}" for r in range(2)], timeout=30)
        launcher.proc.send_signal(signal.SIGTERM)
        result = launcher.wait(JOB_TIMEOUT)
    assert result.rc == 128 + signal.SIGTERM
    assert "received SIGTERM; stopping 2 rank(s)" in result.err
    assert wait_dead(pids, 5.0) == []
    assert no_leftovers(cluster) == {}


def test_launcher_killed_with_sigkill_leaves_nothing(cluster: _netns.Cluster,
                                                     tmp_path: Path) -> None:
    """No launcher left to clean up: its ssh processes get SIGTERM from the kernel, their remote
    stdin closes, and the remote side stops the ranks."""
    h0, h1 = addr(cluster, 0), addr(cluster, 1)
    with hora_run(cluster, "-np", "3", "-H", f"{h0}:1,{h1}:2", PY, WORKER, "hold",
                  str(tmp_path), env={"TMPDIR": str(tmp_path)}) as launcher:  # its temp files
        pids = launcher.read_pids([tmp_path / f"pid.{r}" for r in range(3)], timeout=30)
        launcher.proc.kill()
        launcher.wait(JOB_TIMEOUT)
        assert wait_dead(pids, 8.0) == []
    assert no_leftovers(cluster) == {}


def test_many_ranks_on_one_host(cluster: _netns.Cluster) -> None:
    """sshd drops unauthenticated connections beyond MaxStartups (default 10): 14 ranks on one
    host start anyway because the launcher paces its ssh connections per host."""
    with hora_run(cluster, "-np", "14", "-H", f"{addr(cluster, 1)}:14", PY, "-c",
                  "import os; print(os.environ['HORA_LOCAL_RANK'])") as launcher:
        result = launcher.wait(JOB_TIMEOUT)
    assert result.rc == 0, result.err
    assert {r: lines for r, lines in result.lines().items()} == {r: [str(r)] for r in range(14)}


def test_unreachable_hosts_are_reported_together(cluster: _netns.Cluster) -> None:
    h1, h2 = addr(cluster, 1), addr(cluster, 2)
    nobody = f"{_netns.SUBNET}.99"  # on the bridge's subnet, but no host has it
    argv = cluster.hosts[0].argv(PY, "-m", "hora.runner", "run", "-p", "1", "-i",
                                 cluster.identity, "--start-timeout", "3", "-np", "3", "-H",
                                 f"{h1}:1,{h2}:1,{nobody}:1", "true")
    env = clean_env()
    env["PATH"] = f"{cluster.ssh_bin}:{env['PATH']}"
    with Launcher(argv=argv, env=env) as launcher:
        result = launcher.wait(JOB_TIMEOUT)
    assert result.rc == 1
    assert "3 of 3 remote host(s) cannot run ranks:" in result.err
    for host in (h1, h2):
        assert f"{host}: ssh failed (exit code 255): ssh: connect to host {host} port 1: " \
               "Connection refused" in result.err
    assert f"{nobody}: " in result.err
    assert result.seconds < 15
