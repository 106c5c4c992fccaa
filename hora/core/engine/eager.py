"""The response cache across hosts, eager: a small cached allreduce agrees inside its exchange.

A hit of the cross-host cache (:mod:`hora.core.engine.cross_cache`) otherwise waits for rank
0's decision (mark -> rank 0 -> ``cdec``) and then runs its collective (recursive doubling for
a small one: two more hops for 4 ranks). For an *eager slot* the agreement is the exchange
itself. The rules, every rank alike:

* **Eager slots.** A slot is eager when its response is a single-tensor allreduce (Sum,
  Average, Min, Max or Product; no prescale, no joined rank) of at most ``small_allreduce_bytes``
  bytes, in a job of at most :data:`MAX_RANKS` ranks, one rank per host, with the
  ``eager_cache`` knob on and the builtin data plane (decided from the response and the job:
  the same on every rank). Everything else keeps rank 0's decision.
* **The exchange** (a star through rank 0, over the control connections every rank already
  has): a rank *commits* round ``k`` of slot ``s`` by sending rank 0 its input, tagged
  ``(s, k)``; rank 0, once it holds every rank's data for ``(s, k)`` (its own included),
  reduces them in rank order (rank 0's the left operand, then rank 1's, ...), scales, and sends
  the result to every other rank, which completes its op with those bytes: bitwise the same
  result everywhere. Two hops per op, no engine hand-off beyond the exchange's own, and
  ``2 (N - 1)`` messages a round (all-to-all would take ``N (N - 1)``; on a machine whose
  cores the ranks share, measured slower: docs/multihost.md). Data that reaches rank 0 before
  its own op is kept keyed by ``(s, k)``. The engine thread never blocks on it: data and
  results are handled in its receive loop.
* **Rounds.** ``k`` is how many rounds of ``s`` this rank committed before (counted alike on
  every rank: a round completes only when every rank committed it, and a name is never in
  flight twice on a rank, so the ranks' counts of a slot differ by at most one). Completion
  implies every rank committed the round.
* **The bound** (:data:`MAX_RANKS` = 16): rank 0 receives, reduces and answers ``N - 1``
  messages per op, the per-rank work the host leaders' cache exists to avoid for large jobs;
  for a few ranks it is cheaper than the decision's hops. One rank per host: a host's leader
  combines its ranks' marks for the decision path (not measured with eager slots).
* **Dead rounds.** A rank that misses on an eager slot (a changed signature, a grouped or
  device op), joins, says goodbye, or is asked about a stalled round it has not committed,
  *declares* the slot's next round (its count) dead: it will never commit it. Rank 0 knows the
  count from the data it received, which travels before the request on the same connection;
  an asked rank answers with it (``cdead``). Rank 0 sends every rank ``(slot, dead round)``
  (in ``cdec``); a slot's dead round is the least declared. A rank pending on a round at or
  after it converts the op to a negotiated request (the coordinator then sees every rank's
  request: its mismatch text on every rank, its stall inspector, its deadlock detector); one
  pending on an earlier round keeps it (every rank committed or will commit that round); a
  rank whose count is below the dead round still commits those rounds eagerly; a rank at or
  past it drops the slot and negotiates. Data or results for a dead round are discarded.
* **Stalls and deadlocks.** Rank 0 counts every rank's rounds per slot; a round some ranks
  committed and others not for the cache's patience, or one a blocked rank waits on (a wait
  report), is asked about (``cask``) at the late ranks; a late rank that has not committed it
  declares it dead, so the others negotiate it and the stall inspector names the late ranks
  (a deadlock among them is the detector's ``DeadlockError`` on every rank); one that has
  committed it ignores the question (the round completes).
* **Failure and shutdown.** A rank that dies closes its connection to rank 0, which fails the
  job naming it (every rank's pending ops fail, eager ones among them: they sit in the
  engine's table of ops awaiting a response); rank 0's death is seen by every rank. A rank
  leaving (its own shutdown or rank 0's) first completes the eager ops whose data or result is
  on its way (it travels before the sender's goodbye or shutdown), at most 5 s.

:class:`EagerRounds` is a rank's state machine, :class:`EagerCounts` rank 0's counters;
:mod:`hora.core.engine.eager_link` is the engine's side.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field
from typing import Any

from hora.errors import ProtocolError

MAX_RANKS = 16
"""Most ranks of a job whose cache runs eager slots (see the module's docstring)."""
MSG_EAGER_DEAD = "cdead"
"""A rank -> rank 0: ``{"slot": s, "round": k}``: this rank will never commit round k of s."""
MSG_EAGER_ASK = "cask"
"""Rank 0 -> a late rank: ``{"slot": s, "round": k}``: declare round k dead unless committed."""

_MARK = 1  # first byte of an eager data message (a control message is JSON '{', a frame 0)
_HEAD = struct.Struct("!BII")  # marker, slot, round
_NEVER = 1 << 62


_RESULT = 2  # first byte of rank 0's result of a round (the star exchange)


def pack(slot: int, rnd: int, data: bytes, result: bool = False) -> bytes:
    """An eager data message: this rank's data for round ``rnd`` of ``slot`` (``result``: rank
    0's reduced result of it)."""
    return _HEAD.pack(_RESULT if result else _MARK, slot, rnd) + data


def is_data(payload: bytes) -> bool:
    return payload[:1] in (b"\x01", b"\x02")


def unpack(payload: bytes) -> tuple[int, int, bytes, bool]:
    """``(slot, round, data, result)`` of :func:`pack`'s message.

    Raises:
        ProtocolError: too short.
    """
    if len(payload) < _HEAD.size:
        raise ProtocolError("malformed eager data message")
    mark, slot, rnd = _HEAD.unpack_from(payload)
    return slot, rnd, payload[_HEAD.size:], mark == _RESULT


@dataclass
class Pending:
    """This rank's op committed to round ``round`` of ``slot``, waiting for the others' data."""

    slot: int
    round: int
    op: Any  # the engine's entry
    parts: list[bytes | None]
    have: int = 0
    done: bool = field(default=False)


class EagerRounds:
    """One rank's eager slots (see the module's docstring): rounds committed, dead rounds, the
    pending op per slot and data that came before this rank's own op. Rank 0 completes a round
    when every rank's data is in (:meth:`arrive`); the others when rank 0's result is
    (:meth:`result`)."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size
        self.committed: dict[int, int] = {}  # slot -> rounds committed
        self.dead: dict[int, int] = {}  # slot -> its dead round
        self.pending: dict[int, Pending] = {}
        self._early: dict[tuple[int, int], dict[int, bytes]] = {}

    def can_commit(self, slot: int) -> bool:
        """Whether this rank's next round of ``slot`` may be committed (not dead, none
        pending)."""
        return slot not in self.pending and \
            self.committed.get(slot, 0) < self.dead.get(slot, _NEVER)

    def commit(self, slot: int, op: Any, data: bytes) -> tuple[int, Pending | None]:
        """Commit the next round of ``slot`` with this rank's ``data``; returns the round and
        the pending op if already complete (every other rank's data had come)."""
        if not self.can_commit(slot):
            raise ProtocolError(f"eager slot {slot}: a round committed while it may not be")
        rnd = self.committed.get(slot, 0)
        self.committed[slot] = rnd + 1
        pending = Pending(slot, rnd, op, [None] * self._size)
        self.pending[slot] = pending
        for sender, part in self._early.pop((slot, rnd), {}).items():
            self._put(pending, sender, part)
        self._put(pending, self._rank, data)
        return rnd, self._take(pending)

    def arrive(self, sender: int, slot: int, rnd: int, data: bytes) -> Pending | None:
        """Data from ``sender`` for round ``rnd`` of ``slot``: the pending op it completes, if
        any.

        Raises:
            ProtocolError: data for a round this rank completed, or twice from one rank.
        """
        if rnd >= self.dead.get(slot, _NEVER):
            return None  # a dead round: discarded
        pending = self.pending.get(slot)
        if pending is not None and pending.round == rnd:
            self._put(pending, sender, data)
            return self._take(pending)
        if rnd < self.committed.get(slot, 0):
            raise ProtocolError(f"rank {sender} sent data for round {rnd} of eager slot {slot}, "
                                "which this rank completed")
        early = self._early.setdefault((slot, rnd), {})
        if sender in early:
            raise ProtocolError(f"rank {sender} sent round {rnd} of eager slot {slot} twice")
        early[sender] = data
        return None

    def result(self, slot: int, rnd: int, data: bytes) -> Pending | None:
        """Rank 0's result of round ``rnd`` of ``slot`` (the star exchange): the pending op it
        completes (None: a dead round, discarded).

        Raises:
            ProtocolError: a result for a round this rank has not committed or completed.
        """
        if rnd >= self.dead.get(slot, _NEVER):
            return None
        pending = self.pending.get(slot)
        if pending is None or pending.round != rnd:
            raise ProtocolError(f"rank 0 sent the result of round {rnd} of eager slot {slot}, "
                                "which this rank is not waiting for")
        del self.pending[slot]
        pending.parts = [data]
        pending.done = True
        return pending

    def kill(self, slot: int, dead: int) -> tuple[Pending | None, bool]:
        """Round ``dead`` of ``slot`` (and every later one) will never complete: returns the
        pending op to negotiate (one pending on such a round), and whether the slot is over
        here (no round left to commit or complete: drop it from the table)."""
        dead = min(dead, self.dead.get(slot, _NEVER))
        self.dead[slot] = dead
        for key in [k for k in self._early if k[0] == slot and k[1] >= dead]:
            del self._early[key]
        pending = self.pending.get(slot)
        converted = None
        if pending is not None and pending.round >= dead:
            converted = self.pending.pop(slot)
        return converted, self.over(slot)

    def over(self, slot: int) -> bool:
        """Whether ``slot`` is dead and this rank has nothing left of it."""
        return slot in self.dead and slot not in self.pending and \
            self.committed.get(slot, 0) >= self.dead[slot]

    def _put(self, pending: Pending, sender: int, data: bytes) -> None:
        if not 0 <= sender < self._size or pending.parts[sender] is not None:
            raise ProtocolError(f"rank {sender} sent round {pending.round} of eager slot "
                                f"{pending.slot} twice")
        pending.parts[sender] = data
        pending.have += 1

    def _take(self, pending: Pending) -> Pending | None:
        if pending.have < self._size:
            return None
        del self.pending[pending.slot]
        pending.done = True
        return pending


class EagerCounts:
    """Rank 0's view: every rank's rounds committed per eager slot (from the data it receives
    and its own commits), the slots' dead rounds, and how long a round has been uneven."""

    def __init__(self, size: int) -> None:
        self._size = size
        self.counts: dict[int, list[int]] = {}
        self.dead: dict[int, int] = {}
        self.by_name: dict[str, int] = {}  # every eager slot's name (dead ones kept)
        self._since: dict[int, float] = {}  # slot -> when its open round got its first commit
        self._open: dict[int, int] = {}  # slot -> its open round (the least count)
        self._asked: set[tuple[int, int]] = set()

    def add(self, slot: int, name: str) -> None:
        self.counts.setdefault(slot, [0] * self._size)
        self.by_name[name] = slot

    def commit(self, rank: int, slot: int, rnd: int, now: float | None = None) -> None:
        counts = self.counts.get(slot)
        if counts is None or not 0 <= rank < self._size:
            return
        counts[rank] = max(counts[rank], rnd + 1)
        low = min(counts)
        if low == max(counts):
            self._since.pop(slot, None)
            self._open.pop(slot, None)
        elif self._open.get(slot) != low:  # a new open round: its own clock
            self._open[slot] = low
            self._since[slot] = time.monotonic() if now is None else now

    def declare(self, slot: int, rank: int) -> int | None:
        """``rank`` will never commit its next round of ``slot``: the slot's new dead round
        (None: not lower than the one declared before)."""
        counts = self.counts.get(slot)
        if counts is None:
            return None
        return self.declared(slot, counts[rank])

    def declared(self, slot: int, rnd: int) -> int | None:
        if slot not in self.counts or rnd >= self.dead.get(slot, _NEVER):
            return None
        self.dead[slot] = rnd
        self._since.pop(slot, None)
        return rnd

    def declare_all(self, rank: int) -> list[tuple[int, int]]:
        """``rank`` joins or leaves: every slot's new dead rounds."""
        out = []
        for slot in sorted(self.counts):
            dead = self.declare(slot, rank)
            if dead is not None:
                out.append((slot, dead))
        return out

    def late(self, slot: int) -> tuple[int, list[int]] | None:
        """The open round of ``slot`` and the ranks that have not committed it (None: none
        open, or it is dead)."""
        counts = self.counts.get(slot)
        if counts is None:
            return None
        low = min(counts)
        if low == max(counts) or low >= self.dead.get(slot, _NEVER):
            return None
        return low, [r for r, c in enumerate(counts) if c == low]

    def ask(self, slot: int) -> tuple[int, list[int]] | None:
        """:meth:`late`, once per round (rank 0 asks the late ranks once)."""
        self._since.pop(slot, None)  # (set again by the next uneven round)
        late = self.late(slot)
        if late is None or (slot, late[0]) in self._asked:
            return None
        self._asked.add((slot, late[0]))
        return late

    def waiting(self, older_than: float, now: float | None = None) -> list[int]:
        """Slots whose open round has waited ``older_than`` seconds or more for some ranks."""
        now = time.monotonic() if now is None else now
        return sorted(s for s, t in self._since.items() if now - t >= older_than)

    def next_due(self, older_than: float) -> float | None:
        first = min(self._since.values(), default=None)
        return None if first is None else first + older_than


def check_pairs(body: dict[str, Any]) -> list[tuple[int, int]]:
    """The ``(slot, dead round)`` pairs of a ``cdec``'s ``dead``.

    Raises:
        ProtocolError: malformed.
    """
    dead = body.get("dead") or []
    if not isinstance(dead, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(v, int) for v in p)
            for p in dead):
        raise ProtocolError("malformed 'cdec' control message (dead rounds)")
    return [(p[0], p[1]) for p in dead]


__all__ = ["MAX_RANKS", "MSG_EAGER_ASK", "MSG_EAGER_DEAD", "EagerCounts", "EagerRounds",
           "Pending", "check_pairs", "is_data", "pack", "unpack"]
