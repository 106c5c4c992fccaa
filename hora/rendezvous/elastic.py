"""The elastic membership protocol between ``hora run``'s elastic driver and its workers.

Rendezvous layer: used by the driver (:mod:`hora.runner.elastic.driver`) and by ``init()`` in an
elastic worker (:mod:`hora.core.engine.context`); it knows keys and values, not processes or
engines.

Everything goes through the job's rendezvous store, scope :data:`SCOPE`:

* every worker process has a job-unique id (``HORA_ELASTIC_WORKER_ID``, set by the driver);
* a worker about to (re)join posts ``ready.<id>`` = the last generation it was a member of
  (``0`` for a newcomer) and bumps the counter ``events``; it then waits for the driver's answer
  under ``answer.<id>.<last>``;
* the driver forms generation ``g + 1`` from the workers ready after ``g`` (and newcomers) and
  answers each with an :class:`Assignment`: rank, size, local/cross ranks, host, and the store
  scope of the new generation's connections (``hora.elastic.<g+1>``). Or it answers with a
  :class:`Stop`: ``removed`` (the worker's host left the job), ``finished`` (another worker
  finished training: exit 0) or ``failed`` (the job cannot go on; the message says why);
* while generation ``g`` trains, the driver posts ``notice.<g>`` when membership should change
  (a newcomer is ready, a host was removed); rank 0 reads it at each ``commit()`` /
  ``check_host_updates()`` and broadcasts the decision, so every rank interrupts at the same
  step.
"""

from __future__ import annotations

import enum
import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from hora._util.log import get_logger
from hora.errors import ElasticError, RendezvousError, RendezvousTimeoutError
from hora.rendezvous.store_client import KVStoreClient
from hora.rendezvous.topology import Slot, identity_environment

log = get_logger(__name__)

SCOPE = "hora.elastic"
EVENTS = "events"
WORKER_ID_VAR = "HORA_ELASTIC_WORKER_ID"

_POLL_S = 2.0


class HostUpdateResult(enum.IntFlag):
    """Horovod's flags for what changed in the host set."""

    no_update = 0
    removed = 1
    added = 2
    mixed = 3


@dataclass(frozen=True)
class Assignment:
    """A worker's place in one generation of the elastic job."""

    generation: int
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str

    @property
    def scope(self) -> str:
        """The store scope of this generation's connections."""
        return f"{SCOPE}.{self.generation}"

    def environment(self) -> dict[str, str]:
        """The identity variables a worker of this generation runs with (Horovod overwrites its
        ``HOROVOD_RANK`` ... variables the same way after a reset)."""
        return identity_environment(Slot(
            rank=self.rank, size=self.size, hostname=self.hostname, local_rank=self.local_rank,
            local_size=self.local_size, cross_rank=self.cross_rank, cross_size=self.cross_size))


@dataclass(frozen=True)
class Stop:
    """The driver's answer to a worker that must not join another generation."""

    reason: str  # "removed", "finished" or "failed"
    message: str


def ready_key(worker_id: int) -> str:
    return f"ready.{worker_id}"


def answer_key(worker_id: int, last_generation: int) -> str:
    return f"answer.{worker_id}.{last_generation}"


def notice_key(generation: int) -> str:
    return f"notice.{generation}"


def encode(answer: Assignment | Stop) -> bytes:
    kind = "assignment" if isinstance(answer, Assignment) else "stop"
    return json.dumps({"kind": kind, **asdict(answer)}).encode()


def decode(raw: bytes) -> Assignment | Stop:
    data = json.loads(raw.decode())
    kind = data.pop("kind")
    return Assignment(**data) if kind == "assignment" else Stop(**data)


def worker_id(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's elastic worker id, or None when it is not an elastic worker."""
    env = os.environ if environ is None else environ
    raw = env.get(WORKER_ID_VAR)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise RendezvousError(f"{WORKER_ID_VAR}={raw!r} is not an integer; it is set by `hora "
                              "run` in elastic mode and must not be set by hand") from None


class WorkerSession:
    """A worker's side of the protocol, alive across ``shutdown()`` / ``init()`` cycles.

    Args:
        client: a store connection of its own (not the one a generation's ``init`` closes).
        worker_id: from :func:`worker_id`.
    """

    def __init__(self, client: KVStoreClient, worker_id: int) -> None:
        self.client = client
        self.worker_id = worker_id
        self.generation = 0  # the last generation this worker was a member of
        self.failed_at: float | None = None  # when the last generation failed (for the log)

    def join(self, patience: float | None = None) -> Assignment:
        """Say this worker is ready for the next generation and wait for the driver's answer.

        Waits as long as the driver lives (it answers within the elastic timeout, or tells
        the worker to stop), or ``patience`` seconds when given.

        Raises:
            SystemExit: (code 0) the driver removed this worker or another finished training.
            ElasticError: the driver ended the job (its message says why), or no answer within
                ``patience``.
            RendezvousError: the driver's store is gone (the launcher died).
        """
        last = self.generation
        self.client.set(SCOPE, ready_key(self.worker_id), str(last).encode())
        self.client.add(SCOPE, EVENTS, 1)
        deadline = None if patience is None else time.monotonic() + patience
        while True:
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if wait <= 0:
                raise ElasticError(f"elastic worker {self.worker_id}: the driver gave no "
                                   f"assignment within {patience:g} s")
            try:
                raw = self.client.get(SCOPE, answer_key(self.worker_id, last), wait)
                break
            except RendezvousTimeoutError:
                continue
        answer = decode(raw)
        if isinstance(answer, Stop):
            if answer.reason in ("removed", "finished"):
                log.warning("elastic worker %d leaves the job: %s", self.worker_id,
                            answer.message)
                raise SystemExit(0)
            raise ElasticError(answer.message)
        self.generation = answer.generation
        return answer

    def host_update(self) -> HostUpdateResult:
        """What the driver posted for the current generation (rank 0 asks; no waiting)."""
        try:
            raw = self.client.get(SCOPE, notice_key(self.generation), 0.0)
        except RendezvousTimeoutError:
            return HostUpdateResult.no_update
        return HostUpdateResult(int(raw))

    def close(self) -> None:
        self.client.close()


_session: WorkerSession | None = None


def session(connect: bool = True) -> WorkerSession | None:
    """This process's :class:`WorkerSession` (made on first use from the launcher's
    environment), or None when the process is not an elastic worker."""
    global _session
    if _session is None and connect:
        wid = worker_id()
        if wid is None:
            return None
        from hora.rendezvous.env import _secret_from_env

        env = os.environ
        host = env.get("HORA_RENDEZVOUS_ADDR") or env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
        port = env.get("HORA_RENDEZVOUS_PORT") or env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
        secret = _secret_from_env(env)
        if not host or not port or not port.isdigit() or secret is None:
            raise RendezvousError(
                f"{WORKER_ID_VAR} is set but HORA_RENDEZVOUS_ADDR, HORA_RENDEZVOUS_PORT or "
                "HORA_SECRET_KEY is missing or malformed: elastic workers must be started by "
                "`hora run` in elastic mode (--min-np / --host-discovery-script)")
        _session = WorkerSession(KVStoreClient(host, int(port), secret), wid)
    return _session


__all__ = ["SCOPE", "Assignment", "HostUpdateResult", "Stop", "WorkerSession", "answer_key",
           "decode", "encode", "notice_key", "ready_key", "session", "worker_id"]
