"""Process sets: named subsets of ranks that run collectives among themselves.

:class:`ProcessSet` is Horovod's public class; :class:`Registry` is the engine's id -> ranks
table. Set 0 is the global set. Registration order is identical on every rank (ids are assigned
by the coordinator), so ids agree everywhere.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from hora.errors import NotInitializedError

_rank_source: Callable[[], int] | None = None
"""This process's global rank, once :mod:`hora.core.engine.context` has set it up."""


def set_rank_source(source: Callable[[], int]) -> None:
    """Where :meth:`ProcessSet.rank` learns the global rank (the context installs it; this
    module cannot import the context, which imports it)."""
    global _rank_source
    _rank_source = source


class ProcessSet:
    """A subset of global ranks (Horovod's ``hvd.ProcessSet``).

    ``ranks`` are stored sorted. ``process_set_id`` is None until registered (0 = global set).
    """

    def __init__(self, ranks_or_comm: Iterable[int] | Any) -> None:
        self.mpi_comm: Any = None
        self.process_set_id: int | None = None
        if hasattr(ranks_or_comm, "Get_rank") and hasattr(ranks_or_comm, "Get_size"):
            self.mpi_comm = ranks_or_comm
            self.ranks: list[int] = []
            return
        ranks = list(ranks_or_comm)
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            raise ValueError(f"ProcessSet ranks must be integers, got {ranks!r}")
        self.ranks = sorted(ranks)

    def _registry_rank(self) -> int:
        if _rank_source is None:
            raise NotInitializedError("ProcessSet.rank")
        return _rank_source()

    def size(self) -> int | None:
        """Number of ranks, or None if not registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set, or None if not registered.

        Raises:
            ValueError: this process is not a member.
        """
        if self.process_set_id is None:
            return None
        me = self._registry_rank()
        if me not in self.ranks:
            raise ValueError(f"Rank {me} is not a member of {self}.")
        return self.ranks.index(me)

    def included(self) -> bool | None:
        """Whether this process is a member (None if ranks unknown)."""
        if not self.ranks and self.process_set_id is None:
            return None
        return self._registry_rank() in self.ranks

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


class Registry:
    """id -> sorted global ranks, for every registered set. Thread-safe."""

    def __init__(self, size: int) -> None:
        self._lock = threading.Lock()
        self._sets: dict[int, list[int]] = {0: list(range(size))}
        # set -> its ranks, read without the lock (one dict read is atomic, and a set's ranks
        # never change once registered): the submit path reads it for every op
        self.member_ranks: dict[int, tuple[int, ...]] = {0: tuple(range(size))}
        self._next_id = 1

    def register(self, ranks: list[int], set_id: int | None = None) -> int:
        """Register ``ranks`` under ``set_id`` (or the next free id); returns the id."""
        with self._lock:
            if set_id is None:
                set_id = self._next_id
            self._sets[set_id] = sorted(ranks)
            self.member_ranks[set_id] = tuple(self._sets[set_id])
            self._next_id = max(self._next_id, set_id + 1)
            return set_id

    def find(self, ranks: list[int]) -> int | None:
        """Id of a registered set with exactly these ranks."""
        with self._lock:
            for sid, members in self._sets.items():
                if members == sorted(ranks):
                    return sid
            return None

    def next_id(self) -> int:
        with self._lock:
            return self._next_id

    def remove(self, set_id: int) -> bool:
        with self._lock:
            if set_id == 0 or set_id not in self._sets:
                return False
            del self._sets[set_id]
            self.member_ranks.pop(set_id, None)
            return True

    def ranks(self, set_id: int) -> list[int] | None:
        with self._lock:
            members = self._sets.get(set_id)
            return None if members is None else list(members)

    def members(self, set_id: int) -> tuple[int, ...] | None:
        """The set's ranks, without a copy or a lock (the submit path calls this for every op;
        one dict read is atomic, and a set's ranks never change once registered)."""
        return self.member_ranks.get(set_id)

    def ids(self) -> list[int]:
        with self._lock:
            return sorted(self._sets)
