"""The elastic driver's bookkeeping of worker processes, and how a generation is formed.

Runner layer, no processes here (the driver owns them): a :class:`Member` records one worker
process from its start to its exit; :func:`form_generation` turns the workers ready for the next
generation into :class:`~hora.rendezvous.elastic.Assignment` s.

Rank order (the rule that makes the state broadcast after a reset come from the most up-to-date
worker): hosts ordered by their oldest worker, workers on a host by age; a worker's age is the
generation it first joined, then its id. So surviving hosts keep the lowest ranks, rank 0 is the
oldest surviving worker, newcomers come last.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hora.rendezvous.elastic import Assignment
from hora.rendezvous.topology import compute_topology


@dataclass(eq=False)
class Member:
    """One worker process of the elastic job.

    Attributes:
        wid: job-unique worker id (``HORA_ELASTIC_WORKER_ID``; its output lines' prefix).
        host: the host it runs on.
        started: when it was started (monotonic clock).
        process: the driver's handle on the process.
        generation: the first generation it was a member of (None: not yet a member).
        current: the generation it is a member of now (None: not a member).
        ready_after: the generation it last said it is ready after (0: newcomer), or None.
        answered: the ``ready_after`` value the driver last answered.
        exit_code: its exit status once it ended.
        leaving: why the driver told it to go ("removed", "finished", "failed"), or None.
        rank: its rank in the generation it is a member of now (None: not a member).
        lost: why the driver dropped it as hung (its peers named it lost and it did not rejoin),
            or None.
        place: the slot of its host it holds, whose share of the host's cores it is bound to
            (``--cpu-binding``), or None (not bound).
    """

    wid: int
    host: str
    started: float
    process: Any = None
    generation: int | None = None
    current: int | None = None
    ready_after: int | None = None
    answered: int | None = None
    exit_code: int | None = None
    leaving: str | None = None
    rank: int | None = None
    lost: str | None = None
    place: int | None = None

    @property
    def alive(self) -> bool:
        return self.exit_code is None

    @property
    def waiting(self) -> bool:
        """Said it is ready and has no answer yet."""
        return self.alive and self.ready_after is not None and self.answered != self.ready_after

    def describe(self) -> str:
        return f"worker {self.wid} on {self.host}"


def age(member: Member) -> tuple[float, int]:
    return (math.inf if member.generation is None else member.generation, member.wid)


def rank_order(members: Sequence[Member]) -> list[Member]:
    """``members`` in rank order: hosts by their oldest member, then members by age."""
    by_host: dict[str, list[Member]] = {}
    for m in sorted(members, key=age):
        by_host.setdefault(m.host, []).append(m)
    ordered: list[Member] = []
    for host_members in sorted(by_host.values(), key=lambda ms: age(ms[0])):
        ordered.extend(host_members)
    return ordered


def form_generation(members: Sequence[Member], generation: int) -> dict[int, Assignment]:
    """Assignments of generation ``generation`` for ``members`` (any order): worker id ->
    :class:`Assignment`, with Horovod's local and cross ranks."""
    ordered = rank_order(members)
    slots = compute_topology([m.host for m in ordered])
    return {m.wid: Assignment(generation=generation, rank=s.rank, size=s.size,
                              local_rank=s.local_rank, local_size=s.local_size,
                              cross_rank=s.cross_rank, cross_size=s.cross_size, hostname=m.host)
            for m, s in zip(ordered, slots, strict=True)}


class Places:
    """Which slot of its host a new worker takes, for ``--cpu-binding``: slot ``i`` of the
    host's ``n`` runs on the ``i``-th of ``n`` shares of the host's cores
    (:mod:`hora.runner.binding`). A worker keeps its slot for life (its rank changes from one
    generation to the next); a replacement takes the lowest free one."""

    def __init__(self) -> None:
        self._cut: dict[str, int] = {}  # per host: the slot count its live workers were bound by

    def take(self, members: Iterable[Member], host: str, slots: int) -> tuple[int, int] | None:
        """(slot, slots) for a new worker on ``host``, which discovery lists with ``slots``
        slots now, or None: do not bind it. The host's cut stays while a worker bound by it
        lives, so that shares never overlap: a worker started while discovery gives the host
        another slot count, or while every slot is held (a worker told to leave has not ended
        yet), is not bound."""
        held = {m.place for m in members if m.alive and m.host == host and m.place is not None}
        cut = self._cut.get(host, slots) if held else slots
        self._cut[host] = cut
        if cut != slots:
            return None
        return next(((i, cut) for i in range(cut) if i not in held), None)


def summary(members: Sequence[Member]) -> str:
    """``"worker 0 on a, worker 3 on b"`` (or ``"none"``)."""
    return ", ".join(m.describe() for m in members) or "none"


__all__ = ["Member", "Places", "age", "form_generation", "rank_order", "summary"]
