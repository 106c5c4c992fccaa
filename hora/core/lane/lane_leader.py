"""The fast lane's leader: group rank 0 reads every member's log and publishes decisions.

Part of :mod:`hora.core.lane.fastlane` (whose docstring describes the protocol). Positions come in
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
from hora.core.data.routing import Route
from hora.core.lane.lane_cache import Slot, SlotCache
from hora.core.op.messages import OpKind
from hora.transports.shm_board import (
    CLOSED,
    DIFFERENT,
    DIVERGED,
    FAST,
    GROUPED,
    MAX_LENGTH,
    OFF,
    SLOT_MASK,
    UNLOGGED,
    UNWRITTEN,
    LaneBoards,
)

log = get_logger(__name__)

_ALLGATHER = OpKind.ALLGATHER  # (an enum member through its class: 100-200 ns in 3.11)

AGREED = 0
"""What :meth:`Leader._unit` finds when every member logged the same unit."""

SOLO_BYTES = 1024 * 1024
"""An allreduce of at least this many bytes runs as its own lane op, never fused with others,
but with the members of its own unit where the route reduces a fused op over the ops' own
arrays (:meth:`~hora.core.data.routing.Route.takes_parts`: no packing). Alone it is reduced
straight from its input into its output (the shared-memory ``chunked`` algorithm with ``src``);
packed it goes into the segment and out again, two more passes over its bytes, which cost more
than the signal rounds fusion saves from about 1 MiB on. Unpacked, a grouped call's large
members share one collective's signal rounds and pipeline (a Keras step's 7 MiB in six
gradients: one collective instead of three). Separate ops logged one after another are not
fused with a large one even then: a torch step whose hooks submit them during ``backward``
measured slower so (issue 29)."""


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
        self._waiting_at = -1  # the position the stall clock runs for
        self._room = 0  # decisions that may still be published (lower bound)
        self._off = False  # OFF published: nothing more to decide

    def pending(self) -> bool:
        """Whether some member logged the next undecided position."""
        return any(self._boards.written(self._decided))

    def decide(self) -> bool:
        """Publish every decision the logs allow now; True if any was made (members rung)."""
        if self._off:
            return False
        boards = self._boards
        look = boards.look
        slots = self._cache.slots
        made = 0
        while True:
            if self._room <= 0:  # (a lower bound, refreshed only when it runs out)
                self._room = boards.decision_room(self._published)
                if self._room <= 0:
                    break
            p = self._decided
            value = look(p, len(slots))  # (one op every member logged alike: no more calls)
            if value >= 0 and not value & GROUPED:
                status, at, unit = AGREED, p + 1, [slots[value & SLOT_MASK]]
            elif value in (UNWRITTEN, UNLOGGED):
                status, at, unit = UNWRITTEN, p, []
                if value == UNLOGGED:  # nobody waits for it: no stall clock
                    self._undecided_since = None
                    break
            else:
                status, at, unit = self._unit(p, slots)
            if status == DIFFERENT:  # negotiated up to where every member's unit ends
                aligned, end = self._aligned(at)
                if not aligned:
                    status, at = UNWRITTEN, end
            if status == UNWRITTEN:
                since = self._undecided_since
                if value == UNWRITTEN and (since is None or at != self._waiting_at):
                    self._undecided_since, self._waiting_at = time.monotonic(), at  # its clock
                elif (since is None or at != self._waiting_at
                      or 0 < self._stall_s <= time.monotonic() - since) and self._stalled(at):
                    status = CLOSED  # (a call only where the clock may have run out)
                if status == UNWRITTEN:
                    break
            if status == CLOSED:
                self._publish(OFF, 0)
                made += 1
                break
            self._undecided_since = None
            made += 1
            if status == DIFFERENT:
                self._publish(DIVERGED, end - p)
                self._decided = end
            elif unit[0].kind is _ALLGATHER:
                fits = all(self._cache.allgather_fits(slot, boards.rows(p + i))
                           for i, slot in enumerate(unit))
                self._publish(FAST if fits else DIVERGED, len(unit))
                self._decided = at
            else:
                q, total = (1, unit[0].nbytes) if len(unit) == 1 else self._fused(unit)
                waiting = False
                if q == len(unit) and total < SOLO_BYTES:  # the whole unit: more may join it
                    following = look(at, len(slots))  # (nothing there yet: no _grow call)
                    end, waiting = ((at, True) if following in (UNWRITTEN, UNLOGGED)
                                    else self._grow(p, at, unit[0], total, slots))
                    q = end - p
                boards.publish(self._published, FAST, q)  # (_publish's FAST, inline; a unit
                self._published += 1  # larger than one op: its first part)
                self._room -= 1
                self._decided = p + q
                if waiting:  # the next position is not logged everywhere yet: stop here
                    break
        if made:
            for peer in range(1, boards.size):
                boards.ring(peer)
        return made > 0

    def _grow(self, p: int, q: int, first: Slot, total: int,
              slots: list[Slot]) -> tuple[int, bool]:
        """``(end, waiting)``: the end of a fused allreduce that starts with the units at
        ``p .. q - 1`` (``total`` bytes, fusion key of ``first``), which the following units
        every member logged alike join while they fuse (one key, within the fusion limit and
        the route, none of :data:`SOLO_BYTES`); ``waiting``: it ended at a position some member
        has not logged yet."""
        look = self._boards.look
        while q - p < MAX_LENGTH:
            value = look(q, len(slots))
            if value >= 0 and not value & GROUPED:
                end, more = q + 1, [slots[value & SLOT_MASK]]
            elif value in (UNWRITTEN, UNLOGGED):
                return q, True
            else:
                status, end, more = self._unit(q, slots)
                if status != AGREED:
                    return q, status == UNWRITTEN
            grown = total + sum(slot.nbytes for slot in more)
            if not all(first.fuses_with(slot) for slot in more) \
                    or grown > self._cache.limit or not self._route.fits(grown) \
                    or any(s.nbytes >= SOLO_BYTES for s in more):
                break
            total, q = grown, end
        return q, False

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
                return (UNWRITTEN if value == UNLOGGED else value), x, []
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
                    or (max(first.nbytes, slot.nbytes) >= SOLO_BYTES
                        and self._packs(first, grown)):
                break
            total, n = grown, n + 1
        return n, total

    def _packs(self, first: Slot, nbytes: int) -> bool:
        """Whether a fused allreduce of ``nbytes`` with ``first``'s fusion key is packed into
        one buffer (:data:`SOLO_BYTES`), rather than reduced over the ops' own arrays (the
        executor's rule: no prescale, an op and size the route takes as parts)."""
        fusion = first.fusion
        return fusion is None or fusion.prescale != 1.0 \
            or not self._route.takes_parts(nbytes, fusion.op)

    def _publish(self, kind: int, length: int) -> None:
        self._boards.publish(self._published, kind, length)
        self._published += 1
        self._room -= 1
        if kind == OFF:
            self._off = True

    def _stalled(self, p: int) -> bool:
        """Position ``p`` waits for some member; True once that took the stall time (its clock
        runs while some member has logged ``p``)."""
        written = self._boards.written(p)
        if not any(written):
            self._undecided_since = None
            return False
        now = time.monotonic()
        if self._undecided_since is None or p != self._waiting_at:
            self._undecided_since, self._waiting_at = now, p
            return False
        if self._stall_s <= 0 or now - self._undecided_since < self._stall_s:
            return False
        missing = [r for r, w in enumerate(written) if not w]
        log.warning("fast lane of process set %d: ranks %s have not submitted their lane op "
                    "number %d for %.0f s; handing pending ops to the coordinator (its stall "
                    "inspector names the tensors)", self._set_id, missing, p,
                    now - self._undecided_since)
        return True
