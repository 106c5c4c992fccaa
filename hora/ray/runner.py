"""``RayExecutor``: Horovod's ``horovod.ray.RayExecutor`` on hora.

Launcher side: this module runs in the driver process and never imports hora's engine. The
workers are Ray actors (:class:`~hora.ray.worker.BaseHorovodWorker`) placed by a placement
group (:mod:`hora.ray.placement`); the driver serves the job's rendezvous store
(:class:`~hora.rendezvous.kvstore.KVStoreServer`, authenticated with a fresh secret per
:meth:`RayExecutor.start`) and sets each actor's identity, rendezvous and secret variables in
the actor's own ``os.environ`` through an actor method call, so that a function calling
``hora.init()`` / ``hvd.init()`` in the actor joins the job exactly as a rank of ``hora run``.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ray

from hora._util.net import interface_address, interface_names
from hora.ray import environment, gather, placement
from hora.ray.settings import MiniSettings, create_settings
from hora.rendezvous.kvstore import KVStoreServer

if TYPE_CHECKING:
    from hora.ray.elastic import ElasticMode

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
"""Seconds :meth:`RayExecutor.shutdown` lets idle workers exit cleanly before killing them."""


class _Call:
    """``fn(*args, **kwargs)`` as a function of the worker's executable (which it ignores)."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any] | None,
                 kwargs: Mapping[str, Any] | None) -> None:
        self.fn, self.args, self.kwargs = fn, tuple(args or ()), dict(kwargs or {})

    def __call__(self, executable: Any) -> Any:
        return self.fn(*self.args, **self.kwargs)


class RayExecutor:
    """Run a hora job on Ray actors (Horovod's ``RayExecutor``; elastic with ``min_workers``).

    Args:
        settings: from :meth:`create_settings` (or any object with its attributes).
        num_workers: number of workers (ranks), packed on as few nodes as possible.
        num_hosts: instead of ``num_workers``: this many nodes, ``num_workers_per_host``
            workers on each (one bundle per node, ``STRICT_SPREAD``).
        num_workers_per_host: workers per node with ``num_hosts``.
        cpus_per_worker: CPUs Ray reserves for each worker.
        use_gpu: give each worker GPUs (``gpus_per_worker``, default 1); a node's workers
            then all see that node's reserved GPUs, in local-rank order.
        gpus_per_worker: GPUs per worker (needs ``use_gpu``).
        use_current_placement_group: when called inside a placement group, place the workers
            in it instead of creating one (as Horovod).
        min_workers, max_workers, reset_limit, cooldown_range, elastic_timeout,
        override_discovery: Horovod's elastic mode of this class (instead of
            ``num_workers``): :meth:`run` / :meth:`execute` then run an elastic job of
            ``min_workers`` to ``max_workers`` workers through an
            :class:`~hora.ray.ElasticRayExecutor` (``cpus_per_worker`` / ``gpus_per_worker``
            per slot); ``run_remote``, ``execute_single`` and ``executable_cls`` are refused
            with NotImplementedError (the workers are ephemeral), as Horovod.

    Raises:
        ValueError: inconsistent counts or resources (see :func:`hora.ray.placement.layout`).
    """

    def __init__(self, settings: Any, num_workers: int | None = None,
                 num_hosts: int | None = None, num_workers_per_host: int = 1,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: float | None = None, use_current_placement_group: bool = True,
                 min_workers: int | None = None, max_workers: int | None = None,
                 reset_limit: int | None = None, cooldown_range: Sequence[int] | None = None,
                 elastic_timeout: int = 600, override_discovery: bool = True) -> None:
        if max_workers and (not min_workers or min_workers <= 0):
            raise ValueError("max_workers was given without a positive min_workers; elastic "
                             "jobs need min_workers >= 1")
        if min_workers and num_workers:
            raise ValueError("give num_workers (a fixed-size job) or min_workers (elastic), "
                             "not both")
        self.settings = settings if settings is not None else MiniSettings()
        self._elastic: ElasticMode | None = None
        if min_workers is not None:
            from hora.ray.elastic import ElasticMode

            self._elastic = ElasticMode(
                self.settings, min_workers=min_workers, max_workers=max_workers,
                cpus_per_worker=cpus_per_worker, use_gpu=use_gpu,
                gpus_per_worker=gpus_per_worker, reset_limit=reset_limit,
                cooldown_range=cooldown_range, elastic_timeout=elastic_timeout,
                override_discovery=override_discovery)
            num_workers = min_workers
        del reset_limit, cooldown_range, elastic_timeout, override_discovery
        self.settings.elastic = self._elastic is not None
        self.layout = placement.layout(num_workers, num_hosts, num_workers_per_host,
                                       cpus_per_worker, use_gpu, gpus_per_worker,
                                       use_current_placement_group)
        self.workers: list[Any] = []
        """The worker actors, in rank order (empty before :meth:`start`)."""
        self._started: placement.Workers | None = None
        self._store: KVStoreServer | None = None
        self._job_id = ""
        self._secret = b""
        self._broken = ""
        self._lock = threading.Lock()

    create_settings = staticmethod(create_settings)

    @property
    def num_workers(self) -> int:
        """Number of workers (ranks)."""
        return self.layout.num_workers

    # ---- start ---------------------------------------------------------------------------------

    def start(self, executable_cls: type | None = None,
              executable_args: Sequence[Any] | None = None,
              executable_kwargs: Mapping[str, Any] | None = None,
              extra_env_vars: Mapping[str, Any] | None = None) -> None:
        """Reserve the resources, start the workers, set their environment, create their
        executables.

        Args:
            executable_cls: a class instantiated in every worker
                (``executable_cls(*executable_args, **executable_kwargs)``), after its
                environment is set (its constructor may call ``hvd.init()``); :meth:`execute`
                passes it to its function.
            executable_args: positional arguments of ``executable_cls``.
            executable_kwargs: keyword arguments of ``executable_cls``.
            extra_env_vars: more variables for every worker (not identity/rendezvous ones).

        Raises:
            RuntimeError: already started, or a worker could not start.
            TimeoutError: the placement group (``placement_group_timeout_s``) or the actors
                (``timeout_s``) were not ready in time.
            ConfigError: ``extra_env_vars`` sets a variable the executor owns.
            NotImplementedError: the driver is a Ray client (``ray://``) connection.
        Ray is initialized with ``ray.init()`` first when it is not (as any Ray API does).
            Exception: what ``executable_cls`` raised in a worker (as :meth:`run` reports it).
        Nothing is left running when it raises.
        """
        if self._elastic is not None:
            return self._elastic.start(executable_cls, extra_env_vars)
        if self._started is not None:
            raise RuntimeError("hora.ray: this executor is already started; call shutdown() "
                               "before start() again")
        extra = environment.check_extra(extra_env_vars)
        environment.ensure_driver()
        timeout = float(getattr(self.settings, "timeout_s", 30.0))
        workers = placement.start_workers(
            self.layout, start_timeout=timeout,
            placement_group_timeout=float(getattr(self.settings, "placement_group_timeout_s",
                                                  100.0)))
        self._started, self.workers, self._broken = workers, list(workers.actors), ""
        self._job_id = secrets.token_hex(8)
        try:
            self._secret = secrets.token_bytes(32)
            self._store = KVStoreServer(self._secret, self._store_host(workers), 0)
            self._store.start()
            self._configure(workers, timeout, extra)
            if executable_cls is not None:
                refs = [a.start_executable.remote(executable_cls, executable_args,
                                                  executable_kwargs) for a in workers.actors]
                self._finish(refs, list(range(len(refs))), gather.function_name(executable_cls))
        except BaseException:
            self.shutdown()
            raise

    def _store_host(self, workers: placement.Workers) -> str:
        nics = sorted(getattr(self.settings, "nics", None) or ())
        if nics and nics[0] in interface_names():  # else: the driver is not on that network
            return interface_address(nics[0])
        here = ray.util.get_node_ip_address()
        if all(info["ip"] == here for info in workers.info):
            return "127.0.0.1"  # every worker is on this machine
        return here

    def _configure(self, workers: placement.Workers, timeout: float,
                   extra: Mapping[str, str]) -> None:
        assert self._store is not None
        secret_hex = self._secret.hex()
        devices = placement.visible_devices(workers)
        knobs = environment.driver_knobs()
        nics = sorted(getattr(self.settings, "nics", None) or ())
        refs = []
        for slot, actor in zip(workers.slots, workers.actors, strict=True):
            env = environment.worker_environment(
                slot, store=(self._store.host, self._store.port), secret_hex=secret_hex,
                job_id=self._job_id, start_timeout=timeout, nics=nics, knobs=knobs,
                extra=extra, devices=devices.get(slot.rank))
            if int(getattr(self.settings, "verbose", 1) or 0) >= 2:
                log.info("hora.ray: rank %d: %s", slot.rank, environment.describe(env))
            refs.append(actor.setup.remote(env, environment.stale_variables(env)))
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if len(ready) < len(refs):
            raise TimeoutError(f"hora.ray: the workers did not take their environment within "
                               f"{timeout:g} s")
        ray.get(refs)

    # ---- running -------------------------------------------------------------------------------

    def _check(self) -> placement.Workers:
        if self._started is None:
            raise RuntimeError("hora.ray: the executor is not started; call start() first")
        if self._broken:
            raise RuntimeError(f"hora.ray: {self._broken}; call shutdown() and start() to run "
                               "again")
        return self._started

    def _finish(self, refs: list[Any], ranks: list[int], what: str,
                sink: gather.Callbacks | None = None) -> list[Any]:
        """Gather ``refs`` and return the values in rank order, or stop the broken job and
        raise its root failure."""
        workers = self._check()
        try:
            outcome = gather.gather(refs, ranks, callbacks=sink)
        except KeyboardInterrupt:  # Ctrl-C: stop every worker, as `hora run` does
            self._broken = f"the workers were stopped by an interrupt during {what}"
            placement.stop(workers.actors, None, job_id=self._job_id,
                           nodes={i["node_id"] for i in workers.info})
            raise
        finally:
            if sink is not None:
                sink.close()
        if not outcome.failures:
            return [outcome.values[r] for r in ranks]
        stopped = bool(outcome.stuck or outcome.dead)
        if stopped:
            rank, _ = gather.root_failure(outcome)
            self._broken = f"the workers were stopped after rank {rank} failed in {what}"
            placement.stop(workers.actors, None, job_id=self._job_id,
                           nodes={i["node_id"] for i in workers.info})
        gather.raise_failure(outcome, len(workers.actors), what, workers.describe, stopped)
        raise AssertionError("unreachable")

    def _submit(self, call: Any, ranks: list[int], sink: gather.Callbacks | None) -> list[Any]:
        workers = self._check()
        shared = ray.put(call)  # serialized once, not once per worker
        queue = sink.queue if sink is not None else None
        return [workers.actors[r].execute.remote(shared, queue) for r in ranks]

    def _sink(self, callbacks: Sequence[Callable[[Any], Any]] | None) -> gather.Callbacks | None:
        return gather.Callbacks(callbacks) if callbacks else None

    def run(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
            kwargs: Mapping[str, Any] | None = None,
            callbacks: Sequence[Callable[[Any], Any]] | None = None) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every worker; return the results in rank order.

        ``fn`` usually calls ``hora.init()`` / ``hvd.init()`` and trains. It is pickled by Ray
        (cloudpickle): a function of an importable module travels by reference, so that module
        must import on the workers too.

        Args:
            fn: the function.
            args: its positional arguments.
            kwargs: its keyword arguments.
            callbacks: callables invoked in the driver, while the workers run, with every value
                rank 0 sends with ``hora.ray.ray_logger.log(value)``.

        Raises:
            RuntimeError: not started, or stopped after an earlier failure.
            Exception: the exception a rank raised, with its own type, a note naming the rank
                and its traceback as ``__cause__`` (a death outranks exceptions; a hora
                collective error outranked by the error that caused it).
            RankFailedError: a rank's actor died (killed, out of memory, node lost); names the
                rank. After a death, or when ranks were still blocked :data:`FAILURE_GRACE_S`
                after a failure, every worker is stopped and the executor must be restarted.

        With ``min_workers`` (elastic) it runs as :meth:`ElasticRayExecutor.run` and returns
        the final generation's results in rank order.
        """
        if self._elastic is not None:
            return self._elastic.run(fn, args, kwargs, callbacks)
        return self._everywhere(_Call(fn, args, kwargs), callbacks, gather.function_name(fn))

    def run_remote(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                   kwargs: Mapping[str, Any] | None = None) -> list[Any]:
        """Like :meth:`run` without waiting: one Ray ``ObjectRef`` per worker, in rank order
        (``ray.get`` them; a failure then surfaces as Ray reports it). Not with
        ``min_workers``."""
        if self._elastic is not None:
            raise self._elastic.refuse("run_remote()")
        return self._submit(_Call(fn, args, kwargs), list(range(self.num_workers)), None)

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Sequence[Callable[[Any], Any]] | None = None) -> list[Any]:
        """Call ``fn(executable)`` on every worker (``executable`` is the worker's
        ``executable_cls`` instance, None without one); results in rank order. ``callbacks``
        and failures as in :meth:`run` (with ``min_workers``: ``fn(None)``, as Horovod)."""
        if self._elastic is not None:
            return self._elastic.execute(fn, callbacks)
        return self._everywhere(fn, callbacks, gather.function_name(fn))

    def _everywhere(self, call: Callable[[Any], Any],
                    callbacks: Sequence[Callable[[Any], Any]] | None, what: str) -> list[Any]:
        ranks = list(range(len(self._check().actors)))
        sink = self._sink(callbacks)
        try:
            refs = self._submit(call, ranks, sink)
        except BaseException:
            if sink is not None:
                sink.close()
            raise
        return self._finish(refs, ranks, what, sink)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Call ``fn(executable)`` on rank 0 only and return its result. Failures as in
        :meth:`run`. Not with ``min_workers``."""
        if self._elastic is not None:
            raise self._elastic.refuse("execute_single()")
        refs = self._submit(fn, [0], None)
        return self._finish(refs, [0], gather.function_name(fn))[0]

    # ---- shutdown ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the workers (idle ones exit cleanly within :data:`STOP_GRACE_S`; busy ones are
        killed), remove the placement group this executor created, unlink the job's shared
        memory on every node used and close the rendezvous store. Idempotent; never raises."""
        with self._lock:
            workers, self._started, self.workers = self._started, None, []
            store, self._store, self._secret = self._store, None, b""
        if workers is not None:
            placement.stop(workers.actors, workers.group if workers.owned else None,
                           graceful=0.0 if self._broken else STOP_GRACE_S, job_id=self._job_id,
                           nodes={i["node_id"] for i in workers.info})
        if store is not None:
            store.close()
        self._broken = ""

    def __enter__(self) -> RayExecutor:
        if self._started is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        if self._elastic is not None:
            return f"RayExecutor(min_workers={self.num_workers}, elastic)"
        state = ("stopped after a failure" if self._broken else
                 "started" if self._started is not None else "not started")
        return f"RayExecutor(num_workers={self.num_workers}, {state})"


__all__ = ["RayExecutor"]
