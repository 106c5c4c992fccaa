"""The Spark task side of :func:`hora.spark.run`: one task starts, watches and reports one rank.

Launcher layer (like :mod:`hora.runner`): imports base, rendezvous and runner modules only; it
never loads the engine. Every task of the barrier stage :func:`hora.spark.run` submits runs
:func:`task_main` with the same :class:`TaskPlan` (pickled into the stage's closure, so the job
secret travels inside Spark's task data, never on a command line or in Spark's configuration).
A task:

1. connects to the driver's store (:data:`SCOPE` holds the Spark-specific keys below) and counts
   itself in ``started``;
2. learns every task's host through the store and derives the ranks
   (:func:`assign_ranks`: each host's tasks get consecutive ranks, partition 0 is rank 0) and the
   local / cross ranks (:func:`hora.rendezvous.topology.compute_topology`);
3. starts its rank as a **fresh process**, ``python -m hora.runner.run_func`` — the rank side of
   :func:`hora.run`, which fetches ``(fn, args, kwargs)`` from the store, calls ``fn`` and
   stores its result or exception there — with the identity (``HOROVOD_RANK`` ...), rendezvous
   and secret variables in its environment (a Spark Python worker is reused across tasks: the
   rank must not leave an engine, threads or variables behind in it);
4. relays the rank's output (to the task's own stdout / stderr, i.e. the executor's log, or to
   the driver through the store when ``run`` was given ``stdout`` / ``stderr``);
5. stops the rank when ``stop`` appears in the store (another rank failed, or the driver gave
   up), and reports its exit under ``exit.<rank>``. A task whose rank failed sets ``stop``,
   waits (bounded) until every task has finished, then raises, so the barrier stage fails and
   Spark aborts the job rather than retrying it.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hora._util import shm_owners
from hora._util.log import get_logger
from hora._util.net import local_hostname
from hora.errors import HoraError
from hora.rendezvous.store_client import KVStoreClient
from hora.rendezvous.topology import Slot, compute_topology, identity_environment
from hora.runner import run_func
from hora.runner.launch import SECRET_VAR, forwardable_environment
from hora.runner.output import CONSOLE, Console
from hora.runner.processes import GRACE_PERIOD_S, RankLaunch, StartError, spawn, stop_workers

log = get_logger(__name__)

SCOPE = "hora.spark"
"""Store scope of the keys the tasks and the driver share (``run_func`` uses its own scope)."""
STARTED = "started"
"""Counter: tasks that reached the store."""
FINISHED = "finished"
"""Counter: tasks whose rank has exited."""
FAILED = "failed"
"""Counter: gives each failed rank's ``exit.<rank>`` record its order (``seq``)."""
HOSTS = "hosts"
"""Every task's host in partition order (JSON), published by the task of partition 0."""
STOP = "stop"
"""Set (to a reason) when every rank must stop: a rank failed, or the driver gave up."""
POLL_S = 0.25
"""How often a task checks for ``stop`` while its rank runs."""
RELAY_JOIN_S = 5.0
"""How long a task waits for the last output of its rank after the rank exited."""


def exit_key(rank: int) -> str:
    """The key of rank ``rank``'s exit report (JSON)."""
    return f"exit.{rank}"


@dataclass(frozen=True)
class TaskPlan:
    """What every task of one :func:`hora.spark.run` call needs; pickled into the Spark stage.

    Attributes:
        store_host: address of the driver's store (reachable from the executors).
        store_port: its port.
        secret: the job secret: authenticates the store and every rank connection. Excluded
            from ``repr``.
        num_proc: number of ranks (= Spark tasks).
        env: variables for every rank on top of the executor's environment (launcher defaults,
            ``run``'s ``env``, tunables); identity, rendezvous and secret variables are added by
            the task.
        job_id: ``HORA_JOB_ID`` (names the job's shared-memory segments).
        executable: the Python that runs a rank; empty: the Spark worker's own
            (``sys.executable`` in the task).
        start_timeout: seconds a task may take to reach the store.
        relay: streams (``"stdout"``, ``"stderr"``) whose rank output goes to the driver through
            the store instead of the executor's log.
        prefix_timestamp: put a time stamp before each relayed line.
    """

    store_host: str
    store_port: int
    secret: bytes = field(repr=False)
    num_proc: int
    env: Mapping[str, str]
    job_id: str
    executable: str = ""
    start_timeout: float = 600.0
    relay: frozenset[str] = frozenset()
    prefix_timestamp: bool = False


def assign_ranks(hosts: Sequence[str]) -> list[int]:
    """The rank of each partition, given the host each partition's task runs on.

    Hosts are ordered by their lowest partition, and a host's partitions get consecutive ranks in
    partition order (Horovod groups a host's tasks the same way), so partition 0 is always rank
    0 and, when every task runs on one host, rank == partition.
    """
    first: dict[str, int] = {}
    for partition, host in enumerate(hosts):
        first.setdefault(host, partition)
    order = sorted(range(len(hosts)), key=lambda p: (first[hosts[p]], p))
    ranks = [0] * len(hosts)
    for rank, partition in enumerate(order):
        ranks[partition] = rank
    return ranks


def rank_environment(plan: TaskPlan, slot: Slot, base: Mapping[str, str]) -> dict[str, str]:
    """The complete environment of the rank in ``slot``: ``base`` (the executor's, less what is
    never forwarded), ``plan.env``, rendezvous, identity, the secret and ``run_func``'s store."""
    host = plan.store_host
    store = f"[{host}]:{plan.store_port}" if ":" in host else f"{host}:{plan.store_port}"
    return {**forwardable_environment(base), **plan.env,
            "HORA_RENDEZVOUS_ADDR": host, "HORA_RENDEZVOUS_PORT": str(plan.store_port),
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": host,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(plan.store_port),
            "HORA_JOB_ID": plan.job_id, **identity_environment(slot),
            SECRET_VAR: plan.secret.hex(),
            run_func.STORE_VAR: store, run_func.SECRET_VAR: plan.secret.hex()}


class _StoreConsole(Console):
    """Sends the relayed lines of some streams to the driver through the store (``out.<n>``
    records, numbered by the ``out.n`` counter); the other streams go to ``fallback``."""

    def __init__(self, client: KVStoreClient, relayed: frozenset[str],
                 fallback: Console) -> None:
        super().__init__()
        self._client = client
        self._relayed = relayed
        self._fallback = fallback

    def write(self, stream: str, text: str) -> bool:
        if stream not in self._relayed:
            return self._fallback.write(stream, text)
        tag = b"o" if stream == "stdout" else b"e"
        try:
            seq = self._client.add(SCOPE, OUT_COUNTER, 1)
            self._client.set(SCOPE, out_key(seq), tag + text.encode("utf-8", "replace"))
        except HoraError:
            return self._fallback.write(stream, text)  # the driver is gone: keep it in the log
        return True


OUT_COUNTER = "out.n"


def out_key(seq: int) -> str:
    """The key of the ``seq``-th relayed output record (1-based)."""
    return f"out.{seq}"


def _connect(plan: TaskPlan, partition: int) -> KVStoreClient:
    try:
        return KVStoreClient(plan.store_host, plan.store_port, plan.secret,
                             timeout=min(plan.start_timeout, 60.0))
    except HoraError as exc:
        raise RuntimeError(
            f"hora.spark.run: the Spark task of partition {partition} on {local_hostname()} "
            f"cannot reach the driver's store at {plan.store_host}:{plan.store_port}: {exc}. "
            "HINT: pass nics=['<interface>'] naming a network interface the driver and the "
            "executors share, or set spark.driver.host to an address the executors can reach."
        ) from exc


def _exchange_hosts(client: KVStoreClient, partition: int, plan: TaskPlan) -> list[str]:
    """Every task's host, by partition, through the store: each task publishes its own, the
    task of partition 0 gathers them into one list that the others read (O(tasks) requests;
    Spark's ``allGather`` costs about a second). The host is ``HORA_HOSTNAME`` when the
    executor's environment sets it, else the OS host name."""
    host = os.environ.get("HORA_HOSTNAME", "").strip() or local_hostname()
    client.set(SCOPE, f"host.{partition}", host.encode())
    if partition == 0:
        found = client.wait(SCOPE, [f"host.{p}" for p in range(plan.num_proc)],
                            plan.start_timeout)
        client.set(SCOPE, HOSTS, json.dumps(
            [found[f"host.{p}"].decode() for p in range(plan.num_proc)]).encode())
    hosts: list[str] = json.loads(client.get(SCOPE, HOSTS, plan.start_timeout))
    return hosts


def _report_exit(client: KVStoreClient, slot: Slot, code: int, *, stopped: bool,
                 tail: Iterable[str] = (), start_error: str = "") -> None:
    record: dict[str, Any] = {"rank": slot.rank, "size": slot.size, "host": slot.hostname,
                              "returncode": code, "stopped": stopped, "tail": list(tail),
                              "start_error": start_error}
    if code != 0 and not stopped:
        record["seq"] = client.add(SCOPE, FAILED, 1)
        client.set(SCOPE, STOP, f"rank {slot.rank} failed".encode())
    client.set(SCOPE, exit_key(slot.rank), json.dumps(record).encode())
    client.add(SCOPE, FINISHED, 1)


def _wait_for_others(client: KVStoreClient, num_proc: int, limit: float) -> None:
    """Until every task has finished its rank (they stop theirs on ``stop``), at most ``limit``
    seconds: Spark kills the tasks that are left when this one fails."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if client.add(SCOPE, FINISHED, 0) >= num_proc:
            return
        time.sleep(POLL_S / 2)


def _supervise(plan: TaskPlan, slot: Slot, client: KVStoreClient,
               console: Console) -> tuple[int, bool]:
    """Run the rank in ``slot`` to its end; returns its exit code (negative: a signal) and
    whether this task stopped it (on ``stop``)."""
    executable = plan.executable or sys.executable
    env = rank_environment(plan, slot, os.environ)
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    try:
        worker = spawn((executable, "-m", run_func.__name__), RankLaunch(slot, env), slot.rank,
                       size=slot.size, exits=exits, console=console,
                       prefix_timestamp=plan.prefix_timestamp)
    except StartError as exc:
        _report_exit(client, slot, exc.failure.returncode, stopped=False,
                     start_error=exc.message)
        raise RuntimeError(f"hora.spark.run: {exc.message}") from None
    stopped = False
    try:
        while True:
            try:
                _, code = exits.get(timeout=POLL_S)
                break
            except queue.Empty:
                pass
            if not stopped and not client.missing(SCOPE, [STOP]):
                stopped = True
                log.info("rank %d: stopping (%s)", slot.rank,
                         client.get(SCOPE, STOP, 0).decode())
                stop_workers([worker], console)
    except BaseException:  # the driver's store went away, or the task is being torn down
        stop_workers([worker], console)
        raise
    for relay in worker.relays:
        relay.join(RELAY_JOIN_S)
    shm_owners.sweep()  # this rank's segments, if it died without removing them
    _report_exit(client, slot, code, stopped=stopped, tail=worker.tail)
    return code, stopped


def task_main(plan: TaskPlan, _rows: Iterator[Any]) -> Iterator[tuple[int, int, int]]:
    """The function of every barrier task (``mapPartitions``): yields one
    ``(rank, partition, exit code)``.

    Raises:
        RuntimeError: the store is unreachable, the rank could not start, or the rank failed
            (after the other tasks stopped theirs): the barrier stage fails and Spark ends the
            job; the driver then raises the rank's own error from the store.
    """
    from pyspark import BarrierTaskContext

    partition = BarrierTaskContext.get().partitionId()
    with _connect(plan, partition) as client:
        client.add(SCOPE, STARTED, 1)
        hosts = _exchange_hosts(client, partition, plan)
        ranks = assign_ranks(hosts)
        in_rank_order = [""] * len(hosts)
        for p, r in enumerate(ranks):
            in_rank_order[r] = hosts[p]
        slot = compute_topology(in_rank_order)[ranks[partition]]
        console: Console = CONSOLE
        if plan.relay:
            console = _StoreConsole(client, plan.relay, CONSOLE)
        code, stopped = _supervise(plan, slot, client, console)
        if code != 0 and not stopped:
            _wait_for_others(client, plan.num_proc, GRACE_PERIOD_S + 5.0)
            raise RuntimeError(f"hora.spark.run: rank {slot.rank} of {slot.size} on "
                               f"{slot.hostname} failed (exit status {code}); the driver "
                               "raises its error")
    yield slot.rank, partition, code


__all__ = ["TaskPlan", "assign_ranks", "exit_key", "out_key", "rank_environment", "task_main"]
