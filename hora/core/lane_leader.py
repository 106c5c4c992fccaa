"""The fast lane's leader: group rank 0 reads every member's log and publishes decisions.

Part of :mod:`hora.core.fastlane` (whose docstring describes the protocol). Positions come in
*units*: an op, or the members of one grouped call (a grouped allreduce, a sparse allreduce's two
allgathers), which every member appended at once, each entry but the last marked
:data:`~hora.transports.shm_board.GROUPED`. For the unit at the next undecided position ``p``,
in order, what every member logged there (:meth:`~hora.transports.shm_board.LaneBoards.look`)
decides one of

* ``FAST k``: the unit holds the same slots on every member: run it, as one fused allreduce
  together with the following allreduce units while they fuse (one fusion key, at most the
  fusion threshold and the route's capacity in bytes), or as one allgather per position (each
  result must fit in shared memory: first dimensions are read from the boards); an allreduce
  unit larger than one fused op is split, in order;
* ``DIVERGED k``: the members disagree at ``p`` or inside the unit (different ops, units of
  different lengths, a miss), or an allgather's result does not fit: each hands its ops at
  ``p .. p+k-1`` to the negotiated path, up to the first position where every member's unit
  has ended, so a unit goes whole to one path or the other (the coordinator then fails or runs
  each group's members together);
* ``OFF``: a member closed its log at ``p``, or a position waited
  ``HOROVOD_STALL_CHECK_TIME_SECONDS`` for a member: everything from ``p`` on is negotiated.

A unit is never split by a wait (all of it is visible at once), nor merged with ops it was not
logged with on every member, so a group stays together and in the same order on every rank.
"""

from __future__ import annotations

import time

from hora._util.log import get_logger
from hora.core.lane_cache import Slot, SlotCache
from hora.core.messages import OpKind
from hora.core.routing import Route
from hora.transports.shm_board import (
    CLOSED,
    DIFFERENT,
    DIVERGED,
    FAST,
    GROUPED,
    MAX_LENGTH,
    OFF,
    SLOT_MASK,
    UNWRITTEN,
    LaneBoards,
)

log = get_logger(__name__)

AGREED = 0
"""What :meth:`Leader._unit` finds when every member logged the same unit."""

SOLO_BYTES = 1024 * 1024
"""An allreduce of at least this many bytes runs as its own lane op, never fused with others.
Alone it is reduced straight from its input into its output (the shared-memory ``chunked``
algorithm with ``src``); fused it is packed into the segment and unpacked again, two more
passes over its bytes, which cost more than the signal rounds fusion saves from about 1 MiB on.
"""


class Leader:
    """Rank 0's decisions for the lane of process set ``set_id`` (driven by whichever thread
    drives the lane: one at a time).

    Args:
        boards: the lane group's boards.
        cache: the lane's slots (and its fusion limit in bytes).
        route: the lane's route (how many bytes one fused op may hold).
        stall_s: seconds a position may wait for a member before it is decided OFF (0: never).
    """

    def __init__(self, set_id: int, boards: LaneBoards, cache: SlotCache, route: Route, *,
                 stall_s: float) -> None:
        self._set_id = set_id
        self._boards = boards
        self._cache = cache
        self._route = route
        self._stall_s = stall_s
        self._decided = 0  # next undecided position
        self._published = 0  # decisions published
        self._undecided_since: float | None = None
        self._off = False  # OFF published: nothing more to decide

    def pending(self) -> bool:
        """Whether some member logged the next undecided position."""
        return any(self._boards.written(self._decided))

    def decide(self) -> bool:
        """Publish every decision the logs allow now; True if any was made (members rung)."""
        if self._off:
            return False
        boards = self._boards
        room = boards.decision_room(self._published)
        slots = self._cache.slots
        made = 0
        while made < room:
            p = self._decided
            status, at, unit = self._unit(p, slots)
            if status == DIFFERENT:  # negotiated up to where every member's unit ends
                aligned, end = self._aligned(at)
                if not aligned:
                    status, at = UNWRITTEN, end
            if status == CLOSED or (status == UNWRITTEN and self._stalled(at)):
                self._publish(OFF, 0)
                made += 1
                break
            if status == UNWRITTEN:
                break
            self._undecided_since = None
            made += 1
            if status == DIFFERENT:
                self._publish(DIVERGED, end - p)
                self._decided = end
            elif unit[0].kind is OpKind.ALLGATHER:
                fits = all(self._cache.allgather_fits(slot, boards.rows(p + i))
                           for i, slot in enumerate(unit))
                self._publish(FAST if fits else DIVERGED, len(unit))
                self._decided = at
            else:
                q, total = self._fused(unit)
                if q == len(unit):  # the whole unit: more units may join it
                    q += p
                    while q - p < MAX_LENGTH:
                        status, end, more = self._unit(q, slots)
                        if status != AGREED:
                            if status == UNWRITTEN:
                                room = made  # the next pass would find the same: stop here
                            break
                        grown = total + sum(slot.nbytes for slot in more)
                        if not all(unit[0].fuses_with(slot) for slot in more) \
                                or grown > self._cache.limit or not self._route.fits(grown) \
                                or any(s.nbytes >= SOLO_BYTES for s in (*unit, *more)):
                            break
                        total, q = grown, end
                    q -= p
                self._publish(FAST, q)  # (a unit larger than one op: its first part)
                self._decided = p + q
        if made:
            for peer in range(1, boards.size):
                boards.ring(peer)
        return made > 0

    def _unit(self, p: int, slots: list[Slot]) -> tuple[int, int, list[Slot]]:
        """The unit logged at ``p``: ``(AGREED, end, its slots)`` when every member logged it
        alike (positions ``p .. end - 1``), else ``(UNWRITTEN | CLOSED | DIFFERENT, position,
        [])`` for the first position where they do not."""
        look = self._boards.look
        known = len(slots)
        unit = []
        x = p
        while True:
            value = look(x, known)
            if value < 0:
                return value, x, []
            unit.append(slots[value & SLOT_MASK])
            x += 1
            if not value & GROUPED:
                return AGREED, x, unit

    def _aligned(self, x: int) -> tuple[bool, int]:
        """The members disagree at ``x``: ``(True, e)`` with ``e`` the first position after it
        where every member's unit has ended (so that no unit is split between the lane and the
        negotiated path), or ``(False, q)`` while some member has not logged position ``q``
        that this needs."""
        ends = self._boards.ends
        while True:
            state = ends(x)
            if UNWRITTEN in state:
                return False, x
            x += 1
            if not any(state):
                return True, x

    def _fused(self, unit: list[Slot]) -> tuple[int, int]:
        """How many of ``unit``'s first slots fuse into one allreduce, and their bytes."""
        first = unit[0]
        total, n = first.nbytes, 1
        for slot in unit[1:]:
            grown = total + slot.nbytes
            if grown > self._cache.limit or not first.fuses_with(slot) \
                    or not self._route.fits(grown) \
                    or max(first.nbytes, slot.nbytes) >= SOLO_BYTES:
                break
            total, n = grown, n + 1
        return n, total

    def _publish(self, kind: int, length: int) -> None:
        self._boards.publish(self._published, kind, length)
        self._published += 1
        if kind == OFF:
            self._off = True

    def _stalled(self, p: int) -> bool:
        """Position ``p`` waits for some member; True once that took the stall time."""
        written = self._boards.written(p)
        if not any(written):
            self._undecided_since = None
            return False
        now = time.monotonic()
        if self._undecided_since is None:
            self._undecided_since = now
            return False
        if self._stall_s <= 0 or now - self._undecided_since < self._stall_s:
            return False
        missing = [r for r, w in enumerate(written) if not w]
        log.warning("fast lane of process set %d: ranks %s have not submitted their lane op "
                    "number %d for %.0f s; handing pending ops to the coordinator (its stall "
                    "inspector names the tensors)", self._set_id, missing, p,
                    now - self._undecided_since)
        return True
