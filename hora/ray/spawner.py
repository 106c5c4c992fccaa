"""The workers of an :class:`~hora.ray.ElasticRayExecutor`: one Ray actor each, started by the
elastic driver through :class:`RaySpawner` (its :class:`~hora.runner.elastic.spawner.Spawner`).

Launcher side (the driver process). For each worker the driver wants on a host, the spawner
creates a :class:`~hora.ray.worker.BaseHorovodWorker` actor pinned to that host's Ray node
(``NodeAffinitySchedulingStrategy``, not soft; a host that names no node but a ``node:<host>``
resource, as Horovod's custom discovery tests use, gets 0.01 of that resource), asking for
``cpus_per_slot`` CPUs and ``gpus_per_slot`` GPUs; then, in one actor method call, sets the
worker's environment (identity, store, secret, ``HORA_ELASTIC_WORKER_ID``: the secret travels
through Ray, never argv), and runs the user's function wrapped in
:class:`~hora.ray.worker.ElasticCall`.

One watcher thread waits on every running worker (``ray.wait``) and, when one ends, records
its outcome and puts ``(worker id, status)`` on the driver's queue: 0 when the function
returned (or the worker left because the driver told it to), 1 when it raised or its actor
died (killed, out of memory, its node lost), which the driver counts as a failed worker on
that host (blacklisting and all). A worker whose actor has not started within ``timeout_s``
is killed and counted the same way. The watcher also drains the ``ray_logger`` queue into the
run's callbacks. A finished worker's actor is asked to exit at once (its ``atexit`` handlers
run), which frees its CPUs for the next worker on that node.
"""

from __future__ import annotations

import itertools
import logging
import queue
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hora._util.net import interface_address, interface_names
from hora.config import Config
from hora.ray import environment, gather, placement
from hora.ray.worker import BaseHorovodWorker, ElasticCall
from hora.runner.elastic.spawner import SpawnError, exit_text

log = logging.getLogger(__name__)

POLL_S = 0.05
"""How often the watcher looks at the workers (and drains the callbacks)."""

STOPPED = "was stopped after it was told to leave"
"""The note of a worker the driver stopped (not a failure of its own)."""

EXIT_GRACE_S = 5.0
"""Seconds finished workers get to exit cleanly when the job ends, before they are killed."""


@dataclass(eq=False)
class RayWorker:
    """One worker actor and what became of it.

    Attributes:
        wid: the elastic worker id.
        host: the host name it was started on.
        node_id: its Ray node (None when placed by a ``node:<host>`` resource).
        actor: the actor handle.
        setup: the ref of its environment call (ready once the actor runs).
        ref: the ref of its function call.
        started: when it was created (monotonic).
        outcome: what :class:`ElasticCall` returned (``("result", rank, generation, value)``,
            ``("error", rank, generation, header, payload)``, ``("exit", status)``), or
            ``("ray", error)`` for a Ray error (the actor died; a result Ray could not
            return). None while it runs.
        seq: the order in which the workers ended (0 first).
        note: why the spawner killed it, when it did.
    """

    wid: int
    host: str
    node_id: str | None
    actor: Any
    setup: Any
    ref: Any
    started: float
    outcome: tuple[Any, ...] | None = None
    seq: int = -1
    note: str = ""
    running: bool = False
    exiting: Any = None


class RaySpawner:
    """Starts the elastic driver's workers as Ray actors (see the module's docstring).

    Args:
        call: what every worker runs.
        discovery: the job's host discovery (its ``node_id(host)`` places a host's workers,
            when it has one, as :class:`~hora.ray.discovery.RayHostDiscovery` does).
        cpus_per_slot: CPUs per worker.
        gpus_per_slot: GPUs per worker (0: none).
        start_timeout: seconds an actor has to start.
        nics: interface names (the store binds to the first one's address when it is here).
        callbacks: the run's callbacks (drained by the watcher), or None.
        verbose: 2 logs every worker's environment (never the secret).
    """

    def __init__(self, call: ElasticCall, *, discovery: Any, cpus_per_slot: float,
                 gpus_per_slot: float, start_timeout: float, nics: Sequence[str] = (),
                 callbacks: gather.Callbacks | None = None, verbose: int = 0) -> None:
        self.call = call
        self.discovery = discovery
        self.cpus_per_slot, self.gpus_per_slot = cpus_per_slot, gpus_per_slot
        self.start_timeout = start_timeout
        self.nics = list(nics)
        self.callbacks = callbacks
        self.verbose = verbose
        self.callback_error: BaseException | None = None
        self._workers: dict[int, RayWorker] = {}
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._closing = threading.Event()
        self._exits: queue.Queue[tuple[int, int]] | None = None
        self._job_id = ""
        self._shared: Any = None
        self._watcher: threading.Thread | None = None
        self._broken = ""
        self.start_errors: list[str] = []
        """``worker W on HOST: why`` for each worker that could not be started."""

    # ---- the Spawner protocol ------------------------------------------------------------------

    def open(self, first: Mapping[str, int], config: Config,
             exits: queue.Queue[tuple[int, int]], job_id: str) -> str:
        """Start the watcher; the store binds to the ``nics`` interface's address when this
        machine has it, else to this Ray node's address (nodes added later reach it too)."""
        self._exits, self._job_id = exits, job_id
        self._shared = ray.put(self.call)  # serialized once, not once per worker
        self._watcher = threading.Thread(target=self._watch, name="hora-ray-elastic",
                                         daemon=True)
        self._watcher.start()
        if self.nics and self.nics[0] in interface_names():
            return interface_address(self.nics[0])
        return str(ray.util.get_node_ip_address())

    def start(self, wid: int, host: str, env: Mapping[str, str],
              place: tuple[int, int] | None = None) -> RayWorker:
        del place  # Ray gives each actor its CPUs (num_cpus)
        try:
            if self._broken:
                raise SpawnError(f"hora.ray: cannot start worker {wid}: {self._broken}", 1)
            node_id, options = self._placement(host)
        except SpawnError as exc:
            self.start_errors.append(f"worker {wid} on {host}: {exc.message}")
            raise
        env = {**env, "HORA_LAUNCHER": environment.LAUNCHER_NAME}
        for name in ("HORA_LAUNCHER_PID", "PYTHONUNBUFFERED"):  # the driver's; Ray's business
            env.pop(name, None)
        if self.verbose >= 2:
            log.info("hora.ray: elastic worker %d on %s: %s", wid, host,
                     environment.describe(env))
        actor: Any = ray.remote(BaseHorovodWorker).options(
            num_cpus=self.cpus_per_slot, num_gpus=self.gpus_per_slot, max_restarts=0,
            **options).remote(world_rank=wid, world_size=0)
        setup = actor.setup.remote(env, environment.stale_variables(env))
        queue_ = self.callbacks.queue if self.callbacks is not None else None
        ref = actor.execute.remote(self._shared, queue_)  # runs after setup (actor order)
        worker = RayWorker(wid=wid, host=host, node_id=node_id, actor=actor, setup=setup,
                           ref=ref, started=time.monotonic())
        with self._lock:
            self._workers[wid] = worker
        return worker

    def describe_exit(self, wid: int, status: int) -> str:
        with self._lock:
            worker = self._workers.get(wid)
        outcome = worker.outcome if worker is not None else None
        if worker is None or outcome is None:
            return exit_text(status)
        if outcome[0] == "error":
            header = outcome[3]
            return (f"raised {header.get('type', 'an exception').rsplit('.', 1)[-1]}: "
                    f"{_first_line(str(header.get('message', '')))}")
        if outcome[0] == "ray":
            error = outcome[1]
            if worker.note:
                return worker.note
            if isinstance(error, RayActorError):
                return f"died: its actor is gone ({actor_death(error)})"
            cause = getattr(error, "cause", None)
            if isinstance(cause, BaseException):  # RayTaskError: e.g. fn did not unpickle
                text = f"{type(cause).__name__}: {_first_line(str(cause))}"
                if isinstance(cause, ImportError):
                    text += (" (HINT: a function of a module travels by reference: the module "
                             "must import on the workers, or register it with ray.cloudpickle"
                             ".register_pickle_by_value(module))")
                return f"failed in Ray: {text}"
            return f"failed in Ray: {_first_line(str(error))}"
        return exit_text(status) + (" (sys.exit)" if outcome[0] == "exit" else "")

    def stop(self, handle: Any) -> None:
        """Kill the worker's actor (it was told to leave and did not)."""
        handle.note = handle.note or STOPPED
        _kill(handle.actor)

    def close(self, handles: Sequence[Any]) -> None:
        """Stop the watcher, let finished workers exit (at most :data:`EXIT_GRACE_S`), kill
        the rest, and unlink what killed workers left in ``/dev/shm`` on their nodes."""
        self._closing.set()
        if self._watcher is not None:
            self._watcher.join(5.0)
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            if worker.outcome is None:
                _kill(worker.actor)
        exiting = [w.exiting for w in workers if w.exiting is not None]
        if exiting:
            try:
                ray.wait(exiting, num_returns=len(exiting), timeout=EXIT_GRACE_S)
            except Exception:  # noqa: BLE001 (a dead actor's ref)
                pass
        for worker in workers:
            _kill(worker.actor)
        alive = {str(n["NodeID"]) for n in ray.nodes() if n.get("Alive", n.get("alive"))}
        nodes = {w.node_id for w in workers if w.node_id is not None} & alive
        if not nodes and workers:  # placed by resource, or every node used is gone
            nodes = {str(ray.get_runtime_context().get_node_id())}
        if self._job_id and nodes:
            placement.stop([], None, job_id=self._job_id, nodes=nodes)

    # ---- what the executor reads after the job -------------------------------------------------

    def workers(self) -> list[RayWorker]:
        """Every worker started, by id."""
        with self._lock:
            return [self._workers[w] for w in sorted(self._workers)]

    # ---- internals -----------------------------------------------------------------------------

    def _placement(self, host: str) -> tuple[str | None, dict[str, Any]]:
        lookup = getattr(self.discovery, "node_id", None)
        node_id = lookup(host) if callable(lookup) else None
        if node_id is None:
            matches = [str(n["NodeID"]) for n in ray.nodes()
                       if n.get("Alive", n.get("alive")) and host in (
                           n.get("NodeManagerHostname"), n.get("NodeManagerAddress"))]
            node_id = matches[0] if len(matches) == 1 else None
        if node_id is not None:
            return node_id, {"scheduling_strategy": NodeAffinitySchedulingStrategy(
                node_id, soft=False)}
        if f"node:{host}" in ray.cluster_resources():
            return None, {"resources": {f"node:{host}": 0.01}}
        raise SpawnError(f"hora.ray: host {host!r} (from the host discovery) is not a Ray node "
                         "of this cluster (no node has that host name or address, and there is "
                         f"no 'node:{host}' resource): cannot place a worker there", 1)

    def _watch(self) -> None:
        failures = 0
        while not self._closing.is_set():
            try:
                self._look()
                failures = 0
            except Exception as exc:  # noqa: BLE001 (Ray trouble: retry, then give the job up)
                failures += 1
                log.warning("hora.ray: watching the elastic workers failed (%s: %s)",
                            type(exc).__name__, exc)
                if failures >= 20 or not ray.is_initialized():
                    self._give_up(f"the driver lost track of its workers: {exc}")
                    return
                self._closing.wait(0.5)

    def _give_up(self, why: str) -> None:
        """Report every running worker as failed and refuse new ones (the driver then ends
        the job: every host fails)."""
        self._broken = why
        with self._lock:
            running = [w for w in self._workers.values() if w.outcome is None]
        for worker in running:
            worker.note = why
            with self._lock:
                worker.outcome, worker.seq = ("ray", RuntimeError(why)), next(self._seq)
            assert self._exits is not None
            self._exits.put((worker.wid, 1))

    def _look(self) -> None:
        """One round: collect the workers that ended, kill those that did not start in
        time, pass the logged values to the callbacks."""
        with self._lock:
            running = [w for w in self._workers.values() if w.outcome is None]
        if running:
            ready, _ = ray.wait([w.ref for w in running], num_returns=len(running),
                                timeout=POLL_S)
            done = set(ready)
            for worker in running:
                if worker.ref in done:
                    self._finish(worker)
            self._check_starts([w for w in running if w.ref not in done])
        else:
            self._closing.wait(POLL_S)
        self._drain()

    def _check_starts(self, running: list[RayWorker]) -> None:
        waiting = [w for w in running if not w.running]
        if not waiting:
            return
        ready, _ = ray.wait([w.setup for w in waiting], num_returns=len(waiting), timeout=0)
        started = set(ready)
        now = time.monotonic()
        for worker in waiting:
            if worker.setup in started:
                worker.running = True
            elif now - worker.started > self.start_timeout:
                worker.note = (f"did not start within {self.start_timeout:g} s (timeout_s): "
                               "its actor was not scheduled or not up in time (see `ray "
                               "status`); it was killed")
                _kill(worker.actor)

    def _finish(self, worker: RayWorker) -> None:
        try:
            outcome: tuple[Any, ...] = tuple(ray.get(worker.ref))
        except RayError as exc:
            outcome = ("ray", exc)
        if outcome[0] == "result":
            status = 0
        elif outcome[0] == "exit":
            status = int(outcome[1])
        else:
            status = 1
        with self._lock:
            worker.outcome, worker.seq = outcome, next(self._seq)
        if not (outcome[0] == "ray" and isinstance(outcome[1], RayActorError)):
            try:  # idle now: let it exit cleanly (atexit: hora's shutdown), freeing its CPUs
                worker.exiting = worker.actor.__ray_terminate__.remote()
            except Exception:  # noqa: BLE001
                pass
        assert self._exits is not None
        self._exits.put((worker.wid, status))

    def _drain(self) -> None:
        if self.callbacks is None or self.callback_error is not None:
            return
        try:
            self.callbacks.drain()
        except Exception as exc:  # noqa: BLE001 (raised from run() once the job is over)
            log.error("hora.ray: a callback raised %s: %s; no more values are passed to the "
                      "callbacks, and run() raises it when the job ends",
                      type(exc).__name__, exc)
            self.callback_error = exc


def actor_death(error: BaseException) -> str:
    """The reason in Ray's text for a dead actor, in one sentence (``The actor died because
    its node has died``...), else its first line."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    found = re.search(r"The actor (?:died|is dead) because [^.]*", text)
    if found:
        return found.group(0)
    return _first_line(str(error)).rstrip(".") or type(error).__name__


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 (already gone)
        pass


__all__ = ["EXIT_GRACE_S", "RaySpawner", "RayWorker", "actor_death"]
