"""The fast lane's leader: group rank 0 reads every member's log and publishes decisions.

Half of :mod:`hora.core.fastlane` (whose docstring describes the protocol): for each position
``p``, in order, what every member logged there (:meth:`~hora.transports.shm_board.LaneBoards.
look`) decides one of

* ``FAST k``: positions ``p .. p+k-1`` hold the same slot on every member and fuse (one fusion
  key, at most the fusion threshold and the route's capacity in bytes): one fused allreduce;
* ``DIVERGED``: the members disagree at ``p``: each hands its op there to the negotiated path;
* ``OFF``: a member closed its log at ``p``, or ``p`` waited ``HOROVOD_STALL_CHECK_TIME_SECONDS``
  for a member: everything from ``p`` on is negotiated.

A :class:`Slot` is one cached response, numbered alike on every member.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hora._util.log import get_logger
from hora.core.agreement import FusionKey, Signature
from hora.core.routing import Route
from hora.transports.shm_board import (
    CLOSED,
    DIFFERENT,
    DIVERGED,
    FAST,
    MAX_LENGTH,
    OFF,
    UNWRITTEN,
    LaneBoards,
)

log = get_logger(__name__)


@dataclass(frozen=True)
class Slot:
    """One cached allreduce response: a request with the same name and
    :func:`~hora.core.agreement.signature` is a hit."""

    index: int
    name: str
    signature: Signature
    shape: tuple[int, ...]
    nbytes: int
    fusion: FusionKey

    def fuses_with(self, other: Slot) -> bool:
        return self.fusion == other.fusion


class Leader:
    """Rank 0's decisions for the lane of process set ``set_id`` (driven by whichever thread
    drives the lane: one at a time).

    Args:
        boards: the lane group's boards.
        route: the lane's route (how many bytes one fused op may hold).
        limit: fusion threshold in bytes.
        stall_s: seconds a position may wait for a member before it is decided OFF (0: never).
    """

    def __init__(self, set_id: int, boards: LaneBoards, route: Route, *, limit: int,
                 stall_s: float) -> None:
        self._set_id = set_id
        self._boards = boards
        self._route = route
        self._limit = limit
        self._stall_s = stall_s
        self._decided = 0  # next undecided position
        self._published = 0  # decisions published
        self._undecided_since: float | None = None
        self._off = False  # OFF published: nothing more to decide

    def pending(self) -> bool:
        """Whether some member logged the next undecided position."""
        return any(self._boards.written(self._decided))

    def decide(self, slots: list[Slot]) -> bool:
        """Publish every decision the logs allow now; True if any was made (members rung)."""
        if self._off:
            return False
        boards = self._boards
        room = boards.decision_room(self._published)
        known = len(slots)
        made = 0
        while made < room:
            p = self._decided
            first = boards.look(p, known)
            if first == CLOSED or (first == UNWRITTEN and self._stalled(p)):
                self._publish(OFF, 0)
                made += 1
                break
            if first == UNWRITTEN:
                break
            self._undecided_since = None
            if first == DIFFERENT:
                self._publish(DIVERGED, 1)
                self._decided = p + 1
                made += 1
                continue
            slot = slots[first]
            total, q = slot.nbytes, p + 1
            while q - p < MAX_LENGTH:
                nxt = boards.look(q, known)
                if nxt < 0:
                    if nxt == UNWRITTEN:
                        room = made + 1  # the outer loop would find the same: stop after this
                    break
                other = slots[nxt]
                grown = total + other.nbytes
                if grown > self._limit or not slot.fuses_with(other) \
                        or not self._route.fits(grown):
                    break
                total = grown
                q += 1
            self._publish(FAST, q - p)
            self._decided = q
            made += 1
        if made:
            for peer in range(1, boards.size):
                boards.ring(peer)
        return made > 0

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
        log.warning("fast lane of process set %d: ranks %s have not submitted their allreduce "
                    "number %d for %.0f s; handing pending ops to the coordinator (its stall "
                    "inspector names the tensors)", self._set_id, missing, p,
                    now - self._undecided_since)
        return True
