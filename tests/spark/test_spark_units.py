"""hora.spark without Spark: rank assignment, slot counting, argument checks, the store address,
the rank environment, the output relay and the outcome rules (a real store, no JVM)."""

from __future__ import annotations

import io
import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import hora.spark
from hora.errors import ConfigError, RankFailedError
from hora.rendezvous.kvstore import KVStoreServer
from hora.rendezvous.store_client import KVStoreClient
from hora.rendezvous.topology import compute_topology
from hora.runner import run_func as proto
from hora.runner.api import RemoteTraceback
from hora.runner.output import Console
from hora.spark import outcome, runner, task


def test_ranks_group_each_hosts_tasks_and_keep_partition_0_first() -> None:
    assert task.assign_ranks(["a", "a", "a"]) == [0, 1, 2]
    assert task.assign_ranks(["a", "b", "a", "b"]) == [0, 2, 1, 3]
    assert task.assign_ranks(["b", "a", "a", "b"]) == [0, 2, 3, 1]
    ranks = task.assign_ranks(["x", "y", "x"])
    hosts = [""] * 3
    for partition, rank in enumerate(ranks):
        hosts[rank] = ["x", "y", "x"][partition]
    slots = compute_topology(hosts)
    assert [(s.hostname, s.local_rank, s.cross_rank) for s in slots] == [
        ("x", 0, 0), ("x", 1, 0), ("y", 0, 1)]


@pytest.mark.parametrize(("master", "cpus", "slots"), [
    ("local", 1, 1), ("local[4]", 1, 4), ("local[4,3]", 1, 4), ("local[4]", 2, 2),
    ("local-cluster[2,3,1024]", 1, 6), ("spark://head:7077", 1, None), ("yarn", 1, None)])
def test_local_masters_have_a_known_number_of_slots(master: str, cpus: int,
                                                    slots: int | None) -> None:
    assert runner.local_slots(master, cpus) == slots


def test_local_star_counts_this_machines_cores() -> None:
    import os

    assert runner.local_slots("local[*]", 1) == os.cpu_count()


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"fn": 42}, TypeError, "fn must be callable"),
    ({"num_proc": 0}, ConfigError, "num_proc must be >= 1"),
    ({"num_proc": 2.0}, TypeError, "num_proc must be an int"),
    ({"use_mpi": True}, ConfigError, "use_mpi=True is not available"),
    ({"use_mpi": False, "use_gloo": False}, ConfigError, "leave no controller"),
    ({"env": {"A": 1}}, TypeError, "env must be a dict of str to str"),
    ({"stdout": "out.txt"}, TypeError, "stdout must be a text stream"),
])
def test_bad_arguments_fail_before_spark_is_touched(kwargs: dict[str, Any], error: type,
                                                    match: str) -> None:
    call = {"fn": len, **kwargs}
    with pytest.raises(error, match=match):
        hora.spark.run(**call)


def test_nics_accept_a_string_a_list_or_a_set() -> None:
    assert runner._nic_list(None) == []
    assert runner._nic_list("eth0, eth1") == ["eth0", "eth1"]
    assert runner._nic_list({"eth1", "eth0"}) == ["eth0", "eth1"]
    assert runner._nic_list(["ib0", "eth0", "ib0"]) == ["ib0", "eth0"]


class _Conf:
    def __init__(self, values: dict[str, str]) -> None:
        self._values = values

    def get(self, key: str, default: str | None = None) -> str | None:
        return self._values.get(key, default)


class _Context:
    def __init__(self, master: str, **conf: str) -> None:
        self.master = master
        self._conf = _Conf(conf)

    def getConf(self) -> _Conf:  # noqa: N802 (pyspark's name)
        return self._conf


def test_the_store_listens_where_the_executors_reach_the_driver() -> None:
    assert runner._store_address(_Context("local[2]"), [])[0] == "127.0.0.1"
    address, why = runner._store_address(
        _Context("spark://head:7077", **{"spark.driver.host": "192.0.2.77"}), [])
    assert address == "192.0.2.77" and "spark.driver.host" in why
    with pytest.raises(ConfigError, match="spark.driver.host is '127.0.0.1'.*nics="):
        runner._store_address(_Context("yarn", **{"spark.driver.host": "127.0.0.1"}), [])
    assert runner._store_address(_Context("local[2]"), ["lo"])[0] == "127.0.0.1"


def _plan(**overrides: Any) -> task.TaskPlan:
    values: dict[str, Any] = {"store_host": "127.0.0.1", "store_port": 4242,
                              "secret": bytes(range(32)), "num_proc": 2,
                              "env": {"HORA_LAUNCHER": "hora.spark.run", "MY": "1"},
                              "job_id": "abcd1234abcd1234"}
    values.update(overrides)
    return task.TaskPlan(**values)


def test_a_rank_gets_identity_rendezvous_and_secret_over_its_executors_environment() -> None:
    slot = compute_topology(["h", "h"])[1]
    env = task.rank_environment(_plan(), slot, {"PATH": "/bin", "HOROVOD_RANK": "9",
                                                "BASH_FUNC_x%%": "() { :; }"})
    assert env["PATH"] == "/bin" and env["MY"] == "1" and "BASH_FUNC_x%%" not in env
    assert (env["HOROVOD_RANK"], env["HORA_SIZE"], env["HORA_LOCAL_RANK"]) == ("1", "2", "1")
    assert (env["HORA_RENDEZVOUS_ADDR"], env["HORA_RENDEZVOUS_PORT"]) == ("127.0.0.1", "4242")
    assert env["HORA_SECRET_KEY"] == bytes(range(32)).hex() == env[proto.SECRET_VAR]
    assert env[proto.STORE_VAR] == "127.0.0.1:4242" and env["HORA_JOB_ID"] == "abcd1234abcd1234"
    assert "secret" not in repr(_plan())  # a logged plan shows no secret


@pytest.fixture
def store() -> Iterator[tuple[KVStoreServer, bytes]]:
    secret = secrets.token_bytes(32)
    with KVStoreServer(secret, "127.0.0.1", 0) as server:
        yield server, secret


def _client(store: tuple[KVStoreServer, bytes]) -> KVStoreClient:
    server, secret = store
    return KVStoreClient(server.host, server.port, secret, timeout=5.0)


class _Recorder(Console):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[str, str]] = []

    def write(self, stream: str, text: str) -> bool:
        self.lines.append((stream, text))
        return True


def test_relayed_output_reaches_the_driver_streams_in_order(
        store: tuple[KVStoreServer, bytes]) -> None:
    out, err, local = io.StringIO(), io.StringIO(), _Recorder()
    with _client(store) as sender:
        console = task._StoreConsole(sender, frozenset({"stdout", "stderr"}), local)
        reader = outcome.OutputReader(_client(store), out, None)
        reader.start()
        for i in range(50):
            assert console.write("stdout", f"[0]<stdout>:line {i}\n")
        console.write("stderr", "[1]<stderr>:dropped: no stderr stream on the driver\n")
        quiet = task._StoreConsole(sender, frozenset({"stdout"}), local)
        quiet.write("stderr", "[1]<stderr>:stays on the executor\n")
        reader.finish()
    assert out.getvalue() == "".join(f"[0]<stdout>:line {i}\n" for i in range(50))
    assert err.getvalue() == ""
    assert local.lines == [("stderr", "[1]<stderr>:stays on the executor\n")]


def _exit_report(client: KVStoreClient, rank: int, code: int, *, seq: int | None) -> None:
    record: dict[str, Any] = {"rank": rank, "size": 2, "host": "h", "returncode": code,
                              "tail": ["Fatal Python error: Aborted"], "stopped": seq is None}
    if seq is not None:
        record["seq"] = seq
    client.set(task.SCOPE, task.exit_key(rank), json.dumps(record).encode())


def test_results_come_back_in_rank_order(store: tuple[KVStoreServer, bytes]) -> None:
    with _client(store) as client:
        for rank in (1, 0):
            proto.put_blob(client, proto.record_key(rank), proto.dumps({"rank": rank}),
                           {"kind": "result"})
        assert outcome.results_or_raise(client, 2, None) == [{"rank": 0}, {"rank": 1}]


def test_the_first_failure_decides_the_error(store: tuple[KVStoreServer, bytes]) -> None:
    with _client(store) as client:
        try:
            raise KeyError("the real cause")
        except KeyError as exc:
            header, payload = proto.error_record(exc, 1)
        proto.put_blob(client, proto.record_key(1), payload, {**header, "seq": 2})
        _exit_report(client, 1, 1, seq=2)
        # rank 0 died by a signal first, without a record: it is the root cause
        _exit_report(client, 0, -6, seq=1)
        with pytest.raises(RankFailedError, match="rank 0 of 2 on h was killed by signal "
                                                  "SIGABRT.*Fatal Python error") as info:
            outcome.results_or_raise(client, 2, None)
        assert (info.value.rank, info.value.exit_status) == (0, 134)
        # without it, the exception rank 1 stored is raised with its own type
        client.delete(task.SCOPE, task.exit_key(0))
        with pytest.raises(KeyError, match="the real cause") as raised:
            outcome.results_or_raise(client, 2, RuntimeError("Spark's own error"))
        assert isinstance(raised.value.__cause__, RemoteTraceback)
        assert raised.value.__cause__.rank == 1


def test_a_spark_failure_without_a_rank_record_quotes_spark(
        store: tuple[KVStoreServer, bytes]) -> None:
    spark_text = ("An error occurred while calling collectAndServe.\n"
                  ": org.apache.spark.SparkException: Job aborted due to stage failure: ...\n"
                  "Traceback (most recent call last):\n  File \"worker.py\", line 1\n"
                  "ModuleNotFoundError: No module named 'hora'\n")
    with _client(store) as client, pytest.raises(hora.spark.SparkJobError,
                       match="No module named 'hora'.*HINT: the executors' Python"):
        outcome.results_or_raise(client, 2, RuntimeError(spark_text))
    assert outcome.spark_reason(RuntimeError("x\n: org.apache.spark.SparkException: Job 3 "
                                             "cancelled\nmore")).startswith(": org.apache")


def test_importing_hora_spark_loads_neither_pyspark_nor_the_engine() -> None:
    code = ("import sys, hora.spark; print(sorted(m for m in sys.modules if m.startswith("
            "('pyspark', 'py4j', 'hora.core', 'hora.transports', 'numpy'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == "[]", out
