"""Automatic op names that cannot drift apart across ranks.

An op submitted without ``name=`` is called ``<prefix>.noname.<n>``; ranks pair ops by name, so
the ``n`` of the k-th unnamed op must be the same on every rank. Two rules keep it so:

* **one counter per (process set, prefix)**: an unnamed op that only some ranks issue (an
  ``allgather`` a rank tried while another had joined, a ``reducescatter`` one rank skipped
  after an assertion) shifts only the later ops of that kind, never the names of other kinds
  (``allgather_object``, ``barrier``, ...);
* **failed ops resynchronise the counter**: the coordinator's error for an op goes to every
  member of its set, and each member moves its counter for that prefix past the failed name
  (:meth:`AutoNames.observe`), so the ranks that issued the op and those that did not agree
  again on the next name.

Horovod numbers unnamed ops by one process-wide handle counter, so one op a rank issues alone
shifts every later unnamed op on that rank: a certain stall. Its object collectives name
themselves after the object's type, which makes ``broadcast_object(x if root else None)`` a
stall too; hora's object collectives use their own counters instead.
"""

from __future__ import annotations

import re
import threading

_AUTO = re.compile(r"^([A-Za-z_]+)\.noname\.(\d+)(?:$|[._])")


def is_automatic(name: str) -> bool:
    """Whether ``name`` is an automatic name (``<prefix>.noname.<n>...``, made by
    :class:`AutoNames`): it never recurs. (A name the caller chose that merely contains
    ``noname``, as ``DistributedOptimizer``'s defaults for unnamed parameters, is not.)"""
    return _AUTO.match(name) is not None


class AutoNames:
    """Counters for automatic op names, per (process set, op prefix). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[int, str], int] = {}

    def next(self, set_id: int, prefix: str) -> int:
        """The number of the next unnamed ``prefix`` op on ``set_id`` (1, 2, ...)."""
        key = (set_id, prefix)
        with self._lock:
            n = self._counters.get(key, 0) + 1
            self._counters[key] = n
            return n

    def name(self, prefix: str, name: str | None, set_id: int) -> str:
        """``<prefix>.<name>``, or ``<prefix>.noname.<n>`` when no name was given."""
        return f"{prefix}.{name}" if name else f"{prefix}.noname.{self.next(set_id, prefix)}"

    def base(self, prefix: str, name: str | None, set_id: int) -> str:
        """The base of a multi-op name (grouped and object collectives): ``name`` or
        ``noname.<n>`` counted under ``prefix``."""
        return name or f"noname.{self.next(set_id, prefix)}"

    def observe(self, set_id: int, name: str) -> None:
        """An op called ``name`` failed on ``set_id``: later unnamed ops of its kind are
        numbered after it on this rank too (whether or not this rank issued it)."""
        match = _AUTO.match(name)
        if match is None:
            return
        key, n = (set_id, match.group(1)), int(match.group(2))
        with self._lock:
            if self._counters.get(key, 0) < n:
                self._counters[key] = n
