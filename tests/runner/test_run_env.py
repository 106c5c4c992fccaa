"""What every rank finds in its environment when started by ``hora run`` (real processes)."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

from .helpers import Launcher, clean_env, run_hora, wait_dead, worker, write_pid

DUMP_ENV = "import json, os; print(json.dumps(dict(os.environ)))"

IDENTITY = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME")


def rank_envs(*args: str, env: dict[str, str] | None = None) -> dict[int, dict[str, str]]:
    result = run_hora(*args, *worker(DUMP_ENV), env=env)
    assert result.rc == 0, result.err
    lines = result.lines()
    return {rank: json.loads(out[0]) for rank, out in lines.items()}


def test_identity_rendezvous_and_secret_for_np3() -> None:
    launcher_env = clean_env(_HOROVOD_SECRET_KEY="leak", HOROVOD_RANK="99", OLDPWD="/old",
                             HORA_SECRET_KEY="00" * 32, KEEP_ME="yes")
    envs = rank_envs("run", "-np", "3", env=launcher_env)
    assert sorted(envs) == [0, 1, 2]
    secrets = set()
    for rank, env in envs.items():
        expected = {"RANK": rank, "SIZE": 3, "LOCAL_RANK": rank, "LOCAL_SIZE": 3,
                    "CROSS_RANK": 0, "CROSS_SIZE": 1, "HOSTNAME": "localhost"}
        for name in IDENTITY:
            assert env[f"HOROVOD_{name}"] == str(expected[name]), name
            assert env[f"HORA_{name}"] == str(expected[name]), name
        assert env["HORA_RENDEZVOUS_ADDR"] == env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "127.0.0.1"
        assert env["HORA_RENDEZVOUS_PORT"] == env["HOROVOD_GLOO_RENDEZVOUS_PORT"]
        assert 0 < int(env["HORA_RENDEZVOUS_PORT"]) < 65536
        assert env["HOROVOD_CONTROLLER"] == env["HOROVOD_CPU_OPERATIONS"] == "gloo"
        assert env["PYTHONUNBUFFERED"] == "1"
        assert re.fullmatch(r"[0-9a-f]{64}", env["HORA_SECRET_KEY"])
        assert env["HORA_SECRET_KEY"] != "00" * 32  # a fresh per-job secret, not inherited
        assert "_HOROVOD_SECRET_KEY" not in env and "OLDPWD" not in env
        assert env["KEEP_ME"] == "yes"
        secrets.add(env["HORA_SECRET_KEY"])
    assert len(secrets) == 1
    assert len({env["HORA_JOB_ID"] for env in envs.values()}) == 1


def test_two_host_names_give_horovod_local_and_cross_ranks() -> None:
    envs = rank_envs("run", "-np", "4", "-H", "localhost:2,127.0.0.1:2")
    got = [(envs[r]["HOROVOD_HOSTNAME"], envs[r]["HOROVOD_LOCAL_RANK"],
            envs[r]["HOROVOD_LOCAL_SIZE"], envs[r]["HOROVOD_CROSS_RANK"],
            envs[r]["HOROVOD_CROSS_SIZE"]) for r in range(4)]
    assert got == [("localhost", "0", "2", "0", "2"), ("localhost", "1", "2", "0", "2"),
                   ("127.0.0.1", "0", "2", "1", "2"), ("127.0.0.1", "1", "2", "1", "2")]


def test_np_below_the_slots_starts_np_ranks(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# this machine\nlocalhost slots=4\n")
    envs = rank_envs("run", "-np", "2", "-hostfile", str(hostfile))
    assert sorted(envs) == [0, 1]
    assert envs[1]["HOROVOD_LOCAL_SIZE"] == "2"


def test_generated_tunable_flags_export_hora_variables() -> None:
    env = clean_env(FORWARD_ME="from-launcher")
    envs = rank_envs("run", "-np", "1", "--fusion-threshold-mb", "2", "--cycle-time-ms", "1.5",
                     "--no-stall-check", "--hierarchical-allreduce", "--log-level", "DEBUG",
                     "--log-without-timestamp", "--start-timeout", "7", "--tcp",
                     "-x", "FOO=bar=baz", "-x", "FORWARD_ME", env=env)
    got = envs[0]
    assert got["HORA_FUSION_THRESHOLD"] == "2097152"
    assert got["HORA_CYCLE_TIME"] == "1.5"
    assert got["HORA_STALL_CHECK_DISABLE"] == "1"
    assert got["HORA_HIERARCHICAL_ALLREDUCE"] == "1"
    assert got["HORA_LOG_LEVEL"] == "debug"
    assert got["HORA_LOG_HIDE_TIME"] == "1"
    assert got["HORA_START_TIMEOUT"] == "7.0"
    assert got["NCCL_IB_DISABLE"] == "1"
    assert got["FOO"] == "bar=baz"
    assert got["FORWARD_ME"] == "from-launcher"
    # Only what was asked for is exported, and only under hora's names.
    assert "HORA_CACHE_CAPACITY" not in got
    assert "HOROVOD_FUSION_THRESHOLD" not in got


def test_secret_is_in_the_environment_only_never_in_argv(tmp_path: Path) -> None:
    code = write_pid(f"{str(tmp_path)!r} + '/pid.' + os.environ['HORA_RANK']") + \
        "; import time; time.sleep(60)"
    with Launcher("run", "-np", "2", "--verbose", *worker(code)) as launcher:
        pids = launcher.read_pids([tmp_path / "pid.0", tmp_path / "pid.1"])
        environ = Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0")
        secret = next(v.split(b"=", 1)[1] for v in environ if v.startswith(b"HORA_SECRET_KEY="))
        assert len(secret) == 64
        for pid in [launcher.proc.pid, *pids]:
            assert secret not in Path(f"/proc/{pid}/cmdline").read_bytes()
        launcher_env = Path(f"/proc/{launcher.proc.pid}/environ").read_bytes()
        assert b"HORA_SECRET_KEY" not in launcher_env
        launcher.proc.send_signal(signal.SIGTERM)
        result = launcher.wait(15)
    assert result.rc == 128 + signal.SIGTERM
    assert secret.decode() not in result.err + result.out  # --verbose never prints it
    assert "HORA_RENDEZVOUS_PORT=" in result.err
    assert wait_dead(pids, 2.0) == []


def test_ranks_reach_the_launchers_rendezvous_store() -> None:
    code = (
        "import os; from hora.rendezvous.store_client import KVStoreClient\n"
        "e = os.environ; r = int(e['HORA_RANK'])\n"
        "c = KVStoreClient(e['HORA_RENDEZVOUS_ADDR'], int(e['HORA_RENDEZVOUS_PORT']),"
        " bytes.fromhex(e['HORA_SECRET_KEY']), timeout=10)\n"
        "c.set('test', str(r), b'hello from %d' % r)\n"
        "print(c.get('test', str(1 - r), timeout=10).decode())\n"
    )
    result = run_hora("run", "-np", "2", *worker(code))
    assert result.rc == 0, result.err
    assert result.lines() == {0: ["hello from 1"], 1: ["hello from 0"]}
