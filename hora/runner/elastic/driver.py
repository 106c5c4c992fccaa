"""The elastic driver: ``hora run`` with ``--min-np`` or ``--host-discovery-script``.

Runner layer. The driver serves the job's rendezvous store, polls host discovery every second,
starts one worker per usable slot (up to ``--max-np``; a process, locally or over ssh, as
fixed-size jobs, or whatever its :class:`~hora.runner.elastic.spawner.Spawner` starts: Ray
actors for ``hora.ray.ElasticRayExecutor``), and forms *generations*: the set of workers that
train together, their ranks and size (protocol: :mod:`hora.rendezvous.elastic`; bookkeeping:
:mod:`hora.runner.elastic.members`).

* **A worker fails** (exits non-zero): its host's failure is counted (:mod:`.health`: a host
  is blacklisted on its second failure, so one crash on a healthy machine does not take the
  machine out, and only when the job can go on without it; otherwise its failed workers are
  replaced after a doubling backoff, up to ``--elastic-replace-limit``), the survivors'
  collectives fail, they roll back to their last commit and say they are ready; when every
  surviving member is ready the driver forms the next generation from them. Meanwhile a
  replacement is started on a free slot: it joins at a later commit.
* **A worker hangs** (SIGSTOP, a debugger): its peers' heartbeats name it; a member that its
  peers report lost and that does not rejoin is killed with its process group and the others
  go on without it (:mod:`.lost`).
* **A newcomer is ready** (a replacement, or a worker on a new host): the driver posts a notice
  for the running generation; at the next ``commit()`` every rank stops, and the next
  generation includes the newcomer.
* **Too few workers**: a generation is formed only with at least ``--min-np`` workers. The
  driver waits ``--elastic-timeout`` seconds for more, then tells every waiting worker to stop
  with the reason and exits 1 (no silent wait for ever).
* **Training finished**: the first worker that exits 0 ends the job; the others are told to
  leave when they next ask, and the launcher exits 0 once all have ended.
* ``--reset-limit N``: the job fails at the (N+1)-th reset, with Horovod's message.
"""

from __future__ import annotations

import os
import queue
import secrets
import threading
import time
from collections import Counter
from collections.abc import Mapping

from hora.errors import DiscoveryError, RendezvousTimeoutError
from hora.rendezvous import elastic as proto
from hora.rendezvous.kvstore import KVStoreServer
from hora.rendezvous.store_client import KVStoreClient
from hora.runner import launch as launch_mod
from hora.runner.elastic.discovery import describe
from hora.runner.elastic.generations import Generations
from hora.runner.elastic.hostpolicy import HostPolicy
from hora.runner.elastic.lost import LostReports
from hora.runner.elastic.members import Member, Places, summary
from hora.runner.elastic.options import DEFAULT_ELASTIC_TIMEOUT_S, ElasticOptions
from hora.runner.elastic.poller import DiscoveryPoller
from hora.runner.elastic.spawner import ProcessSpawner, Spawner, SpawnError
from hora.runner.failures import exit_status, signal_name
from hora.runner.local import _stop_signals
from hora.runner.output import CONSOLE, Console

_TICK_S = 0.05
_STOP_GRACE_S = 10.0  # how long told-to-stop workers get before they are stopped

CLI_NAMES: Mapping[str, str] = {
    "np": "-np", "min_np": "--min-np", "elastic_timeout": "--elastic-timeout",
    "reset_limit": "--reset-limit", "cooldown_range": "--blacklist-cooldown-range",
    "replace_limit": "--elastic-replace-limit"}
"""The names the driver's messages give the settings (``hora run``'s flags by default; an API
with other names passes its own, e.g. ``hora.ray``'s ``min_num_proc``)."""


class ElasticDriver(Generations):
    """Runs one elastic job; :meth:`run` returns the launcher's exit status.

    Args:
        spec: the job (``spec.np`` workers must be ready to form the first generation).
        options: what makes it elastic.
        environ: the environment the workers inherit (filtered as ``hora run`` filters it).
        console: where messages go.
        spawner: what starts the workers (default: processes, local or over ssh).
        names: the settings' names in messages (default :data:`CLI_NAMES`).

    After :meth:`run`, ``failure`` holds the reason the job could not go on (None when it
    finished, was interrupted, or a worker failed after training finished).
    """

    def __init__(self, spec: launch_mod.LaunchSpec, options: ElasticOptions, *,
                 environ: Mapping[str, str], console: Console = CONSOLE,
                 spawner: Spawner | None = None, names: Mapping[str, str] = CLI_NAMES) -> None:
        self.spec, self.options, self.console = spec, options, console
        self.spawner: Spawner = spawner if spawner is not None else ProcessSpawner(
            spec, options.max_np or spec.np, console)
        self.names = names
        self.failure: str | None = None
        self.hosts = HostPolicy(options.min_np, options.cooldown_range, names)
        self.health = self.hosts.health
        self.members: dict[int, Member] = {}
        self.generation = 0
        self.resets = 0
        self.timeout = DEFAULT_ELASTIC_TIMEOUT_S
        self._environ = environ
        self._exits: queue.Queue[tuple[int, int]] = queue.Queue()
        self._next_wid = 0
        self._events = -1
        self._interrupt: int | None = None
        self._reset_since: float | None = None  # when the running generation started failing
        self._short_since: float | None = None  # since when too few workers were ready
        self._finished: Member | None = None
        self._finished_at = 0.0
        self._notice = proto.HostUpdateResult.no_update
        self._late_failures: list[Member] = []
        self._running: list[Member] = []  # the members of the running generation when formed
        self._lost = LostReports()
        self._places = Places()  # which slot of its host each worker holds (CPU binding)

    def on_signal(self, signum: int) -> None:
        self._interrupt = signum
        close = getattr(self.options.discovery, "close", None)
        if callable(close):  # a discovery script running now (the first poll) ends at once
            close()

    # ---- set-up -------------------------------------------------------------------------------

    def run(self) -> int:
        spec = self.spec
        own = launch_mod.launcher_variables(spec, self._environ)
        base = {**launch_mod.forwardable_environment(self._environ), **own,
                "HORA_ELASTIC": "1", "HOROVOD_ELASTIC": "1"}
        config = launch_mod.validate(spec, base)
        self.timeout = (config.elastic_timeout if self.options.elastic_timeout is None
                        else self.options.elastic_timeout)
        self.hosts.configure(config.elastic_replace_backoff, config.elastic_replace_limit)
        try:
            first = self.options.discovery.find_available_hosts_and_slots()
        except DiscoveryError as exc:  # the first poll must work (Horovod's rule)
            if self._interrupt is not None:
                return self._interrupted()
            self.failure = f"host discovery failed at start: {exc}"
            self.console.say(f"elastic: {self.failure}")
            return 1
        job_id = secrets.token_hex(8)
        address = self.spawner.open(first, config, self._exits, job_id)
        secret = secrets.token_hex(32)
        try:
            self._server = KVStoreServer(bytes.fromhex(secret), address, 0).start()
        except BaseException:
            self.spawner.close([])
            raise
        self._discovery = DiscoveryPoller(self.options.discovery, first)
        try:
            self._client = KVStoreClient(self._server.host, self._server.port,
                                         bytes.fromhex(secret))
            self._env = {**base, "HORA_RENDEZVOUS_ADDR": self._server.host,
                         "HORA_RENDEZVOUS_PORT": str(self._server.port),
                         "HOROVOD_GLOO_RENDEZVOUS_ADDR": self._server.host,
                         "HOROVOD_GLOO_RENDEZVOUS_PORT": str(self._server.port),
                         "HORA_JOB_ID": job_id, launch_mod.SECRET_VAR: secret}
            self._say(f"elastic job: min {self.options.min_np}, max "
                      f"{self.options.max_np or 'unbounded'} workers, start with "
                      f"{spec.np}; hosts: {describe(first)}", verbose_only=True)
            self._discovery.start()
            return self._loop()
        finally:
            self._discovery.stop()
            self.spawner.close([m.process for m in self.members.values()
                                if m.process is not None])
            self._server.close()

    # ---- the loop -----------------------------------------------------------------------------

    def _loop(self) -> int:
        started = time.monotonic()
        while True:
            if self._interrupt is not None:
                return self._interrupted()
            self._reap()
            self._read_ready()
            for text, verbose_only in self._discovery.messages():
                self._say(text, verbose_only=verbose_only)
            if self._finished is not None:
                status = self._finishing()
                if status is not None:
                    return status
            else:
                self._spawn()
                status = self._all_blacklisted() or self._decide(started)
                if status is not None:
                    return status
            time.sleep(_TICK_S)

    def _interrupted(self) -> int:
        assert self._interrupt is not None
        alive = sum(m.alive for m in self.members.values())
        self.console.say(f"received {signal_name(self._interrupt)}; stopping {alive} worker(s).")
        self.console.interrupted(self._interrupt)
        return exit_status(-self._interrupt)

    def _all_blacklisted(self) -> int | None:
        """Horovod's rule: when every host that ran workers is blacklisted and none is running,
        the job cannot go on."""
        hosts = {m.host for m in self.members.values()}
        if not hosts or not all(self.health.is_blacklisted(h) for h in hosts):
            return None
        if any(m.alive and m.leaving is None for m in self.members.values()):
            return None
        if self._usable():
            return None
        return self._fail(f"every host that ran workers is blacklisted after repeated failures "
                          f"({', '.join(sorted(hosts))}) and discovery lists no other; see the "
                          "workers' errors above")

    def _usable(self) -> dict[str, int]:
        return self.hosts.usable(self._discovery.hosts)

    def _spawn(self) -> None:
        """Start workers on free usable slots, up to --max-np live workers."""
        live = [m for m in self.members.values() if m.alive and m.leaving is None]
        room = (self.options.max_np or 1 << 30) - len(live)
        if self.generation == 0 and not self.members:
            room = min(room, max(self.spec.np, sum(self._usable().values())))
        for host, slots in self._usable().items():
            if not self.hosts.may_start(host):
                continue
            free = slots - sum(1 for m in live if m.host == host)
            while free > 0 and room > 0:
                self._start(host, slots)
                free -= 1
                room -= 1

    def _start(self, host: str, slots: int) -> None:
        wid = self._next_wid
        self._next_wid += 1
        env = {**self._env, proto.WORKER_ID_VAR: str(wid), "HORA_HOSTNAME": host,
               "HOROVOD_HOSTNAME": host}
        place = self._places.take(self.members.values(), host, slots)
        member = Member(wid=wid, host=host, started=time.monotonic(),
                        place=None if place is None else place[0])
        self.members[wid] = member
        try:
            member.process = self.spawner.start(wid, host, env, place)
        except SpawnError as exc:
            self.console.say(exc.message)
            self._exits.put((wid, exc.status))
            return
        joins = "starting" if self.generation == 0 else "starting a newcomer:"
        self._say(f"{joins} worker {wid} on {host}", verbose_only=self.generation == 0)

    def _reap(self) -> None:
        while True:
            try:
                wid, code = self._exits.get_nowait()
            except queue.Empty:
                return
            m = self.members[wid]
            m.exit_code = code
            if m.leaving is not None:
                continue
            if code == 0:
                if self._finished is None:
                    self._finished, self._finished_at = m, time.monotonic()
                    self._say(f"{m.describe()} finished training (exit 0); ending the job")
                continue
            if self._finished is not None:
                self._late_failures.append(m)
                continue
            if self._reset_since is None and m.current == self.generation and not m.lost:
                self._reset_since = time.monotonic()  # (a dropped member left already)
            self._failed(m, code)

    def _failed(self, m: Member, code: int) -> None:
        """Count ``m``'s failure against its host (:mod:`.hostpolicy`) and say it."""
        live = Counter(w.host for w in self.members.values() if w.alive and w.leaving is None)
        healthy = Counter(w.host for w in self.members.values() if w.alive and w.leaving is None
                          and w.current == self.generation > 0)
        blacklisted, note = self.hosts.failed(m.host, self._usable(), live, healthy)
        how = self.spawner.describe_exit(m.wid, code) + (" (killed as lost)" if m.lost else "")
        self._say(f"{m.describe()} {how}{note}")
        if blacklisted:
            for other in self.members.values():
                if other.alive and other.host == m.host and other.leaving is None:
                    self._tell(other, proto.Stop("removed", f"host {m.host} is blacklisted"))

    def _read_ready(self) -> None:
        events = self._client.add(proto.SCOPE, proto.EVENTS, 0)
        if events == self._events:
            return
        self._events = events
        for m in self.members.values():
            if not m.alive:
                continue
            self._lost.read(self._client, m.wid)  # posted before the worker's ready
            try:
                raw = self._client.get(proto.SCOPE, proto.ready_key(m.wid), 0.0)
            except RendezvousTimeoutError:
                continue
            m.ready_after = int(raw)

    def _tell(self, m: Member, answer: proto.Assignment | proto.Stop) -> None:
        """Answer ``m``'s readiness (or pre-answer it: a worker not yet ready reads the answer
        when it asks: a member training now asks after its current generation). A Stop marks it
        leaving and its process is stopped if it lingers."""
        after = m.current or 0
        if m.ready_after is not None and (m.waiting or m.current is None):
            after = m.ready_after
        self._client.set(proto.SCOPE, proto.answer_key(m.wid, after), proto.encode(answer))
        m.answered = after
        if isinstance(answer, proto.Stop):
            m.leaving = answer.reason
            m.current = None
            if m.process is not None and m.alive:
                timer = threading.Timer(_STOP_GRACE_S, self.spawner.stop, args=(m.process,))
                timer.daemon = True  # the launcher's exit stops every worker anyway
                timer.start()

    def _finishing(self) -> int | None:
        done = self._finished.describe() if self._finished is not None else "a worker"
        for m in self.members.values():  # the waiting, and newcomers still starting (told now,
            # they leave when they ask; one that never asks is stopped after the grace period)
            if m.alive and m.leaving is None and (m.waiting or m.current is None):
                self._tell(m, proto.Stop("finished", f"{done} finished training"))
        live = [m for m in self.members.values() if m.alive]
        if not live:
            for m in self._late_failures:
                self._say(f"{m.describe()} failed (exit {m.exit_code}) after {done} finished "
                          "training")
            return self._late_failures[0].exit_code or 1 if self._late_failures else 0
        if time.monotonic() - self._finished_at > self.timeout:
            self._say(f"{summary(live)} still running {self._timeout_text()} after training "
                      "finished; stopping them")
            return 1
        return None

    def _fail(self, message: str) -> int:
        self.failure = message
        self._say(f"error: elastic job failed: {message}")
        for m in self.members.values():
            if m.alive and m.leaving is None:
                self._tell(m, proto.Stop("failed", f"the elastic job failed: {message}"))
        # workers still training read their stop when they next ask: make them ask at their
        # next commit, else they would train on until the grace period ends
        self._notify(proto.HostUpdateResult.removed)
        deadline = time.monotonic() + _STOP_GRACE_S
        while time.monotonic() < deadline and any(m.alive for m in self.members.values()):
            self._reap()
            time.sleep(_TICK_S)
        return 1

    def _timeout_text(self) -> str:
        return f"{self.timeout:g} s ({self.names['elastic_timeout']})"

    def _say(self, text: str, *, verbose_only: bool = False) -> None:
        if self.spec.verbose or not verbose_only:
            self.console.say(f"elastic: {text}")


def run_elastic(spec: launch_mod.LaunchSpec, options: ElasticOptions, *,
                environ: Mapping[str, str] | None = None, console: Console = CONSOLE) -> int:
    """Run an elastic job; returns the launcher's exit status (0: a worker finished training;
    1: the job could not go on, with the reason said; 128 + N: the launcher got signal N)."""
    driver = ElasticDriver(spec, options, environ=os.environ if environ is None else environ,
                           console=console)
    with _stop_signals(driver.on_signal):
        return driver.run()


__all__ = ["CLI_NAMES", "ElasticDriver", "run_elastic"]
