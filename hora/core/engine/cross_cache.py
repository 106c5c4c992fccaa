"""The response cache across hosts: its protocol (slots, ready bits, rank 0's decision).

On one host the fast lane (:mod:`hora.core.lane`) lets a negotiated name skip rank 0. Across
hosts every op still goes to rank 0 as one request per rank, which rank 0 parses, pairs and
answers: O(ranks) work per cycle. This module is the cross-host version of Horovod's response
cache, built so that rank 0's work per cycle is O(hosts):

* **Slots** (:class:`SlotTable`, every rank alike): when a negotiated single-tensor
  allreduce runs, every member gives its name the next slot and remembers the response and
  its signature (:mod:`hora.core.op.agreement`). Responses reach every rank in one total order
  (one coordinator), so every rank numbers slots alike without talking.
* **Ready bits** (per rank, then per host): a later request is a *hit* when its signature
  equals the slot's; the rank then only marks the slot ready. A host's ranks AND their bits
  (within a host through shared memory, as the fast lane's board does); the host leader sends
  rank 0 the slots that *became* ready on every rank of its host since its last message
  (:data:`MSG_CACHE_BITS`, a delta: each round of a slot is sent once per host, so a message
  still in flight when rank 0 decides can never start a phantom round).
* **Decision** (:class:`CacheCoordinator`, rank 0): a slot is ready when every host reported it;
  rank 0 sends each host leader one :data:`MSG_CACHE_DECIDE` listing the ready slots in slot
  order, every rank rebuilds the responses from its table and runs them, the same list in the
  same order everywhere. Rank 0 parses one message per host per cycle, never one per rank.
* **Misses, mismatches, stalls.** A request that differs from its slot's signature is a miss
  and is negotiated as before; when rank 0 receives a negotiated request for a name that holds
  a slot, it *invalidates* the slot (every rank drops it, and ranks that marked it ready hand
  the op to the negotiated path), so the coordinator sees every rank's request and reports the
  mismatch with its usual text on every rank. A slot ready on some hosts but not all for the
  stall-warning time, or involved in a suspected deadlock, is invalidated the same way, so the
  stall inspector and the deadlock detector see per-rank requests and name the missing ranks.
  Failure detection is the control plane's (every rank keeps its connection to rank 0).

``benchmarks/control_plane_sim.py`` runs this protocol for 64-1024 virtual ranks against a real
rank 0; :mod:`hora.core.engine.cross_link` is the engine's side of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from hora.core.op.agreement import Signature, agrees, response_signature
from hora.core.op.messages import OpKind, Request, Response
from hora.errors import ProtocolError

MSG_CACHE_BITS = "cbits"
"""Host leader -> rank 0: ``{"bits": hex}``: slots that became ready on every rank of the host."""
MSG_CACHE_DECIDE = "cdec"
"""Rank 0 -> host leaders: ``{"slots": [...], "inval": [...]}``: run these slots now, in this
order; drop these slots (their ops are negotiated)."""

MAX_SLOTS = 1 << 16
"""Most slots a job's table holds (the bit vectors stay under 8 KiB of hex)."""


def encode_bits(mask: int) -> str:
    """A set of slots as hex (bit ``s`` = slot ``s``)."""
    return format(mask, "x")


def decode_bits(text: object) -> int:
    """The slots of a :data:`MSG_CACHE_BITS` message, checked.

    Raises:
        ProtocolError: not a hex string of at most ``MAX_SLOTS`` bits.
    """
    if not isinstance(text, str) or not text or len(text) > MAX_SLOTS // 4:
        raise ProtocolError("malformed 'cbits' control message: bits must be a short hex string")
    try:
        return int(text, 16)
    except ValueError:
        raise ProtocolError("malformed 'cbits' control message: bits are not hex") from None


def slots_of(mask: int) -> list[int]:
    """The slot numbers set in ``mask``, ascending."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


@dataclass
class _Slot:
    name: str
    set_id: int
    sig: Signature
    response: Response


class SlotTable:
    """name -> slot for one job, the same on every rank (see the module's docstring)."""

    def __init__(self, capacity: int = MAX_SLOTS) -> None:
        self._capacity = min(capacity, MAX_SLOTS)
        self._slots: dict[int, _Slot] = {}
        self._by_name: dict[tuple[int, str], int] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._slots)

    def learn(self, resp: Response) -> int | None:
        """Give each name of a negotiated allreduce (fused or not; explicit names only) a slot;
        returns the first name's, or None when the response is not cacheable or the table is
        full."""
        if resp.kind is not OpKind.ALLREDUCE or resp.error or resp.joined:
            return None
        first: int | None = None
        for i, name in enumerate(resp.names):
            slot = self._learn_one(resp, i, name)
            if i == 0:
                first = slot
        return first

    def _learn_one(self, resp: Response, i: int, name: str) -> int | None:
        if ".noname." in name:
            return None
        key = (resp.set_id, name)
        if key in self._by_name:
            return self._by_name[key]
        # Slot numbers are never reused: a mark still in flight for an invalidated slot must
        # not count for another name (rank 0 drops marks for slots it no longer holds).
        if len(self._slots) >= self._capacity or self._next >= MAX_SLOTS:
            return None
        slot, self._next = self._next, self._next + 1
        one = replace(resp, names=[name], shapes=[list(resp.shapes[i])], first_dims=[],
                      splits=[])
        self._slots[slot] = _Slot(name, resp.set_id, response_signature(one), one)
        self._by_name[key] = slot
        return slot

    def hit(self, req: Request) -> int | None:
        """The slot of ``req`` when its name holds one and its signature agrees, else None."""
        slot = self._by_name.get((req.set_id, req.name))
        if slot is None or not agrees(self._slots[slot].sig, req):
            return None
        return slot

    def slot_of(self, set_id: int, name: str) -> int | None:
        return self._by_name.get((set_id, name))

    def slots(self) -> list[int]:
        """Every slot in the table, ascending."""
        return sorted(self._slots)

    def holds(self, slot: int) -> bool:
        """Whether ``slot`` is in the table (not invalidated, not unknown)."""
        return slot in self._slots

    def response(self, slot: int) -> Response:
        """The response every rank runs for ``slot`` (a fresh copy)."""
        resp = self._slots[slot].response
        return replace(resp, names=list(resp.names), shapes=[list(s) for s in resp.shapes])

    def fused(self, group: list[int]) -> Response:
        """The response of one fusion group of rank 0's decision, as :func:`fuse` built it.

        Raises:
            ProtocolError: a slot this table does not hold (the ranks' caches diverged).
        """
        try:
            resp = self.response(group[0])
            for slot in group[1:]:
                other = self.response(slot)
                resp.names.extend(other.names)
                resp.shapes.extend(other.shapes)
        except KeyError:
            raise ProtocolError(f"rank 0 decided slots {group} that this rank does not "
                                "hold: the ranks' response caches diverged") from None
        return resp

    def invalidate(self, slot: int) -> str | None:
        """Drop ``slot`` (its name is negotiated from now on until it is learned again);
        returns its name."""
        entry = self._slots.pop(slot, None)
        if entry is None:
            return None
        self._by_name.pop((entry.set_id, entry.name), None)
        return entry.name


class HostRounds:
    """A host leader's view in the engine: a *round counter* per local rank and slot (a rank
    marks slot ``s`` once per round: ``count += 1``), and per slot how many rounds rank 0 has
    been told of. A round is complete on the host when every local rank's counter passed it;
    :meth:`delta` reports each complete round once. Nothing is cleared when a round is decided,
    so a rank that marks round *k+1* before another rank's round-*k* mark arrived is counted
    for *k+1*, never lost and never taken for round *k* (bits, cleared at decision time, need
    the leader to clear before any rank may mark again). Work per call: O(slots marked since
    the last :meth:`delta` x local ranks)."""

    def __init__(self, members: list[int]) -> None:
        self._index = {rank: i for i, rank in enumerate(members)}
        self._counts: dict[int, list[int]] = {}  # slot -> rounds marked, per local rank
        self._told: dict[int, int] = {}  # slot -> rounds reported to rank 0
        self._touched: set[int] = set()
        self._since: dict[int, float] = {}  # slot -> when its open round got its first mark

    def mark(self, rank: int, bits: int, now: float | None = None) -> None:
        """Local rank ``rank`` marked the slots of ``bits`` (one more round each).

        Raises:
            ProtocolError: ``rank`` is not a rank of this host.
        """
        i = self._index.get(rank)
        if i is None:
            raise ProtocolError(f"rank {rank} marked cached slots at a leader of another host")
        stamp = time.monotonic() if now is None else now
        for slot in slots_of(bits):
            self._since.setdefault(slot, stamp)
            counts = self._counts.get(slot)
            if counts is None:
                counts = self._counts[slot] = [0] * len(self._index)
            counts[i] += 1
            self._touched.add(slot)

    def delta(self) -> int:
        """Slots with a round complete on every local rank that rank 0 was not told of (then
        told: the count of told rounds goes up by one each)."""
        out = 0
        again = set()
        for slot in self._touched:
            counts = self._counts.get(slot)
            told = self._told.get(slot, 0)
            if counts is not None and min(counts) > told:
                self._told[slot] = told + 1
                out |= 1 << slot
                self._since.pop(slot, None)
                if min(counts) > told + 1:
                    again.add(slot)  # (the next round: after rank 0 decided this one)
        self._touched = again
        return out

    def waiting(self, older_than: float, now: float | None = None) -> list[int]:
        """Slots whose open round some local ranks marked and others not, for ``older_than``
        seconds or more; each is returned once (rank 0 then negotiates it: its stall inspector
        and deadlock detector see which ranks are missing)."""
        now = time.monotonic() if now is None else now
        late = sorted(s for s, t in self._since.items() if now - t >= older_than)
        for slot in late:
            self._since[slot] = float("inf")  # (told once; a drop or a decision clears it)
        return late

    def next_due(self, older_than: float) -> float | None:
        """When (``time.monotonic``) :meth:`waiting` next has a slot; None: never yet."""
        first = min(self._since.values(), default=float("inf"))
        return None if first == float("inf") else first + older_than

    def laggards(self, slot: int) -> list[int]:
        """The local ranks that have marked fewer rounds of ``slot`` than the most (logs)."""
        counts = self._counts.get(slot)
        if not counts:
            return []
        top = max(counts)
        return [r for r, i in self._index.items() if counts[i] < top]

    def drop(self, slots: list[int]) -> None:
        """``slots`` were invalidated: forget them (their numbers are never reused)."""
        for slot in slots:
            self._counts.pop(slot, None)
            self._told.pop(slot, None)
            self._touched.discard(slot)
            self._since.pop(slot, None)


class CacheCoordinator:
    """Rank 0's side: per host, the slots its leader reported ready; a slot every host reported
    is decided. Per message: work for the bits it carries (a count per slot), not per host."""

    def __init__(self, hosts: int) -> None:
        self._hosts = hosts
        self._ready: list[int] = [0] * hosts
        self._count: dict[int, int] = {}  # slot -> hosts that reported it
        self._complete: list[int] = []  # slots every host reported, not yet handed out
        self._since: dict[int, float] = {}  # slot -> when some host first reported it

    def add(self, host: int, bits: int, now: float | None = None) -> None:
        """Host ``host``'s leader reported ``bits`` (a delta)."""
        new = bits & ~self._ready[host]
        if not new:
            return
        self._ready[host] |= new
        stamp = time.monotonic() if now is None else now
        for slot in slots_of(new):
            self._since.setdefault(slot, stamp)
            count = self._count.get(slot, 0) + 1
            self._count[slot] = count
            if count == self._hosts:
                self._complete.append(slot)

    def ready(self) -> list[int]:
        """Slots every host reported, ascending; forgotten from every host's mask."""
        if not self._complete:
            return []
        slots = sorted(self._complete)
        self._complete = []
        self._forget(slots)
        return slots

    def _forget(self, slots: list[int]) -> None:
        clear = 0
        for slot in slots:
            clear |= 1 << slot
            self._since.pop(slot, None)
            self._count.pop(slot, None)
        self._ready = [mask & ~clear if mask & clear else mask for mask in self._ready]

    def pending(self) -> list[int]:
        """Slots some host reported and not every host yet, ascending."""
        return sorted(self._since)

    def waiting(self, older_than: float, now: float | None = None) -> list[int]:
        """Slots some hosts reported and others not, for ``older_than`` seconds or more (the
        stall inspector invalidates them, so that it sees which ranks are missing)."""
        now = time.monotonic() if now is None else now
        return sorted(s for s, t in self._since.items() if now - t >= older_than)

    def missing_hosts(self, slot: int) -> list[int]:
        """Hosts that have not reported ``slot`` yet."""
        return [h for h, mask in enumerate(self._ready) if not mask >> slot & 1]

    def invalidate(self, slots: list[int]) -> None:
        """Forget ``slots`` everywhere (their ops are negotiated instead)."""
        gone = set(slots)
        self._complete = [s for s in self._complete if s not in gone]
        self._forget(slots)


MSG_CACHE_STALL = "cstall"
"""Host leader -> rank 0: ``{"bits": hex, "late": [ranks]}``: slots some of the host's ranks
marked and others not for the cache's patience (rank 0 negotiates them)."""
MSG_CACHE_MARK = "cmark"
"""A rank -> its host's leader: ``{"bits": hex}``: slots this rank marked (one round each)."""

__all__ = ["MAX_SLOTS", "MSG_CACHE_BITS", "MSG_CACHE_DECIDE", "MSG_CACHE_MARK", "MSG_CACHE_STALL",
           "CacheCoordinator", "HostRounds",
           "SlotTable", "decode_bits", "encode_bits", "slots_of"]
