"""``ElasticRayExecutor``: Horovod's ``horovod.ray.ElasticRayExecutor`` on hora's elastic driver.

Launcher side (the driver process; never hora's engine). There is one elastic implementation
in hora, :class:`hora.runner.elastic.driver.ElasticDriver` (the one ``hora run --min-np``
runs); this executor gives it

* a host discovery from Ray's cluster state (:class:`~hora.ray.discovery.RayHostDiscovery`:
  alive nodes, slots from their CPUs / GPUs), so nodes that Ray's autoscaler adds or removes
  are hosts that appear or disappear;
* a spawner that starts every worker as a Ray actor on its host's node
  (:class:`~hora.ray.spawner.RaySpawner`) instead of a process; an actor that dies (killed,
  out of memory, its node lost) is a failed worker like a process that died: survivors roll
  back to their last commit, its host's failure is counted (blacklisted at the second), a
  replacement starts on a free slot and joins at a later commit.

:meth:`ElasticRayExecutor.run` returns the return values of the workers of the *final*
generation, in their rank order (Horovod returns every completed worker's value ordered by
rank).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora.errors import DiscoveryError, ElasticError, HoraInternalError, RankFailedError
from hora.ray import environment, gather
from hora.ray.discovery import RayHostDiscovery
from hora.ray.settings import ElasticSettings, create_elastic_settings
from hora.ray.spawner import STOPPED, RaySpawner, RayWorker
from hora.ray.worker import ElasticCall
from hora.runner.api import RemoteTraceback
from hora.runner.elastic.driver import ElasticDriver
from hora.runner.elastic.options import ElasticOptions
from hora.runner.launch import LaunchSpec
from hora.runner.output import Console
from hora.runner.run_func import loads

log = logging.getLogger(__name__)

NAMES: Mapping[str, str] = {
    "np": "num_proc", "min_np": "min_num_proc", "elastic_timeout": "elastic_timeout",
    "reset_limit": "reset_limit", "cooldown_range": "cooldown_range"}
"""The settings' names in the driver's messages (``create_settings``'s, not ``hora run``'s)."""


class _LogConsole(Console):
    """The driver's messages go to this module's logger (a library does not print)."""

    def say(self, message: str) -> None:
        for line in message.splitlines():
            if "error:" in line:
                log.warning("hora.ray %s", line)
            else:
                log.info("hora.ray %s", line)


class ElasticRayExecutor:
    """Run an elastic hora job on a Ray cluster (Horovod's ``ElasticRayExecutor``).

    Args:
        settings: from :meth:`create_settings` (an :class:`~hora.ray.settings.ElasticSettings`).
        use_gpu: give every worker ``gpus_per_slot`` GPUs (and count GPU slots).
        cpus_per_slot: CPUs Ray reserves for each worker.
        gpus_per_slot: GPUs per worker (needs ``use_gpu``; default 1 with it).
        env_vars: more variables for every worker (not identity / rendezvous ones).
        override_discovery: set ``settings.discovery`` to a
            :class:`~hora.ray.discovery.RayHostDiscovery` of these resources; False keeps the
            settings' own discovery (its hosts must be Ray nodes' host names or addresses, or
            have a ``node:<host>`` Ray resource).

    Raises:
        ValueError: ``gpus_per_slot`` without ``use_gpu``, resources out of range, or no
            discovery with ``override_discovery=False``.
        ConfigError: ``env_vars`` sets a variable the executor owns.
    """

    create_settings = staticmethod(create_elastic_settings)

    def __init__(self, settings: ElasticSettings, use_gpu: bool = False,
                 cpus_per_slot: float = 1, gpus_per_slot: float | None = None,
                 env_vars: Mapping[str, Any] | None = None,
                 override_discovery: bool = True) -> None:
        if gpus_per_slot and not use_gpu:
            raise ValueError("gpus_per_slot is set, but use_gpu is False: pass use_gpu=True to "
                             "give the workers GPUs")
        gpus = float(gpus_per_slot or 1) if use_gpu else 0.0
        if override_discovery:
            settings.discovery = RayHostDiscovery(use_gpu=use_gpu, cpus_per_slot=cpus_per_slot,
                                                  gpus_per_slot=gpus or 1)
        elif not callable(getattr(settings.discovery, "find_available_hosts_and_slots", None)):
            raise ValueError("override_discovery=False needs settings.discovery: an object with "
                             "find_available_hosts_and_slots() -> {host: slots}")
        elif cpus_per_slot < 0 or (not cpus_per_slot and not gpus):
            raise ValueError(f"cpus_per_slot must be > 0 (or use_gpu), not {cpus_per_slot}")
        self.settings = settings
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus
        self.env_vars = environment.check_extra(env_vars)
        self._started = False

    def start(self) -> None:
        """Check that Ray runs here (``ray.init()`` when it is not initialized) and that the
        discovery answers; the workers start in :meth:`run`.

        Raises:
            NotImplementedError: the driver is a Ray client (``ray://``) connection.
            DiscoveryError: the first discovery failed.
        """
        environment.ensure_driver()
        try:
            hosts = self.settings.discovery.find_available_hosts_and_slots()
        except DiscoveryError:
            raise
        except Exception as exc:  # a user's discovery
            raise DiscoveryError(f"hora.ray: the host discovery failed: {exc}") from exc
        log.info("hora.ray: elastic executor ready; hosts now: %s", hosts or "none")
        self._started = True

    def run(self, worker_fn: Callable[[], Any],
            callbacks: Sequence[Callable[[Any], Any]] | None = None) -> list[Any]:
        """Run ``worker_fn()`` (no arguments, as Horovod) on every worker of the elastic job
        until training finishes; return the values the workers of the final generation
        returned, in their rank order.

        ``worker_fn`` calls ``hvd.init()`` and an ``@hvd.elastic.run`` function (see
        docs/elastic.md); a worker that joins later runs it from the top. The job is over when
        a worker's ``worker_fn`` returns.

        Args:
            worker_fn: the function (pickled by Ray, as for :meth:`RayExecutor.run`).
            callbacks: callables invoked in the driver with every value rank 0 sends with
                ``hora.ray.ray_logger.log(value)``.

        Raises:
            RuntimeError: :meth:`start` was not called.
            ElasticError: the job could not go on (fewer than ``min_num_proc`` workers for
                ``elastic_timeout`` seconds, the reset limit, every host blacklisted...):
                the reason.
            Exception: what a worker raised, when a worker's own error ended the job (its
                type, a note naming the worker, its traceback as ``__cause__``).
            RankFailedError: a worker failed after training finished elsewhere.
        """
        if not self._started:
            raise RuntimeError("hora.ray: call start() before run()")
        if not callable(worker_fn):
            raise TypeError(f"worker_fn must be callable, not {type(worker_fn).__name__}")
        settings = self.settings
        sink = gather.Callbacks(callbacks) if callbacks else None
        nics = sorted(getattr(settings, "nics", None) or ())
        verbose = int(getattr(settings, "verbose", 1) or 0)
        spawner = RaySpawner(ElasticCall(worker_fn), discovery=settings.discovery,
                             cpus_per_slot=self.cpus_per_slot, gpus_per_slot=self.gpus_per_slot,
                             start_timeout=float(settings.timeout_s), nics=nics, callbacks=sink,
                             verbose=verbose)
        env = environment.driver_knobs()
        if nics:
            env.update({"HORA_GLOO_IFACE": nics[0], "NCCL_SOCKET_IFNAME": ",".join(nics)})
        env.update(self.env_vars)
        spec = LaunchSpec(np=int(settings.num_proc),
                          command=("hora.ray", gather.function_name(worker_fn)),
                          start_timeout=float(settings.timeout_s), verbose=verbose >= 2)
        options = ElasticOptions(
            discovery=settings.discovery, min_np=int(settings.min_num_proc),
            max_np=settings.max_num_proc, reset_limit=settings.reset_limit,
            cooldown_range=getattr(settings, "cooldown_range", None),
            elastic_timeout=float(settings.elastic_timeout))
        driver = ElasticDriver(spec, options, environ=env, console=_LogConsole(),
                               spawner=spawner, names=NAMES)
        try:
            status = driver.run()
        finally:
            if sink is not None:
                try:
                    sink.close()
                except Exception as exc:  # noqa: BLE001 (a callback raised while draining)
                    spawner.callback_error = spawner.callback_error or exc
        if spawner.callback_error is not None:
            raise spawner.callback_error
        return outcome(spawner, status, driver.failure)

    def __repr__(self) -> str:
        return (f"ElasticRayExecutor(min_num_proc={self.settings.min_num_proc}, "
                f"max_num_proc={self.settings.max_num_proc}, "
                f"{'started' if self._started else 'not started'})")


class ElasticMode:
    """``RayExecutor(settings, min_workers=...)``: Horovod's newer spelling of an elastic job
    (it deprecated :class:`ElasticRayExecutor` for it), run by an :class:`ElasticRayExecutor`.
    The executor delegates every call here; the workers live only as long as one
    :meth:`run` / :meth:`execute`, so nothing is left to address between calls."""

    def __init__(self, settings: Any, *, min_workers: int, max_workers: int | None,
                 cpus_per_worker: float, use_gpu: bool, gpus_per_worker: float | None,
                 reset_limit: int | None, cooldown_range: Sequence[float] | None,
                 elastic_timeout: float, override_discovery: bool) -> None:
        elastic = create_elastic_settings(
            min_num_proc=min_workers, max_num_proc=max_workers, reset_limit=reset_limit,
            elastic_timeout=elastic_timeout, timeout_s=getattr(settings, "timeout_s", 30),
            nics=getattr(settings, "nics", None), verbose=getattr(settings, "verbose", 1),
            cooldown_range=tuple(cooldown_range) if cooldown_range else None)
        elastic.discovery = getattr(settings, "discovery", None)
        self.executor = ElasticRayExecutor(elastic, use_gpu=use_gpu,
                                           cpus_per_slot=cpus_per_worker,
                                           gpus_per_slot=gpus_per_worker,
                                           override_discovery=override_discovery)
        self.num_workers = min_workers

    def start(self, executable_cls: type | None, extra_env_vars: Mapping[str, Any] | None,
              ) -> None:
        if executable_cls is not None:
            raise NotImplementedError(
                "hora.ray: executable_cls is not available with min_workers (elastic): the "
                "workers come and go, so no object lives between calls; create what you need "
                "inside the function you run")
        self.executor.env_vars.update(environment.check_extra(extra_env_vars))
        self.executor.start()

    def run(self, fn: Callable[..., Any], args: Sequence[Any] | None,
            kwargs: Mapping[str, Any] | None,
            callbacks: Sequence[Callable[[Any], Any]] | None) -> list[Any]:
        return self.executor.run(functools.partial(fn, *(args or ()), **dict(kwargs or {})),
                                 callbacks)

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Sequence[Callable[[Any], Any]] | None) -> list[Any]:
        return self.executor.run(functools.partial(fn, None), callbacks)

    @staticmethod
    def refuse(what: str) -> NotImplementedError:
        return NotImplementedError(
            f"hora.ray: {what} is not available with min_workers (elastic): the workers are "
            "ephemeral; use run() or execute(), which return the final workers' results (as "
            "Horovod)")


def outcome(spawner: RaySpawner, status: int, failure: str | None) -> list[Any]:
    """The final generation's values in rank order (``status`` 0), else the error to raise."""
    workers = spawner.workers()
    finished = [w.outcome for w in workers if w.outcome and w.outcome[0] == "result"]
    if status == 0 and finished:
        last = max(o[2] for o in finished)
        final = sorted((o for o in finished if o[2] == last), key=lambda o: o[1])
        ranks = [o[1] for o in final]
        if ranks != list(range(len(final))):
            raise RankFailedError(f"hora.ray: the final generation's workers returned ranks "
                                  f"{ranks}: some ended without a result")
        return [o[3] for o in final]
    if status == 0:
        raise RankFailedError("hora.ray: the elastic job ended (a worker left with exit status "
                              "0, e.g. sys.exit(0)) but no worker returned a value")
    ended = sorted((w for w in workers if w.outcome is not None), key=lambda w: w.seq)
    reason = failure or "a worker failed after training had finished elsewhere"
    for worker in ended:  # the first error of the workers' own (not a consequence)
        if worker.outcome is not None and worker.outcome[0] == "error":
            _reraise(worker, reason)
    failed = [f"worker {w.wid} on {w.host} {spawner.describe_exit(w.wid, 1)}" for w in ended
              if _own_failure(w)]
    if failure is None and failed:
        raise RankFailedError(f"hora.ray: elastic {failed[0]} after training had finished "
                              "elsewhere")
    failed = spawner.start_errors + failed
    more = f" ({len(failed) - 3} more in the log)" if len(failed) > 3 else ""
    raise ElasticError(f"hora.ray: the elastic job failed: {reason}"
                       + (f". The first workers' failures: {'; '.join(failed[:3])}{more}"
                          if failed else ""))


def _own_failure(worker: RayWorker) -> bool:
    """Whether ``worker`` failed of its own (not stopped by the driver, not told the job
    failed)."""
    outcome = worker.outcome
    if outcome is None or worker.note == STOPPED:
        return False
    if outcome[0] == "exit":
        return int(outcome[1]) != 0
    if outcome[0] == "error":
        return not str(outcome[3].get("type", "")).endswith(("ElasticError", "InternalError"))
    return outcome[0] == "ray"


def _reraise(worker: RayWorker, reason: str) -> None:
    """Raise ``worker``'s stored exception with a note, unless it is a consequence (an elastic
    stop, a collective failure), which the caller then reports as the job's failure."""
    assert worker.outcome is not None
    _, rank, generation, header, payload = worker.outcome
    exc: BaseException | None = None
    if payload:
        try:
            exc = loads(payload)
        except Exception:  # noqa: BLE001 (its class does not import here)
            exc = None
    if isinstance(exc, (ElasticError, HoraInternalError)):
        return
    if not isinstance(exc, BaseException):
        if str(header.get("type", "")).endswith(("ElasticError", "InternalError")):
            return
        exc = RankFailedError(f"hora.ray: elastic worker {worker.wid} raised "
                              f"{header.get('type')}: {header.get('message')}", rank=rank)
    where = (f"rank {rank} of generation {generation}" if generation > 0 else
             "before it joined a generation")
    note = (f"hora.ray: raised by elastic worker {worker.wid} on {worker.host} ({where}); the "
            f"elastic job could not go on: {reason}")
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(note)
    raise exc from WorkerTraceback(worker.wid, rank, str(header.get("traceback", "")))


class WorkerTraceback(RemoteTraceback):
    """An elastic worker's traceback (``wid``: its worker id; ``rank``: its rank then, -1
    before it joined a generation)."""

    def __init__(self, wid: int, rank: int, text: str) -> None:
        super().__init__(rank, text)
        self.wid = wid

    def __str__(self) -> str:
        return (f"\n\nelastic worker {self.wid}'s traceback:\n\"\"\"\n{self.text.rstrip()}"
                "\n\"\"\"")


__all__ = ["ElasticMode", "ElasticRayExecutor", "ElasticSettings", "RayHostDiscovery",
           "WorkerTraceback", "outcome"]
