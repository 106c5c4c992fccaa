"""The fast lane's cache: which ops a lane may run without negotiation, and their responses.

Part of :mod:`hora.core.lane.fastlane` (whose docstring describes the protocol). Once rank 0's
coordinator has negotiated an allreduce or an allgather, every member remembers its agreed
properties in a numbered :class:`Slot`; :meth:`SlotCache.learn` runs on the engine thread before
the response runs, in response order, so every member numbers slots alike. A later request with
the same name and :func:`~hora.core.op.agreement.signature` is a *hit*. A *unit* (one op, or the
members of one grouped call) is a hit only if every member is; it is then logged, decided and
run as a whole. When the lane runs a batch, :meth:`SlotCache.responses` rebuilds the responses
the coordinator would have sent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from hora.collectives.ops import to_dtype
from hora.core.data.routing import Route
from hora.core.op.agreement import (
    FusionKey,
    Signature,
    agrees,
    fusion_key,
    lane_fusable,
    response_signature,
)
from hora.core.op.entry import Entry
from hora.core.op.messages import OpKind, Request, Response
from hora.core.op.naming import is_automatic

# (module constants: an enum member read through its class costs 100-200 ns in Python 3.11;
# the hot path reads these instead)
_ALLREDUCE, _ALLGATHER = OpKind.ALLREDUCE, OpKind.ALLGATHER

MAX_BYTES = 16 * 1024 * 1024
"""Largest allreduce (and fused batch) the lane runs: up to here the lane is no slower than
negotiation (it saves the coordinator's round trip); above it the lane's own pair of segments
would mostly double the shared memory for no gain (the measurements: docs/benchmarks.md,
"Measurements behind the code's constants")."""

MAX_GATHER_BYTES = 4 * 1024 * 1024
"""Largest allgather result the lane runs."""

MAX_ROWS = 0xFFFFFFFF
"""An allgather's first dimension must fit its board word to be a hit."""


@dataclass(frozen=True)
class Slot:
    """One cached op: a request with the same name and :func:`~hora.core.op.agreement.signature`
    is a hit.

    ``shape`` and ``nbytes``: an allreduce's shape and size; an allgather's dimensions after the
    first and the size of one row (the first dimension may differ across ranks and steps).
    ``fusion``: the allreduce's fusion key; None for an allgather (never fused).
    """

    index: int
    name: str
    kind: OpKind
    signature: Signature
    shape: tuple[int, ...]
    nbytes: int
    fusion: FusionKey | None
    response: Response | None = None  # an allreduce's response when it runs alone

    def fuses_with(self, other: Slot) -> bool:
        return self.fusion is not None and self.fusion == other.fusion


class SlotCache:
    """The slots of one lane (see the module docstring).

    Args:
        set_id: the process set.
        route: the lane's route (what fits in shared memory).
        capacity: ``HOROVOD_CACHE_CAPACITY``: at most this many names.
        limit: the lane's fusion limit in bytes (a grouped allreduce larger than this is logged
            unit by unit, and split by the leader).
    """

    def __init__(self, set_id: int, route: Route, capacity: int, limit: int) -> None:
        self._set_id = set_id
        self._route = route
        self._capacity = capacity
        self.limit = limit
        self.slots: list[Slot] = []  # written on the engine thread, read by every other
        self._by_name: dict[str, Slot] = {}
        # name -> the last request found to agree with its slot (requests never change, so the
        # same object agrees again without the comparison); dropped when the slot changes
        self._agreed: dict[str, Request] = {}
        self._responses: dict[tuple[str, ...], Response] = {}  # the driving thread's only
        self._stale = False

    # ---- learning (engine thread) ------------------------------------------------------------
    def learn(self, resp: Response) -> None:
        """Remember a negotiated allreduce's or allgather's tensors (before it runs, on every
        member alike)."""
        if resp.kind is OpKind.ALLGATHER:
            if resp.shapes:
                dims = tuple(resp.shapes[0][1:])
                row = math.prod(dims) * to_dtype(resp.dtype).itemsize
                self._add(resp.names[0], OpKind.ALLGATHER, response_signature(resp), dims,
                          row, None)
            return
        if not lane_fusable(resp):
            return
        itemsize = to_dtype(resp.dtype).itemsize
        fusion = fusion_key(resp)
        for i, (name, shape) in enumerate(zip(resp.names, resp.shapes)):
            nbytes = math.prod(shape) * itemsize
            if nbytes > MAX_BYTES or not self._route.fits(nbytes):
                continue
            self._add(name, OpKind.ALLREDUCE, response_signature(resp, i), tuple(shape),
                      nbytes, fusion)

    def _add(self, name: str, kind: OpKind, signature: Signature, shape: tuple[int, ...],
             nbytes: int, fusion: FusionKey | None) -> None:
        if is_automatic(name):  # it never recurs: a slot for it would only use up the capacity
            return  # (an object collective makes one per call)
        old = self._by_name.get(name)
        if old is None and len(self.slots) >= self._capacity:
            return  # full: like Horovod's cache at capacity, new names are negotiated
        index = len(self.slots) if old is None else old.index
        alone = None if fusion is None else Response(
            kind=OpKind.ALLREDUCE, names=[name], set_id=self._set_id, dtype=fusion.dtype,
            device=fusion.device, op=fusion.op, prescale=fusion.prescale,
            postscale=fusion.postscale, shapes=[list(shape)])  # built once, run every step
        slot = Slot(index, name, kind, signature, shape, nbytes, fusion, alone)
        if old is None:
            self.slots.append(slot)
        elif old != slot:
            self.slots[index] = slot
            self._agreed.pop(name, None)
            self._stale = True  # cached responses may name the old shape
        self._by_name[name] = slot

    def adopt(self, other: SlotCache) -> None:
        """Take over another lane's slots (a lane reopened after ``join``)."""
        self.slots = list(other.slots)
        self._by_name = dict(other._by_name)

    # ---- hit test (submitting threads) -------------------------------------------------------
    def hits(self, entries: list[Entry]) -> list[Slot] | None:
        """The slots of a unit whose every op is a hit, else None. A grouped allreduce larger
        than one fused op is still a hit (the leader splits it in order)."""
        found = []
        for entry in entries:
            req = entry.request
            slot = self._by_name.get(req.name)
            if slot is None:
                return None
            if self._agreed.get(req.name) is not req:  # (the API reuses an equal request)
                if not agrees(slot.signature, req):  # (the kind is in it)
                    return None
                self._agreed[req.name] = req
            if slot.kind is _ALLREDUCE:
                if entry.output is None:
                    return None
            elif not 0 <= req.shape[0] <= MAX_ROWS:
                return None
            found.append(slot)
        return found

    # ---- responses (the driving thread) ------------------------------------------------------
    def responses(self, entries: list[Entry], rows: Callable[[int], list[int]],
                  start: int) -> list[Response]:
        """What the coordinator would have sent for the batch ``entries`` (log positions
        ``start, start + 1, ...``): one fused allreduce, or one allgather per entry, whose
        first dimensions ``rows(position)`` reads from every member's board."""
        if len(entries) == 1:
            slot = self._by_name[entries[0].request.name]
            if slot.response is not None:  # one allreduce (every step of a small model)
                return [slot.response]
        if self._stale:
            self._stale = False
            self._responses.clear()
        slots = [self._by_name[e.request.name] for e in entries]
        if slots[0].kind is _ALLGATHER:
            out = []
            for i, slot in enumerate(slots):
                dtype, device = slot.signature[1], slot.signature[2]
                dims = rows(start + i)
                out.append(Response(kind=OpKind.ALLGATHER, names=[slot.name],
                                    set_id=self._set_id, dtype=str(dtype), device=str(device),
                                    shapes=[[dims[0], *slot.shape]], first_dims=[dims]))
            return out
        key = tuple(s.name for s in slots)
        resp = self._responses.get(key)
        if resp is None:  # the same batches recur every step: build each response once
            agreed = slots[0].fusion  # every slot of a batch has the same fusion key
            assert agreed is not None
            resp = Response(kind=OpKind.ALLREDUCE, names=list(key), set_id=self._set_id,
                            dtype=agreed.dtype, device=agreed.device, op=agreed.op,
                            prescale=agreed.prescale, postscale=agreed.postscale,
                            shapes=[list(s.shape) for s in slots])
            if len(self._responses) >= self._capacity:
                self._responses.clear()
            self._responses[key] = resp
        return [resp]

    def allgather_fits(self, slot: Slot, rows: list[int]) -> bool:
        """Whether an allgather of ``rows`` per member runs in the lane (the leader decides)."""
        nbytes = sum(rows) * slot.nbytes
        return nbytes <= MAX_GATHER_BYTES and self._route.fits(nbytes)
