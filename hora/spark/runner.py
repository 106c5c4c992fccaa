"""``hora.spark.run``: Horovod's ``horovod.spark.run`` — one rank per Spark task.

Launcher layer (like :mod:`hora.runner`): the driver imports base, rendezvous and runner modules
and pyspark, never the engine; the function it ships may of course call ``hora.init()``.

How a job runs
--------------

The driver serves one authenticated key-value store
(:class:`~hora.rendezvous.kvstore.KVStoreServer`, a fresh 32-byte secret) for the call: the
ranks' rendezvous store *and* the store of :func:`hora.run`'s protocol
(:mod:`hora.runner.run_func`), where ``(fn, args, kwargs)`` wait for the ranks and each rank
leaves its result or its exception. It then submits a barrier stage of ``num_proc`` tasks
(``rdd.barrier().mapPartitions``: Spark starts all of them together or none), each running
:func:`hora.spark.task.task_main`, which starts and watches one rank in a fresh process. The
secret travels inside the stage's pickled closure, never on a command line or in Spark's
configuration. When the stage ends, the results come from the store in rank order; a failed
rank's exception is raised here with its own type and rank (the first failure, as with
:func:`hora.run`).
"""

from __future__ import annotations

import functools
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import IO, Any

from hora._util.log import get_logger
from hora._util.net import interface_address, interface_names, is_loopback
from hora.errors import ConfigError
from hora.rendezvous.kvstore import KVStoreServer
from hora.rendezvous.store_client import KVStoreClient
from hora.runner import network
from hora.runner import run_func as proto
from hora.runner.launch import LaunchSpec, forwardable_environment, launcher_variables, validate
from hora.spark.outcome import OutputReader, results_or_raise
from hora.spark.task import SCOPE, STARTED, STOP, TaskPlan, task_main

log = get_logger(__name__)

DEFAULT_START_TIMEOUT_S = 600.0
"""Horovod's default when neither ``start_timeout`` nor ``HOROVOD_SPARK_START_TIMEOUT`` is set."""
CANCEL_WAIT_S = 30.0
"""How long the driver waits for Spark to end a job it cancelled."""

_TIMEOUT_MESSAGE = (
    "Timed out waiting for Spark tasks to start. Please check that you have enough resources to "
    "run all Horovod processes. Each Horovod process runs in a Spark task. You may need to "
    "increase the start_timeout parameter to a larger value if your Spark resources are "
    "allocated on-demand.")


def _active_context() -> Any:
    try:
        import pyspark
    except ImportError:
        raise ImportError("hora.spark.run needs pyspark: pip install pyspark (and a Java "
                          "runtime for Spark)") from None
    context = pyspark.SparkContext._active_spark_context
    if context is None:
        raise RuntimeError("Could not find an active SparkContext, are you running in a PySpark "
                           "session? HINT: create one first, e.g. "
                           "SparkSession.builder.master('local[2]').getOrCreate().")
    return context


def _check_arguments(fn: Any, num_proc: Any, env: Any, use_mpi: bool | None,
                     use_gloo: bool | None, streams: Mapping[str, Any]) -> None:
    if not callable(fn):
        raise TypeError(f"hora.spark.run: fn must be callable, not {type(fn).__name__}")
    if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int)):
        raise TypeError(f"hora.spark.run: num_proc must be an int, not {type(num_proc).__name__}")
    if num_proc is not None and num_proc < 1:
        raise ConfigError(f"hora.spark.run: num_proc must be >= 1, not {num_proc}")
    if env is not None and (not isinstance(env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise TypeError("hora.spark.run: env must be a dict of str to str (variables for every "
                        "rank on top of the executor's environment)")
    if use_mpi:
        raise ConfigError("hora.spark.run: use_mpi=True is not available: hora starts the ranks "
                          "itself and runs its own engine (Horovod's gloo mode); leave use_mpi "
                          "unset.")
    if use_gloo is False and use_mpi is False:
        raise ConfigError("hora.spark.run: use_gloo=False and use_mpi=False leave no controller; "
                          "hora has one (its own engine, started like Horovod's gloo mode)")
    for name, stream in streams.items():
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise TypeError(f"hora.spark.run: {name} must be a text stream (with write()), not "
                            f"{type(stream).__name__}")


def _nic_list(nics: str | Collection[str] | None) -> list[str]:
    if nics is None:
        return []
    if isinstance(nics, str):
        items = [nics]
    else:
        items = sorted(nics) if isinstance(nics, (set, frozenset)) else list(nics)
    return list(dict.fromkeys(n.strip() for item in items for n in item.split(",") if n.strip()))


def local_slots(master: str, task_cpus: int) -> int | None:
    """Task slots of a local master (``local``, ``local[4]``, ``local[*]``, ``local[4,2]``,
    ``local-cluster[2,1,1024]``), or None for a cluster master."""
    if master == "local":
        return 1
    for prefix in ("local[", "local-cluster["):
        if master.startswith(prefix) and master.endswith("]"):
            parts = [p.strip() for p in master[len(prefix):-1].split(",")]
            if prefix == "local-cluster[":
                cores = int(parts[0]) * int(parts[1]) if len(parts) >= 2 else 0
            else:
                cores = os.cpu_count() or 1 if parts[0] == "*" else int(parts[0])
            return max(cores // max(task_cpus, 1), 0)
    return None


def _store_address(context: Any, nics: list[str]) -> tuple[str, str]:
    """Where the driver's store listens, and why.

    Raises:
        ConfigError: a cluster master whose ``spark.driver.host`` is a loopback address.
    """
    local = str(context.master).startswith("local")
    if nics and nics[0] in interface_names():
        address = interface_address(nics[0])
        if not (is_loopback(address) and not local):
            return address, f"the driver's address on {nics[0]} (nics)"
    if local:
        return network.LOOPBACK, "Spark runs in local mode: every task is on this host"
    host = context.getConf().get("spark.driver.host") or ""
    address = network.resolve(host) if host else ""
    if not address or is_loopback(address):
        raise ConfigError(
            f"hora.spark.run: spark.driver.host is {host!r}, which the executors on other hosts "
            "cannot reach, so they could not reach hora's store on this driver either. HINT: set "
            "spark.driver.host to this machine's address on the executors' network, or pass "
            "nics=['<interface>'] naming an interface the driver and the executors share.")
    return address, f"spark.driver.host ({host}), where the executors reach the driver"


def _start_timeout(start_timeout: float | None) -> float:
    if start_timeout is not None:
        return float(start_timeout)
    raw = os.environ.get("HOROVOD_SPARK_START_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_START_TIMEOUT_S
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"HOROVOD_SPARK_START_TIMEOUT={raw!r} is not a number of seconds") \
            from None


def _rank_variables(num_proc: int, env: Mapping[str, str] | None, nics: list[str],
                    start_timeout: float, verbose: int, python: str) -> dict[str, str]:
    """Variables every rank gets on top of its executor's environment (checked here, so that a
    bad ``HORA_*`` setting is one error now rather than one per rank later)."""
    extra = dict(env or {})
    if nics:
        extra.setdefault("HORA_GLOO_IFACE", nics[0])
        extra.setdefault("NCCL_SOCKET_IFNAME", ",".join(nics))
    spec = LaunchSpec(np=num_proc, command=(python, "-m", proto.__name__), env=extra,
                      verbose=verbose >= 2, start_timeout=start_timeout)
    own = launcher_variables(spec, {})  # executors do not inherit the driver's environment
    own["HORA_LAUNCHER"] = "hora.spark.run"
    own.pop("HORA_LAUNCHER_PID", None)  # the driver's pid means nothing on an executor
    validate(spec, {**forwardable_environment(os.environ), **own})
    return own


class _Job:
    """The Spark job of one call, run in a thread (``collect`` blocks) so that the caller's
    thread can time out the start, or stop it on Ctrl-C."""

    def __init__(self, context: Any, plan: TaskPlan, group: str) -> None:
        self._context = context
        self._plan = plan
        self.group = group
        self.error: BaseException | None = None
        self.statuses: list[Any] = []
        self.thread = threading.Thread(target=self._run, name="hora-spark-job", daemon=True)

    def _run(self) -> None:
        try:
            self._context.setJobGroup(self.group, f"hora.spark.run: {self._plan.num_proc} ranks",
                                      interruptOnCancel=True)
            rdd = self._context.parallelize(range(self._plan.num_proc), self._plan.num_proc)
            self.statuses = rdd.barrier().mapPartitions(
                functools.partial(task_main, self._plan)).collect()
        except BaseException as exc:  # noqa: BLE001 (reported by the caller's thread)
            self.error = exc

    def cancel(self, client: KVStoreClient, reason: str) -> None:
        """Tell every task to stop its rank, cancel the Spark job, wait for it to end."""
        try:
            client.set(SCOPE, STOP, reason.encode())
        finally:
            self._context.cancelJobGroup(self.group)
            self.thread.join(CANCEL_WAIT_S)


def _watch(job: _Job, client: KVStoreClient, num_proc: int, start_timeout: float) -> None:
    """Until the job ends; cancels it when its tasks have not all started in time.

    Raises:
        TimeoutError: not every task started within ``start_timeout`` (Horovod's message).
        KeyboardInterrupt: after stopping the job.
    """
    deadline = time.monotonic() + start_timeout
    started = 0
    try:
        while job.thread.is_alive():
            job.thread.join(0.1)
            if started < num_proc and job.thread.is_alive():
                started = client.add(SCOPE, STARTED, 0)
                if started < num_proc and time.monotonic() > deadline:
                    job.cancel(client, "the Spark tasks did not all start in time")
                    raise TimeoutError(f"{_TIMEOUT_MESSAGE} ({started} of {num_proc} tasks "
                                       f"started within {start_timeout:g} s.)")
    except KeyboardInterrupt:
        job.cancel(client, "the driver was interrupted")
        raise


def run(fn: Callable[..., Any], args: tuple[Any, ...] | list[Any] = (),
        kwargs: Mapping[str, Any] | None = None, num_proc: int | None = None,
        start_timeout: float | None = None, use_mpi: bool | None = None,
        use_gloo: bool | None = None, extra_mpi_args: str | None = None,
        env: Mapping[str, str] | None = None, stdout: IO[str] | None = None,
        stderr: IO[str] | None = None, verbose: int = 1,
        nics: str | Collection[str] | None = None, prefix_output_with_timestamp: bool = False,
        executable: str | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``num_proc`` ranks, one per Spark task; return the results.

    Horovod's ``horovod.spark.run``, same arguments. Needs an active ``SparkContext`` (a
    ``SparkSession``); the tasks run in one barrier stage, so Spark starts all of them together.
    Every task starts its rank as a fresh Python process on its executor (``fn`` usually calls
    ``hora.init()``; ranks on one host use shared memory). ``fn``, ``args`` and ``kwargs`` are
    pickled with cloudpickle and travel through the driver's authenticated store, as do the
    results; nothing secret is put on a command line or in Spark's configuration.

    Args:
        fn: the function every rank calls.
        args: positional arguments for ``fn``.
        kwargs: keyword arguments for ``fn``.
        num_proc: number of ranks (default: ``spark.default.parallelism``, the context's
            ``defaultParallelism``). A local master must have that many task slots.
        start_timeout: seconds for every Spark task to start (default
            ``HOROVOD_SPARK_START_TIMEOUT``, else 600); also the ranks' ``HORA_START_TIMEOUT``.
        use_mpi: True raises ConfigError (hora has no mpirun mode); None/False are accepted.
        use_gloo: accepted: hora's engine starts like Horovod's gloo mode.
        extra_mpi_args: accepted and ignored (logged): there is no mpirun.
        env: variables for every rank, on top of its executor's environment (Horovod's ranks
            get only ``env``; hora's also inherit the executor's, as Spark's Python workers do).
        stdout: a text stream on the driver that receives every rank's stdout, each line
            prefixed ``[<rank>]<stdout>:``. None: the output stays in the executors' logs
            (in local mode, this process's console), prefixed the same way.
        stderr: the same for the ranks' stderr (``[<rank>]<stderr>:``).
        verbose: 0 quiet; 1 (default) logs the job at info level; 2 also makes the ranks log
            at info level (``HORA_LOG_LEVEL=info`` unless set).
        nics: network interface name(s) for the ranks' connections (``HORA_GLOO_IFACE`` = the
            first; a set is taken in sorted order); the driver's store listens on the first one
            when the driver has it.
        prefix_output_with_timestamp: put a time stamp before each rank output line.
        executable: the Python that runs the ranks on the executors (default: the Python of
            Spark's workers there).

    Returns:
        The return values of ``fn``, in rank order (index ``r`` is rank ``r``'s). Partition 0
        is rank 0; the tasks of one host get consecutive ranks.

    Raises:
        RuntimeError: no active SparkContext.
        ImportError: pyspark is not installed.
        TypeError: bad argument types, or ``fn``/``args``/``kwargs`` cannot be pickled.
        ConfigError: (a ValueError) ``num_proc < 1``, more ranks than a local master's task
            slots, ``use_mpi=True``, a bad ``HORA_*`` variable in ``env``, or a cluster driver
            whose ``spark.driver.host`` is loopback. Nothing is started.
        TimeoutError: not every Spark task started within ``start_timeout`` (the job is
            cancelled).
        Exception: the exception a rank raised (the first failure), with its own type; its
            ``__cause__`` is a :class:`hora.runner.api.RemoteTraceback` with the rank and the
            rank's traceback. The other ranks are stopped and the Spark job ends.
        RankFailedError: a rank ended without a result (killed, ``os._exit``, ``sys.exit``,
            could not start), naming the rank and its exit status.
        SparkJobError: the Spark job failed without any rank saying why (e.g. the executors
            cannot import hora or reach the driver); quotes Spark's reason.
        KeyboardInterrupt: the call was interrupted (the job was stopped).
    """
    streams = {"stdout": stdout, "stderr": stderr}
    _check_arguments(fn, num_proc, env, use_mpi, use_gloo, streams)
    context = _active_context()
    source = "given"
    if num_proc is None:
        num_proc, source = int(context.defaultParallelism), "spark.default.parallelism"
    slots = local_slots(str(context.master), int(context.getConf().get("spark.task.cpus") or 1))
    if slots is not None and num_proc > slots:
        raise ConfigError(
            f"hora.spark.run: num_proc={num_proc} needs {num_proc} Spark task slots at once "
            f"(barrier mode), but master {context.master} has {slots}. HINT: use num_proc <= "
            f"{slots}, or a master with more slots, e.g. local[{num_proc}].")
    timeout = _start_timeout(start_timeout)
    nic_list = _nic_list(nics)
    rank_vars = _rank_variables(num_proc, env, nic_list, timeout, verbose,
                                executable or sys.executable)
    try:
        payload = proto.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as exc:
        raise TypeError(f"hora.spark.run: fn, args and kwargs must be picklable: {exc}") from exc
    if extra_mpi_args is not None:
        log.info("hora.spark.run: extra_mpi_args is ignored: hora starts the ranks itself")
    address, why = _store_address(context, nic_list)
    secret = secrets.token_bytes(32)
    with KVStoreServer(secret, address, 0) as server, \
            KVStoreClient(server.host, server.port, secret, timeout=30.0) as client:
        proto.put_blob(client, proto.FUNC_KEY, payload, {})
        plan = TaskPlan(store_host=server.host, store_port=server.port, secret=secret,
                        num_proc=num_proc, env=rank_vars, job_id=secrets.token_hex(8),
                        executable=executable or "", start_timeout=timeout,
                        relay=frozenset(k for k, v in streams.items() if v is not None),
                        prefix_timestamp=prefix_output_with_timestamp)
        if verbose >= 1:
            log.info("hora.spark.run: %d ranks in Spark tasks (%s); store on %s:%d: %s",
                     num_proc, source,
                     server.host, server.port, why)
        reader = None
        if plan.relay:
            reader = OutputReader(KVStoreClient(server.host, server.port, secret, 30.0),
                                  stdout, stderr)
            reader.start()
        job = _Job(context, plan, f"hora.spark.run.{plan.job_id}")
        try:
            job.thread.start()
            _watch(job, client, num_proc, timeout)
        finally:
            if reader is not None:
                reader.finish()
        if job.statuses:
            log.debug("hora.spark.run: (rank, partition, exit code) of the tasks: %s",
                      sorted(job.statuses))
        return results_or_raise(client, num_proc, job.error)


__all__ = ["local_slots", "run"]
