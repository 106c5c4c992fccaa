"""The engine's side of the response cache across hosts (:mod:`hora.core.engine.cross_cache`).

One :class:`CrossCache` per engine, used by the engine thread only, for process set 0 of a job
whose ranks are on more than one host (on one host the fast lane answers). The engine calls it
at four points:

* :meth:`CrossCache.submit` (every rank, before requests are sent or, on rank 0, added to the
  coordinator): a request whose name holds a slot and whose signature agrees is a *hit*; it is
  not sent: the rank sends rank 0 one ``cbits`` message with the slots it marked ready (rank 0
  marks its own directly). Misses go on as requests.
* :meth:`CrossCache.receive` (every control message): ``cbits`` on rank 0, ``cdec`` on the
  others (run these slots, in these fusion groups; drop those slots); it also watches negotiated
  requests and responses: slots are learned from the responses every rank runs, in the one order
  rank 0 sends them (rank 0 learns in :meth:`CrossCache.wrap_dispatch`), and a negotiated request
  for a name that holds a slot invalidates the slot.
* :meth:`CrossCache.poll` (rank 0's loop): a slot that some ranks marked and others not for half
  the deadlock time (or of the stall-warning time when deadlock detection is off) is
  invalidated, so the coordinator, the stall inspector and the deadlock detector see every
  rank's request for it and report what they always report.

**Invalidation** drops the slot on every rank (``cdec`` with ``inval``); a rank whose op marked
the slot sends it as a request instead (rank 0 adds its own to the coordinator). A mismatch
(one rank's request differs from the slot) therefore reaches the coordinator with every rank's
request and fails with the coordinator's message on every rank. A ``join`` suspends the cache
until the join's response (every mark is invalidated on sight, since a joined rank marks
nothing); a rank that says goodbye turns it off. Failure detection is the control plane's.

Rank 0 parses one small message per rank per cycle instead of a JSON request, and never runs
``Coordinator.add`` for a hit. Within a host, the ranks' marks could be combined by the host's
leader over shared memory first (rank 0 then hears once per host, as
``benchmarks/control_plane_sim.py`` measures); here every rank is its own host (the design for
the shared-memory step, not built: docs/multihost.md, "The response cache across hosts").
"""

from __future__ import annotations

from collections.abc import Callable, Set
from typing import Any, TypeVar, cast

from hora._util.log import get_logger
from hora.config import Config
from hora.core.data.fusion import fuse
from hora.core.engine.coordinator import Coordinator
from hora.core.engine.cross_cache import (
    MSG_CACHE_BITS,
    MSG_CACHE_DECIDE,
    CacheCoordinator,
    SlotTable,
    decode_bits,
    encode_bits,
    slots_of,
)
from hora.core.engine.dispatch import Responses
from hora.core.op.messages import (
    MSG_BYE,
    MSG_REQUESTS,
    MSG_RESPONSES,
    MSG_WAITS,
    OpKind,
    Request,
    Response,
    encode,
)
from hora.errors import ProtocolError
from hora.transports.base import Transport

log = get_logger(__name__)

_SET = 0  # the process set the cache serves (the global one)
_D = TypeVar("_D", bound=Callable[[list[Response]], bool])


class CrossCache:
    """See the module's docstring. Build with :meth:`for_job` (None where it does not apply)."""

    @classmethod
    def for_job(cls, transport: Transport, config: Config, hostnames: list[str] | None,
                responses: Responses, coordinator: Coordinator | None,
                departed: Set[int], recording: bool) -> CrossCache | None:
        """The cache for a job whose ranks span hosts; None on one host, for one rank, with
        ``HOROVOD_CACHE_CAPACITY=0`` or while a timeline is configured (every op then shows
        its negotiation)."""
        if (transport.size < 2 or not hostnames or len(set(hostnames)) < 2
                or config.cache_capacity <= 0 or recording or config.timeline):
            return None
        return cls(transport, config, responses, coordinator, departed)

    def __init__(self, transport: Transport, config: Config, responses: Responses,
                 coordinator: Coordinator | None, departed: Set[int]) -> None:
        self._transport = transport
        self._config = config
        self._responses = responses
        self._coordinator = coordinator
        self._departed = departed
        self._size = transport.size
        self._table = SlotTable(config.cache_capacity)
        self._marked: dict[int, Request] = {}  # slot -> this rank's op waiting for a decision
        self.hits = 0  # ops this rank marked instead of requesting (tests, benchmarks)
        self._rank0 = CacheCoordinator(self._size) if coordinator is not None else None
        self._suspended = False  # rank 0: a join is in progress
        self._off = False  # rank 0: a rank said goodbye
        limit = config.deadlock_time_seconds or config.stall_check_time_seconds
        self._patience = max(0.25, min(limit, config.stall_check_time_seconds) / 2)

    # ---- every rank ---------------------------------------------------------------------------
    def submit(self, requests: list[Request]) -> list[Request]:
        """Mark this rank's hits ready; returns the requests to negotiate."""
        misses: list[Request] = []
        bits = 0
        for req in requests:
            slot = (self._table.hit(req) if req.set_id == _SET and req.kind is OpKind.ALLREDUCE
                    else None)
            if slot is None or slot in self._marked:
                misses.append(req)
                continue
            self._marked[slot] = req
            self.hits += 1
            bits |= 1 << slot
        if self._rank0 is not None:
            self._watch_requests(misses)
            if bits:
                self._mark(0, bits)
        elif bits:
            self._transport.send_control(0, encode(MSG_CACHE_BITS, bits=encode_bits(bits)))
        return misses

    def receive(self, sender: int, kind: str, body: dict[str, Any]) -> bool:
        """Look at one control message; True when it was the cache's (the engine skips it).

        Raises:
            ProtocolError: a malformed cache message.
        """
        if self._rank0 is not None:
            if kind == MSG_CACHE_BITS:
                self._mark(sender, decode_bits(body.get("bits")))
                return True
            if kind == MSG_REQUESTS:
                self._watch_requests(body["reqs"])
            elif kind == MSG_BYE:
                self._off = True
                self._invalidate(self._rank0.pending())
            elif kind == MSG_WAITS:
                self._watch_waits(body)
            return False
        if kind == MSG_CACHE_DECIDE:
            self._decided(body)
            return True
        if kind == MSG_RESPONSES:
            for resp in body["resps"]:
                self._learn(resp)
        return False

    def _learn(self, resp: Response) -> None:
        if resp.set_id == _SET:
            self._table.learn(resp)

    # ---- workers ------------------------------------------------------------------------------
    def _decided(self, body: dict[str, Any]) -> None:
        groups, inval = body.get("groups"), body.get("inval")
        if not (isinstance(groups, list) and isinstance(inval, list)
                and all(isinstance(s, int) for s in inval)
                and all(isinstance(g, list) and g and all(isinstance(s, int) for s in g)
                        for g in groups)):
            raise ProtocolError("malformed 'cdec' control message")
        again = []
        for slot in inval:
            self._table.invalidate(slot)
            req = self._marked.pop(slot, None)
            if req is not None:
                again.append(req)
        if again:  # negotiated after all: the coordinator sees every rank's request
            self._transport.send_control(0, encode(MSG_REQUESTS, reqs=again))
        if groups:
            self._responses.execute([self._build(group) for group in groups])

    def _build(self, group: list[int]) -> Response:
        """The response of one fusion group, as :func:`fuse` built it on rank 0."""
        try:
            resp = self._table.response(group[0])
            for slot in group[1:]:
                other = self._table.response(slot)
                resp.names.extend(other.names)
                resp.shapes.extend(other.shapes)
        except KeyError:
            raise ProtocolError(f"rank 0 decided slots {group} that this rank does not "
                                "hold: the ranks' response caches diverged") from None
        for slot in group:
            self._marked.pop(slot, None)
        return resp

    # ---- rank 0 -------------------------------------------------------------------------------
    def wrap_dispatch(self, dispatch: _D) -> _D:
        """Rank 0's dispatch, learning slots from what it sends (before sending, in the order
        every rank receives them) and ending a join's suspension."""
        def learning(responses: list[Response]) -> bool:
            for resp in responses:
                self._learn(resp)
                if resp.set_id == _SET and (resp.kind is OpKind.JOIN or resp.kind is
                                            OpKind.ERROR and "join" in resp.names):
                    self._suspended = False
            return dispatch(responses)
        return cast(_D, learning)

    def poll(self, now: float | None = None) -> bool:
        """Invalidate slots marked by some ranks only, for too long. True if any was."""
        if self._rank0 is None:
            return False
        late = self._rank0.waiting(self._patience, now)
        if late:
            log.debug("cross-host cache: slots %s waited %.2f s for ranks %s; negotiating them",
                      late, self._patience, self._rank0.missing_hosts(late[0]))
            self._invalidate(late)
        return bool(late)

    def _watch_requests(self, requests: list[Request]) -> None:
        stale = []
        for req in requests:
            if req.set_id != _SET:
                continue
            if req.kind is OpKind.JOIN:
                self._suspended = True  # a joined rank marks nothing: negotiate everything
                assert self._rank0 is not None
                stale += self._rank0.pending()
                continue
            slot = self._table.slot_of(_SET, req.name)
            if slot is not None:
                stale.append(slot)
        if stale:
            self._invalidate(sorted(set(stale)))

    def _watch_waits(self, body: dict[str, Any]) -> None:
        """A rank blocked on an op whose slot is pending: negotiate it, so that the deadlock
        detector sees it."""
        waits = body.get("waits")
        if not isinstance(waits, list):
            return
        stale = []
        for item in waits:
            if isinstance(item, list) and len(item) == 4 and item[0] is True and item[1] == _SET:
                slot = self._table.slot_of(_SET, str(item[2]))
                if slot is not None and slot in self._marked_anywhere():
                    stale.append(slot)
        if stale:
            self._invalidate(stale)

    def _marked_anywhere(self) -> set[int]:
        assert self._rank0 is not None
        return set(self._rank0.pending())

    def _mark(self, rank: int, bits: int) -> None:
        assert self._rank0 is not None
        valid = 0
        for slot in slots_of(bits):
            if self._table.holds(slot):
                valid |= 1 << slot  # (a mark for a slot invalidated since is dropped)
        if not valid:
            return
        if self._suspended or self._off:
            self._invalidate(slots_of(valid))
            return
        self._rank0.add(rank, valid)
        ready = self._rank0.ready()
        if ready:
            self._decide(ready)

    def _decide(self, slots: list[int]) -> None:
        fused = fuse([self._table.response(s) for s in slots], self._config.fusion_threshold)
        by_name = {self._table.response(s).names[0]: s for s in slots}
        groups = [[by_name[name] for name in resp.names] for resp in fused]
        self._send_all(encode(MSG_CACHE_DECIDE, groups=groups, inval=[]))
        for slot in slots:
            self._marked.pop(slot, None)
        self._responses.execute(fused)

    def _invalidate(self, slots: list[int]) -> None:
        assert self._rank0 is not None and self._coordinator is not None
        if not slots:
            return
        self._rank0.invalidate(slots)
        again = []
        for slot in slots:
            self._table.invalidate(slot)
            req = self._marked.pop(slot, None)
            if req is not None:
                again.append(req)
        self._send_all(encode(MSG_CACHE_DECIDE, groups=[], inval=slots))
        if again:
            self._coordinator.add(again)

    def _send_all(self, message: bytes) -> None:
        for peer in range(1, self._size):
            if peer not in self._departed:
                self._transport.send_control(peer, message)


__all__ = ["CrossCache"]
