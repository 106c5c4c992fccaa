"""Collect what the workers return, fail fast when one fails, and say which rank it was.

Launcher side (the driver process). :func:`gather` waits for one object ref per rank, never
longer than needed after a failure: as soon as one rank fails it waits at most
:data:`FAILURE_GRACE_S` more for the others (ranks blocked in a collective with the failed rank
never finish on their own), then reports. :func:`raise_failure` turns the outcome into the
exception :meth:`RayExecutor.run` raises:

* a rank whose actor died (killed, out of memory, its node lost) -> :class:`RankFailedError`
  naming the rank, its pid and node; this is the root cause whenever it happened, since the
  errors of its peers (``PeerLostError``...) are its consequences;
* otherwise the first exception a rank raised that is not a hora collective failure (those
  follow from another rank's failure), re-raised with its own type, a note naming the rank,
  and the worker's traceback as ``__cause__`` (:class:`hora.runner.api.RemoteTraceback`, as
  ``hora.run`` does).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hora.errors import HoraInternalError, RankFailedError
from hora.runner.api import RemoteTraceback

log = logging.getLogger(__name__)

FAILURE_GRACE_S = 2.0
"""Seconds the other ranks get to finish (or fail) after the first failure is seen."""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

POLL_S = 0.1
"""How often the driver drains the callbacks' queue while it waits."""

WAKE_S = 0.5
"""The longest single ``ray.wait`` without callbacks: Python runs signal handlers (Ctrl-C,
pytest-timeout's alarm) only between waits, and an unbounded ``ray.wait`` can miss one."""


@dataclass
class Outcome:
    """What :func:`gather` saw.

    Attributes:
        values: each finished rank's return value.
        failures: ``(rank, error)`` in the order seen; ``error`` is Ray's exception
            (:class:`RayTaskError` for a raised exception, :class:`RayActorError` for a death).
        stuck: ranks still running when :func:`gather` gave up on them.
    """

    values: dict[int, Any] = field(default_factory=dict)
    failures: list[tuple[int, BaseException]] = field(default_factory=list)
    stuck: list[int] = field(default_factory=list)

    @property
    def dead(self) -> list[int]:
        """Ranks whose actor died."""
        return [r for r, e in self.failures if isinstance(e, RayActorError)]


class Callbacks:
    """The driver's side of ``ray_logger``: a queue actor the workers put values on, drained
    into ``callbacks`` while :func:`gather` waits."""

    def __init__(self, callbacks: Sequence[Callable[[Any], Any]]) -> None:
        from ray.util.queue import Queue

        for cb in callbacks:
            if not callable(cb):
                raise TypeError(f"callbacks must be callables, not {type(cb).__name__}")
        self.callbacks = list(callbacks)
        # No CPU: the workers' placement group may hold every CPU of the cluster. On the
        # driver's node: a node that leaves the cluster must not take the queue with it.
        here = ray.get_runtime_context().get_node_id()
        self.queue = Queue(actor_options={
            "num_cpus": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)})

    def drain(self) -> None:
        """Call every callback with every value queued so far, in order."""
        n = self.queue.qsize()
        if n:
            for value in self.queue.get_nowait_batch(n):
                for cb in self.callbacks:
                    cb(value)

    def close(self) -> None:
        """Drain what is left and stop the queue actor."""
        try:
            self.drain()
        finally:
            self.queue.shutdown()


def gather(refs: Sequence[Any], ranks: Sequence[int], *, callbacks: Callbacks | None = None,
           grace: float = FAILURE_GRACE_S) -> Outcome:
    """Wait for ``refs`` (``refs[i]`` is rank ``ranks[i]``'s result).

    Returns when every ref is ready, or ``grace`` seconds after the first failure; never
    raises for a worker's failure (see :class:`Outcome`).
    """
    outcome = Outcome()
    rank_of = dict(zip(refs, ranks, strict=True))
    pending = list(refs)
    deadline: float | None = None
    while pending:
        timeout = POLL_S if callbacks is not None else WAKE_S
        if deadline is not None:
            left = max(0.0, deadline - time.monotonic())
            timeout = min(timeout, left)
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        for ref in ready:
            rank = rank_of[ref]
            try:
                outcome.values[rank] = ray.get(ref)
            except RayError as exc:
                outcome.failures.append((rank, exc))
                if deadline is None:
                    deadline = time.monotonic() + grace
        if callbacks is not None:
            callbacks.drain()
        if deadline is not None and time.monotonic() >= deadline:
            break
    outcome.stuck = sorted(rank_of[ref] for ref in pending)
    return outcome


def _is_consequence(error: BaseException) -> bool:
    cause = getattr(error, "cause", None)
    return isinstance(cause, HoraInternalError)


def root_failure(outcome: Outcome) -> tuple[int, BaseException]:
    """The failure to report: a death first, then an error that is not a hora collective
    failure, then the first one seen."""
    for preferred in ([f for f in outcome.failures if isinstance(f[1], RayActorError)],
                      [f for f in outcome.failures if not _is_consequence(f[1])]):
        if preferred:
            return preferred[0]
    return outcome.failures[0]


def raise_failure(outcome: Outcome, size: int, what: str, where: Callable[[int], str],
                  stopped: bool) -> None:
    """Raise the exception describing ``outcome``'s root failure.

    Args:
        outcome: a :func:`gather` outcome with at least one failure.
        size: number of workers (for messages).
        what: the function's name (for messages).
        where: rank -> where it runs (for messages).
        stopped: the executor stopped its workers because of this failure (the message then
            says to call ``shutdown()`` and ``start()`` again).
    """
    rank, error = root_failure(outcome)
    others = sorted({r for r, _ in outcome.failures} - {rank})
    tail = ""
    if others:
        tail += f" Ranks {others} failed too."
    if outcome.stuck:
        tail += (f" Ranks {outcome.stuck} were still running {FAILURE_GRACE_S:g} s later "
                 "(blocked on the failed rank).")
    if stopped:
        tail += (" The executor's workers were stopped: call shutdown() and start() to run "
                 "again.")
    if isinstance(error, RayActorError):
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(".")
        raise RankFailedError(
            f"hora.ray: rank {rank} of {size} ({where(rank)}) died while running {what}: "
            f"{reason}.{tail}", rank=rank) from error
    assert isinstance(error, RayTaskError)
    cause = error.cause
    # Ray's "dual" exception (RayTaskError and the cause's class) keeps only its text.
    trace = RemoteTraceback(rank, _ANSI.sub("", str(vars(error).get("traceback_str") or error)))
    note = f"hora.ray: raised by rank {rank} of {size} ({where(rank)}) in {what}.{tail}"
    if isinstance(cause, BaseException) and not isinstance(cause, RayError):
        add_note = getattr(cause, "add_note", None)  # Python 3.11+
        if add_note is not None:
            add_note(note)
        raise cause from trace
    text = str(cause)
    if "No module named" in text:  # the function (or an argument) did not unpickle there
        text += (" HINT: a function defined in a module travels by reference, so the module "
                 "must import on the workers (their path holds the driver's working directory "
                 "and script directory); or send it by value with "
                 "ray.cloudpickle.register_pickle_by_value(module).")
    raise RankFailedError(f"{note} Its error: {text}", rank=rank) from trace


def function_name(fn: Any) -> str:
    """A readable name of ``fn`` for messages."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return f"{name}()" if name else repr(fn)


__all__ = ["FAILURE_GRACE_S", "Callbacks", "Outcome", "function_name", "gather",
           "raise_failure", "root_failure"]
