"""The fast lane's words on shared-memory boards: logs, decisions and doorbells.

Transport layer: every raw board word the fast lane (:mod:`hora.core.lane.fastlane`) reads or writes
is read or written here; the lane itself deals in positions, slot numbers and decisions. A
board is the free part of a rank's fabric header (:meth:`~hora.transports.shm_fabric.ShmFabric.
board`): uint32 words, zero when the group is created, readable and writable by every member.

Layout of each member's board (``LOG_CAPACITY`` log entries, ``DECISION_CAPACITY`` decisions):

* ``COUNT``: entries this member appended to its log (a 32-bit counter, like every counter
  here: compared with :func:`~hora.transports.shm.reached`); entry ``p`` sits at
  ``LOG + p % LOG_CAPACITY`` and holds a slot number or :data:`MISS`, with the :data:`GROUPED`
  bit when the next entry belongs to the same *unit* (the members of one grouped call, appended
  together and decided together); allgather entries keep their first dimension at
  ``ARG + p % ARG_CAPACITY``;
* ``OFF_AT``: ``p + 1`` once this member closed its log at position ``p`` (0: open);
* ``CONSUMED`` / ``DECISIONS_READ``: positions and decisions this member has applied (the
  leader's flow control);
* ``DECISIONS`` and the decision ring at ``DEC``: the leader's published decisions, one word
  each: ``kind << 28 | length``;
* ``DOORBELL`` / ``DRIVING`` / ``ASLEEP``: the bell of a thread waiting for one of its lane ops
  (the *driver*); ``ASLEEP`` tells a ringer whether the wake system call is needed;
* ``LANE_BELL``: the bell of the member's lane thread.
"""

from __future__ import annotations

from typing import Protocol

from hora.transports.shm import HALF, MASK, futex_wake, reached, ring, wait_word
from hora.transports.shm_fabric import BOARD_WORDS

LOG_CAPACITY = 2048
"""Log entries per member: appends this far ahead of the slowest member close the log."""

DECISION_CAPACITY = 1024
"""Published decisions not yet read by every member, at most."""

(COUNT, OFF_AT, CONSUMED, DOORBELL, DECISIONS, DECISIONS_READ, LANE_BELL, DRIVING,
 ASLEEP) = range(9)
ARG_CAPACITY = 512
"""Positions whose argument word (an allgather's first dimension) is kept: an allgather is a hit
only while the slowest member is less than this many positions behind."""

LOG = 16
DEC = LOG + LOG_CAPACITY
ARG = DEC + DECISION_CAPACITY
assert ARG + ARG_CAPACITY <= BOARD_WORDS

MISS = 0xFFFFFFFF
"""Log entry of an op that is not a hit (it takes the negotiated path)."""

GROUPED = 0x80000000
"""Log entry bit: the next position belongs to the same unit (never set on :data:`MISS`)."""

SLOT_MASK = GROUPED - 1
"""A log entry's slot number (slots are numbered below this)."""

UNWRITTEN, CLOSED, DIFFERENT, UNLOGGED = -2, -3, -4, -5
"""What :meth:`LaneBoards.look` finds at a position instead of one common slot
(:data:`UNLOGGED`: no member has logged it; :data:`UNWRITTEN`: some have, not all)."""

FAST, DIVERGED, OFF = 0, 1, 2
"""Decision kinds (see :mod:`hora.core.lane.fastlane`)."""

_SHIFT = 28
MAX_LENGTH = (1 << _SHIFT) - 1
"""Longest run of positions one decision covers."""


class Boards(Protocol):
    """What the lane needs of a same-host fabric (:class:`~hora.transports.shm_fabric.ShmFabric`
    and the ``Fabric`` protocol of :mod:`hora.collectives.comm` provide it)."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def spin_checks(self) -> int: ...

    def board(self, peer: int) -> memoryview: ...

    def board_address(self, peer: int, word: int) -> int: ...


class LaneBoards:
    """Every member's board of one lane group, as this rank reads and writes them.

    Writes to this rank's own board come from one thread at a time (the caller's locks);
    reads of peers' boards may race with their writes, which only ever advance counters.
    """

    def __init__(self, fabric: Boards) -> None:
        self.rank, self.size = fabric.rank, fabric.size
        self.spin_checks = fabric.spin_checks
        self._boards = [fabric.board(r) for r in range(self.size)]
        self._own = self._boards[self.rank]
        self._leader = self._boards[0]
        self._bells = [fabric.board_address(r, DOORBELL) for r in range(self.size)]
        self._lane_bells = [fabric.board_address(r, LANE_BELL) for r in range(self.size)]

    # ---- this member's log --------------------------------------------------------------------
    def prefill(self, start: int) -> None:
        """Log ``start`` misses (ops submitted before the lane existed)."""
        own = self._own
        for position in range(max(0, start - LOG_CAPACITY), start):
            own[LOG + position % LOG_CAPACITY] = MISS
        own[COUNT] = start & MASK

    def append(self, position: int, values: list[int], rows: list[int] | None,
               driving: bool) -> None:
        """Write log entries ``position, position + 1, ...`` (``values``: slots, with
        :data:`GROUPED` on all but a unit's last, or :data:`MISS`) and their argument words
        (``rows``, or None), then publish the new count once, so that a peer sees the whole
        unit or none of it; ``driving``: the caller will wait for it at once (rings go to the
        caller)."""
        own = self._own
        for i, value in enumerate(values):
            own[LOG + (position + i) % LOG_CAPACITY] = value
        if rows is not None:
            for i, count in enumerate(rows):
                own[ARG + (position + i) % ARG_CAPACITY] = count
        if driving:
            own[DRIVING] = 1
        own[COUNT] = (position + len(values)) & MASK

    def backlog(self, count: int) -> int:
        """How far the slowest member's consumed position is behind ``count``."""
        return max((count - b[CONSUMED]) & MASK for b in self._boards)

    def close_at(self, count: int) -> None:
        """Close this member's log at position ``count`` (it appends no more)."""
        self._own[OFF_AT] = (count + 1) & MASK

    def consumed(self, decisions_read: int, position: int) -> None:
        """Publish how many decisions and positions this member has applied."""
        own = self._own
        own[DECISIONS_READ] = decisions_read & MASK
        own[CONSUMED] = position & MASK

    # ---- decisions ----------------------------------------------------------------------------
    def decisions_waiting(self, read: int) -> bool:
        """Whether the leader published decisions past the ``read`` this member applied."""
        return ((self._leader[DECISIONS] - read) & MASK) != 0

    def decision(self, index: int) -> tuple[int, int]:
        """The leader's decision ``index``: (kind, length)."""
        word = self._leader[DEC + index % DECISION_CAPACITY]
        return word >> _SHIFT, word & MAX_LENGTH

    def decisions(self, read: int) -> list[tuple[int, int]]:
        """Every decision the leader published past the ``read`` this member applied, in
        order, as (kind, length)."""
        leader = self._leader
        out = []
        while ((leader[DECISIONS] - read) & MASK) != 0:
            word = leader[DEC + read % DECISION_CAPACITY]
            out.append((word >> _SHIFT, word & MAX_LENGTH))
            read += 1
        return out

    # ---- leader -------------------------------------------------------------------------------
    def look(self, p: int, slots: int) -> int:
        """What every log says at position ``p``: the entry every member logged there (a slot
        below ``slots``, with its :data:`GROUPED` bit); :data:`UNWRITTEN` if some member has not
        reached ``p`` (:data:`UNLOGGED` if none has); :data:`CLOSED` if some member closed its
        log at or before ``p``; :data:`DIFFERENT` if they disagree or logged a miss."""
        index = LOG + p % LOG_CAPACITY
        common = -1
        result = 0
        for b in self._boards:  # (reached() written out: the leader runs this every step)
            off = b[OFF_AT]
            if off and ((p - (off - 1)) & MASK) < HALF:
                return CLOSED
            if ((b[COUNT] - (p + 1)) & MASK) >= HALF:
                result = UNWRITTEN
                continue
            value = b[index]
            if common == -1:
                common = value
            elif value != common:
                result = result or DIFFERENT
        if result:
            return UNLOGGED if common == -1 else result
        return DIFFERENT if common == MISS or common & SLOT_MASK >= slots else common

    def ends(self, p: int) -> list[int]:
        """Per member, what its log holds at position ``p``: 1 if a unit's entry that another
        follows (:data:`GROUPED`), 0 if the last entry of a unit (a single op, a miss) or if
        the log was closed at or before ``p``, :data:`UNWRITTEN` if not written yet."""
        index = LOG + p % LOG_CAPACITY
        out = []
        for b in self._boards:
            off = b[OFF_AT]
            if off and reached(p, off - 1):
                out.append(0)
            elif not reached(b[COUNT], p + 1):
                out.append(UNWRITTEN)
            else:
                value = b[index]
                out.append(1 if value & GROUPED and value != MISS else 0)
        return out

    def rows(self, p: int) -> list[int]:
        """Every member's argument word at position ``p`` (an allgather's first dimension), in
        group rank order; valid while no member has consumed ``p``."""
        index = ARG + p % ARG_CAPACITY
        return [int(b[index]) for b in self._boards]

    def written(self, p: int) -> list[bool]:
        """Per member: whether its log holds position ``p``."""
        return [reached(b[COUNT], p + 1) for b in self._boards]

    def decision_room(self, published: int) -> int:
        """Decisions the leader may publish before one overwrites an unread one (a lower bound
        until ``published`` grows: members only read more)."""
        behind = 0
        for b in self._boards:
            behind = max(behind, (published - b[DECISIONS_READ]) & MASK)
        return DECISION_CAPACITY - behind

    def publish(self, index: int, kind: int, length: int) -> None:
        """Leader: publish decision ``index``."""
        own = self._own
        own[DEC + index % DECISION_CAPACITY] = (kind << _SHIFT) | length
        own[DECISIONS] = (index + 1) & MASK

    # ---- bells --------------------------------------------------------------------------------
    def doorbell(self) -> int:
        return int(self._own[DOORBELL])

    def lane_bell(self) -> int:
        return int(self._own[LANE_BELL])

    def set_driving(self, driving: bool) -> None:
        """Whether a caller drives this member's lane (rings wake it, not the lane thread)."""
        self._own[DRIVING] = 1 if driving else 0

    def start_driving(self) -> int:
        """A caller drives this member's lane from now (rings wake it, not the lane thread);
        the doorbell's count now."""
        own = self._own
        own[DRIVING] = 1
        return int(own[DOORBELL])

    def stop_driving(self, seen: int) -> bool:
        """The caller drives no more; True if the doorbell rang after ``seen``."""
        own = self._own
        own[DRIVING] = 0
        return int(own[DOORBELL]) != seen

    def wait_doorbell(self, seen: int, spins: int, seconds: float) -> int:
        """Driver: wait (``spins`` checks, then a futex sleep of at most ``seconds``) for a ring
        after ``seen``; the doorbell's count then (``seen`` if none came)."""
        own = self._own
        for _ in range(spins):  # (wait_word's spin, written out: no call while it spins)
            value = own[DOORBELL]
            if value != seen:
                return int(value)
        wait_word(own, DOORBELL, self._bells[self.rank], (seen + 1) & MASK, 0, seconds, ASLEEP)
        return int(own[DOORBELL])

    def wait_lane_bell(self, seen: int, seconds: float) -> bool:
        """Lane thread: sleep until a ring after ``seen``; True if one came."""
        return wait_word(self._own, LANE_BELL, self._lane_bells[self.rank], (seen + 1) & MASK,
                         0, seconds)

    def ring(self, peer: int) -> None:
        """Wake ``peer``'s driver: the thread waiting for a lane op, else its lane thread if it
        has ops of its own in the lane (else there is nothing it could do yet)."""
        board = self._boards[peer]
        if board[DRIVING]:
            board[DOORBELL] = (board[DOORBELL] + 1) & MASK
            if board[ASLEEP]:  # (a wake lost to store/load reordering costs one slice)
                futex_wake(self._bells[peer])
        elif board[COUNT] != board[CONSUMED]:
            ring(board, LANE_BELL, self._lane_bells[peer])

    def ring_lane(self) -> None:
        """Wake this member's lane thread."""
        ring(self._own, LANE_BELL, self._lane_bells[self.rank])

    def wake_driver(self) -> None:
        """Wake this member's driver, whatever it waits for (failure, shutdown)."""
        futex_wake(self._bells[self.rank])

    def release(self) -> None:
        """Drop the views (before the fabric unmaps the boards)."""
        for view in self._boards:
            view.release()
