"""Remote ranks without a network: the ssh path of ``hora run`` against a fake ``ssh``.

``fake_ssh.py`` stands in for ssh: the "remote" command runs here, in its own session, with a
login-like environment and its stdin fed through the fake ssh (EOF when it dies), as on a
real remote host. The launcher runs with a prelude that makes host names starting with
``fake`` remote, keeps the store on 127.0.0.1 (the fake hosts are this machine), and fails the
test if anything tries to resolve a name. Real hosts are tested in test_multihost.py.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hora.errors import ConfigError
from hora.runner import network, ssh
from hora.runner.hosts import HostSlots, assign_hosts, parse_hostfile, parse_hosts

from .helpers import PY, Launcher, Result, alive, clean_env, fake_ssh_path, wait_dead

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc to check pids")

WORKER = str(Path(__file__).with_name("multihost_worker.py"))

PRELUDE = """\
import sys
import hora.runner.launch as launch, hora.runner.network as network
import hora.runner.processes as processes
launch.is_local_host = lambda host: not host.startswith("fake")
launch.store_address = lambda remote, config: network.StoreAddress("127.0.0.1", "lo", "test")
def _no_dns(host):
    raise AssertionError("the launcher tried to resolve " + host)
network.resolve = _no_dns
GRACE = GRACE_S
if GRACE:
    processes.GRACE_PERIOD_S = GRACE
from hora.runner.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture()
def fake_path(tmp_path: Path) -> str:
    """A PATH whose ``ssh`` is the fake."""
    return fake_ssh_path(tmp_path)


def launcher(fake_path: str, *args: str, grace: float = 0.0, cwd: Path | None = None,
             **env: str) -> Launcher:
    argv = [PY, "-c", PRELUDE.replace("GRACE_S", repr(grace)), "run", *args]
    return Launcher(argv=argv, env=clean_env(PATH=fake_path, **env), cwd=cwd)


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rfind(")") + 2:].split()[1])


# ---- units -------------------------------------------------------------------------------------

def test_ssh_command_line() -> None:
    options = ssh.SshOptions(port=2222, identity_file="/k/id", connect_timeout=7)
    argv = ssh.rank_argv("node1", 3, "/opt/py bin/python", options)
    assert argv[1:argv.index("--")] == [
        "-o", "BatchMode=yes", "-o", "ConnectTimeout=7", "-o", "StrictHostKeyChecking=no",
        "-o", "LogLevel=ERROR", "-T", "-x", "-p", "2222", "-i", "/k/id"]
    assert argv[-2] == "node1"
    assert shlex.split(argv[-1]) == ["exec", "/opt/py bin/python", "-c", ssh.LOADER,
                                     "hora-rank=3"]


def test_the_request_carries_the_environment_and_never_the_command_line() -> None:
    secret = "ab" * 32
    request = ssh.rank_request(argv=["python", "train.py"], env={"HORA_SECRET_KEY": secret},
                               cwd="/w", grace=2.0, rank=1, host="b", job_id="j1")
    sources, body = request.decode().splitlines()
    names = [name for name, _ in json.loads(sources)]
    assert names == ["<hora.runner.binding>", "<hora.runner.remote>"]  # run in this order
    assert json.loads(sources)[1][1].startswith('"""The far end of a rank started over ssh')
    assert json.loads(body) == {"argv": ["python", "train.py"],
                                "env": {"HORA_SECRET_KEY": secret}, "cwd": "/w", "grace": 2.0,
                                "rank": 1, "host": "b", "cpu_share": None,
                                "segment_prefix": "hora-j1-", "live_prefix": "hora-j1.live."}
    bad = ssh.rank_request(argv=["x"], env={}, cwd="/w", grace=2.0, rank=1, host="b",
                           job_id="../etc")  # not a job id: the far end cleans nothing
    assert json.loads(bad.decode().splitlines()[1])["segment_prefix"] == ""
    assert secret not in " ".join(ssh.rank_argv("b", 1, PY, ssh.SshOptions()))


@pytest.mark.parametrize(("code", "stderr", "expected"), [
    (255, "ssh: connect to host b port 22: Connection refused\n",
     "ssh failed (exit code 255): ssh: connect to host b port 22: Connection refused"),
    (127, "sh: 1: exec: /py: not found\n", "cannot run the launcher's Python /py there"),
    (3, "[hora] b cannot connect back to the launcher at 10.0.0.1:5: refused\n",
     "b cannot connect back to the launcher at 10.0.0.1:5: refused (exit code 3). HINT"),
    (None, "", "no answer within 3 s"),
])
def test_host_check_messages(code: int | None, stderr: str, expected: str) -> None:
    assert expected in ssh.HostCheck("b", code, stderr, 0.1).describe("/py", 3.0)


def test_start_gate_paces_connections_per_host() -> None:
    with ssh.StartGate(limit=2, timeout=0.4) as gate:
        t0 = time.monotonic()
        gate.wait_turn("a", 0)
        gate.wait_turn("a", 1)
        gate.wait_turn("b", 2)  # another host has its own budget
        assert time.monotonic() - t0 < 0.2
        Path(gate.marker(0)).touch()  # rank 0's ssh authenticated: a turn frees up
        gate.wait_turn("a", 3)
        assert time.monotonic() - t0 < 0.2
        gate.wait_turn("a", 4)  # ranks 1 and 3 never connect: their turns time out
        assert time.monotonic() - t0 >= 0.4
        argv = ssh.rank_argv("a", 4, PY, ssh.SshOptions(), connected_marker=gate.marker(4))
        assert f"LocalCommand=touch {gate.marker(4)}" in argv
        directory = Path(gate.marker(0)).parent
        assert list(directory.iterdir()) == []  # markers are removed as they are seen
    assert not directory.exists()


def test_store_address_choices() -> None:
    assert network.store_address([], "").address == "127.0.0.1"
    assert network.store_address([], "lo").reason == "the address of network interface lo"
    with pytest.raises(ConfigError, match="loopback address 127.0.0.1, which the other hosts"):
        network.store_address(["10.1.1.1"], "lo")
    with pytest.raises(ConfigError, match="is this machine under another name"):
        network.store_address(["127.0.0.1"], "")
    with pytest.raises(ConfigError, match="network interface 'nosuch0' does not exist"):
        network.store_address(["10.1.1.1"], "nosuch0")


def test_slots_fill_hosts_in_order_and_np_ranks_start(tmp_path: Path) -> None:
    hosts = parse_hosts("a:2,b:1,c:4")
    assert assign_hosts(5, hosts) == ["a", "a", "b", "c", "c"]
    assert assign_hosts(2, hosts) == ["a", "a"]  # hosts beyond -np get no rank
    path = tmp_path / "hosts"
    path.write_text("# cluster\n\na slots=2   # first\nb slots=1 max_slots=4\nc\n")
    assert parse_hostfile(path) == (HostSlots("a", 2), HostSlots("b", 1), HostSlots("c", 1))
    with pytest.raises(ConfigError, match=r"too few slots: -np 5 but the hosts \(a:2,b:2\)"):
        assign_hosts(5, parse_hosts("a:2,b:2"))


# ---- through the fake ssh ----------------------------------------------------------------------

def test_remote_and_local_ranks(fake_path: str, tmp_path: Path) -> None:
    log = tmp_path / "ssh.log"
    with launcher(fake_path, "-np", "3", "-H", "fake1:2,localhost:1", "-x", "FROM_X=1",
                  PY, WORKER, "report", str(tmp_path), cwd=tmp_path, FAKE_SSH_LOG=str(log),
                  FROM_LAUNCHER="yes", CUDA_VISIBLE_DEVICES="0") as job:
        result = job.wait(30)
    assert result.rc == 0, result.err
    reports = {r: json.loads(lines[0]) for r, lines in result.lines().items()}
    hosts = [reports[r]["env"]["HOROVOD_HOSTNAME"] for r in range(3)]
    assert hosts == ["fake1", "fake1", "localhost"]
    assert [reports[r]["env"]["FAKE_SSH_HOST"] for r in range(3)] == ["fake1", "fake1", None]
    assert [reports[r]["local_rank"] for r in range(3)] == [0, 1, 0]
    assert [reports[r]["cross_rank"] for r in range(3)] == [0, 0, 1]
    # Horovod forwards the launcher's environment, except CUDA_VISIBLE_DEVICES to other hosts.
    assert [reports[r]["env"]["CUDA_VISIBLE_DEVICES"] for r in range(3)] == [None, None, "0"]
    for report in reports.values():
        assert report["sum"] == [3.0, 6.0, 9.0, 12.0]
        assert report["cwd"] == str(tmp_path)
        assert report["env"]["FROM_X"] == "1" and report["env"]["FROM_LAUNCHER"] == "yes"
        assert report["secret_in_argv"] == []
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c[-1].split()[-1] for c in calls].count("hora-check") == 1  # one check per host
    assert sorted(c[-1].split()[-1] for c in calls if "hora-rank" in c[-1]) == [
        "hora-rank=0", "hora-rank=1"]


SHOW_MASK = ("import json, os; print(json.dumps([os.environ['HOROVOD_HOSTNAME'], "
             "sorted(os.sched_getaffinity(0)), os.environ.get('HORA_BOUND_CPUS')]))")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binds two ranks to two cores")
def test_remote_ranks_are_bound_to_their_share_of_that_hosts_cores(fake_path: str) -> None:
    from hora.runner.binding import cpu_list, share

    cores = sorted(os.sched_getaffinity(0))  # the fake host's: this machine's
    with launcher(fake_path, "-np", "3", "-H", "fake1:2,localhost:1", PY, "-c",
                  SHOW_MASK) as job:
        result = job.wait(30)
    assert result.rc == 0, result.err
    got = {r: json.loads(lines[0]) for r, lines in result.lines().items()}
    for rank in (0, 1):  # bound by hora's agent on fake1
        host, mask, named = got[rank]
        assert host == "fake1"
        assert tuple(mask) == share(cores, rank, 2) and named == cpu_list(mask), got
    assert got[2] == ["localhost", cores, None]  # alone on its host: not bound
    with launcher(fake_path, "-np", "2", "-H", "fake1:2", "--cpu-binding", "none", PY, "-c",
                  SHOW_MASK) as job:
        result = job.wait(30)
    assert result.rc == 0, result.err
    assert all(json.loads(lines[0])[1:] == [cores, None] for lines in result.lines().values())


def test_the_agent_and_binding_run_where_hora_is_not_installed(tmp_path: Path) -> None:
    """The loader runs the shipped sources on a Python without hora (``-S``: no site-packages,
    run from a directory without it): a host check, and a rank it binds."""
    check = subprocess.run([PY, "-S", "-c", ssh.LOADER, "hora-check"],
                           input=ssh._request({"check": {}}), capture_output=True,
                           timeout=30, cwd=tmp_path, check=False)
    assert check.returncode == 0, check.stderr
    code = ("import os, sys; sys.stdout.write(repr([sorted(os.sched_getaffinity(0)), "
            "os.environ.get('HORA_BOUND_CPUS')])); sys.stdout.flush()")
    request = ssh.rank_request(argv=[PY, "-S", "-c", code], env={}, cwd=str(tmp_path),
                               grace=1.0, rank=1, host="far", job_id="0123456789abcdef",
                               cpu_share=(1, 2))
    agent = subprocess.Popen([PY, "-S", "-c", ssh.LOADER, "hora-rank=1"], cwd=tmp_path,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    stop = threading.Timer(30, agent.kill)  # the test's bound
    stop.start()
    try:
        assert agent.stdin is not None and agent.stdout is not None
        agent.stdin.write(request)
        agent.stdin.flush()  # kept open (EOF would stop the rank) until the agent exits
        out = agent.stdout.read()  # to EOF: the rank and the agent have exited
        agent.wait()
    finally:
        stop.cancel()
        agent.kill()
        agent.wait()
        for pipe in (agent.stdin, agent.stdout, agent.stderr):
            if pipe is not None:
                pipe.close()
    assert agent.returncode == 0
    cores = sorted(os.sched_getaffinity(0))
    from hora.runner.binding import cpu_list, share

    part = share(cores, 1, 2)
    expected = [list(part), cpu_list(part)] if part else [cores, None]
    assert out.decode() == repr(expected)


def test_uneven_hosts_first_host_smaller(fake_path: str, tmp_path: Path) -> None:
    with launcher(fake_path, "-np", "3", "-H", "localhost:1,fake1:2", "-x",
                  "HORA_TIMEOUT_SECONDS=3", PY, WORKER, "report", str(tmp_path)) as job:
        result = job.wait(30)
    assert result.rc == 0, result.err[-2000:]
    sums = {r: json.loads(lines[0])["sum"] for r, lines in result.lines().items()}
    assert sums == {r: [3.0, 6.0, 9.0, 12.0] for r in range(3)}


def test_every_unreachable_host_is_named_and_nothing_starts(fake_path: str,
                                                            tmp_path: Path) -> None:
    with launcher(fake_path, "-np", "3", "-H", "fake1:1,fake2:1,fake3:1", PY, WORKER, "hold",
                  str(tmp_path), FAKE_SSH_DOWN="fake1,fake3") as job:
        result = job.wait(30)
    assert result.rc == 1
    assert result.hora_messages()[:3] == [
        "error: 2 of 3 remote host(s) cannot run ranks:",
        "  fake1: ssh failed (exit code 255): ssh: connect to host fake1 port 22: Connection "
        "refused",
        "  fake3: ssh failed (exit code 255): ssh: connect to host fake3 port 22: Connection "
        "refused"]
    assert not list(tmp_path.glob("pid.*"))


def test_killed_remote_rank_stops_the_job(fake_path: str, tmp_path: Path) -> None:
    with launcher(fake_path, "-np", "3", "-H", "fake1:2,localhost:1", PY, WORKER, "die",
                  str(tmp_path), "1") as job:
        pids = job.read_pids([tmp_path / f"pid.{r}" for r in (0, 2)], timeout=20)
        bootstrap = parent_of(pids[0])
        result: Result = job.wait(30)
    assert result.rc == 137
    assert "rank 1 of 3 on fake1 exited with code 137; stopping the other 2 rank(s)." in (
        result.hora_messages())
    assert "[hora] rank 1 on fake1 was killed by SIGKILL (9); exit status 137" in (
        result.lines("stderr")[1])
    assert wait_dead([*pids, bootstrap], 3.0) == []


@pytest.mark.parametrize("ignore_term", [False, True])
def test_stopping_the_launcher_stops_remote_ranks(fake_path: str, tmp_path: Path,
                                                  ignore_term: bool) -> None:
    code = ("import os, signal, sys, time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
            + f"p = {str(tmp_path)!r} + '/pid.' + os.environ['HORA_RANK']\n"
            "open(p + '.tmp', 'w').write(f'{os.getpid()}.'); os.replace(p + '.tmp', p)\n"
            "time.sleep(60)\n")
    with launcher(fake_path, "-np", "2", "-H", "fake1:2", PY, "-c", code,
                  grace=1.5 if ignore_term else 0.0) as job:
        pids = job.read_pids([tmp_path / f"pid.{r}" for r in range(2)], timeout=20)
        bootstraps = [parent_of(p) for p in pids]
        assert all(alive(p) for p in bootstraps)
        job.proc.send_signal(signal.SIGTERM)
        result = job.wait(30)
    assert result.rc == 128 + signal.SIGTERM
    assert wait_dead([*pids, *bootstraps], 3.0) == []
    if ignore_term:  # the remote side's grace (0.5 s here) ended in SIGKILL, before the local
        assert result.seconds < 10


def test_remote_rank_leaving_a_child_behind(fake_path: str, tmp_path: Path) -> None:
    child_pid = tmp_path / "child"
    code = ("import subprocess, sys\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(child_pid)!r}, 'w').write(str(p.pid))\n")
    with launcher(fake_path, "-np", "1", "-H", "fake1:1", PY, "-c", code) as job:
        result = job.wait(30)
    assert result.rc == 0, result.err
    assert wait_dead([int(child_pid.read_text())], 8.0) == []


def test_missing_identity_file_or_ssh_client(fake_path: str, tmp_path: Path) -> None:
    with launcher(fake_path, "-np", "1", "-H", "fake1:1", "-i", str(tmp_path / "nokey"),
                  "true") as job:
        result = job.wait(30)
    assert result.rc == 2 and "-i/--ssh-identity-file" in result.err and "no such file" in (
        result.err)
    with launcher(str(tmp_path), "-np", "1", "-H", "fake1:1", "true") as job:
        result = job.wait(30)
    assert result.rc == 2 and "there is no 'ssh' on PATH here" in result.err
