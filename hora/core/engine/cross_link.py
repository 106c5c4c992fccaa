"""The engine's side of the response cache across hosts (:mod:`hora.core.engine.cross_cache`;
hosts, leaders, host links and rank 0's relay: :mod:`hora.core.engine.cross_host`; the whole
design: docs/multihost.md, "The response cache across hosts").

One :class:`CrossCache` per engine (the engine thread only), for process set 0 of a job whose
ranks are on more than one host. The engine calls it at these points:

* :meth:`CrossCache.submit` (every rank, before requests are sent or, on rank 0, added to the
  coordinator): a request whose name holds a slot and whose signature agrees is a *hit*: the
  rank sends its host's leader one ``cmark`` instead. Misses go on as requests, to rank 0.
* :meth:`CrossCache.take` (every control message, raw): a leader forwards rank 0's frames to its
  ranks first, and counts its ranks' marks per round (``HostRounds``); a round complete on the
  host is one ``cbits`` to rank 0. Rank 0 decides a slot every host reported: one ``cdec``
  frame per leader (run these slots in these fusion groups; drop those). Slots are learned
  from the responses every rank runs, in rank 0's one order (rank 0: :meth:`wrap_dispatch`);
  a negotiated request for a name that holds a slot invalidates the slot (every rank drops it;
  ranks that marked it send their request to rank 0: the coordinator's errors, on every rank).
* :meth:`CrossCache.poll` (rank 0 and the leaders): a slot marked by some hosts (by some of a
  host's ranks: the leader's ``cstall``) and not the others for half the deadlock time (or of
  the stall-warning time) is invalidated; so is one a wait report points at.
* :meth:`CrossCache.lost` (a control connection closed) and :meth:`CrossCache.leave` (the
  engine's goodbye: rank 0 ends every relay first, a leader forwards until its host's ends).

Eager slots (:mod:`hora.core.engine.eager`, :mod:`hora.core.engine.eager_link`: a small
allreduce in a job of a few ranks, one per host) skip the marks and the decision: a hit sends its
data to rank 0, whose result completes it; their invalidation is round-exact (dead rounds).
Rank 0's methods are in :mod:`hora.core.engine.cross_rank0`.

A ``join`` suspends the cache until the join's response; a goodbye turns it off everywhere.
With ``per_rank`` (or a transport without host links) every rank is its own host and leader:
rank 0 then hears one ``cbits`` from every rank (``control_plane_sim.py --per-rank-marks``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Set
from typing import Any, TypeVar, cast

from hora._util.log import get_logger
from hora.config import Config
from hora.core.engine.coordinator import Coordinator
from hora.core.engine.cross_cache import (
    MSG_CACHE_BITS,
    MSG_CACHE_DECIDE,
    MSG_CACHE_MARK,
    MSG_CACHE_STALL,
    CacheCoordinator,
    HostRounds,
    SlotTable,
    decode_bits,
    encode_bits,
    slots_of,
)
from hora.core.engine.cross_host import (
    MSG_LOCAL_BYE,
    MSG_RELAY_END,
    HostLayout,
    Item,
    Relay,
    RelayGate,
    control_links,
    forward,
    forward_until_end,
    open_links,
    unframe,
)
from hora.core.engine.cross_rank0 import Rank0Side
from hora.core.engine.eager import MSG_EAGER_ASK, MSG_EAGER_DEAD, check_pairs, is_data
from hora.core.engine.eager_link import Eager
from hora.core.op.messages import (
    MSG_BYE,
    MSG_REQUESTS,
    MSG_RESPONSES,
    MSG_SHUTDOWN,
    MSG_WAITS,
    OpKind,
    Request,
    Response,
    decode,
    encode,
)
from hora.errors import HoraError, PeerLostError, ProtocolError
from hora.transports.base import Transport

log = get_logger(__name__)

_SET = 0  # the process set the cache serves (the global one)
_D = TypeVar("_D", bound=Callable[[list[Response]], bool])
LEAVE_WAIT_S = 5.0
"""How long a leader leaving forwards rank 0's frames, waiting for its host's relay to end."""


class CrossCache(Rank0Side):
    """See the module's docstring. Build with :meth:`for_job` (None where it does not apply)."""

    @classmethod
    def for_job(cls, transport: Transport, config: Config, hostnames: list[str] | None,
                responses: Any, coordinator: Coordinator | None,
                departed: Set[int], recording: bool, job_id: str = "",
                per_rank: bool = False) -> CrossCache | None:
        """The cache for a job whose ranks span hosts; None on one host, for one rank, with
        ``HOROVOD_CACHE_CAPACITY=0`` or while a timeline is configured (every op then shows
        its negotiation). Hosts share their marks through links made here (every rank of a host
        at once) unless ``per_rank``, there is no job id to name them, or the transport cannot
        carry them: then every rank is its own host."""
        if (transport.size < 2 or not hostnames or len(set(hostnames)) < 2
                or config.cache_capacity <= 0 or recording or config.timeline):
            return None
        per_rank = per_rank or not job_id or not control_links(transport)
        layout = HostLayout(hostnames, per_rank)
        if not per_rank:
            open_links(transport, layout, job_id, max(config.start_timeout, 30.0))
        cache = cls(transport, config, responses, coordinator, departed, layout)
        cache.eager = Eager.for_job(transport, config, layout, cache._table, responses)
        return cache

    def __init__(self, transport: Transport, config: Config, responses: Any,
                 coordinator: Coordinator | None, departed: Set[int],
                 layout: HostLayout) -> None:
        self._transport = transport
        self._config = config
        self._responses = responses  # (Responses: execute; send_ordered is set here on rank 0)
        self._coordinator = coordinator
        self._departed = departed
        self._rank, self._size = transport.rank, transport.size
        self.layout = layout
        host = layout.host_of[self._rank]
        self._leader = layout.leaders[host]
        self._table = SlotTable(config.cache_capacity)
        self._marked: dict[int, Request] = {}  # slot -> this rank's op waiting for a decision
        self.hits = 0  # ops this rank marked instead of requesting (tests, benchmarks)
        self.marks_from: dict[int, int] = {}  # rank 0: cbits messages parsed, per sender
        self.decisions = 0  # rank 0: cached cycles it decided (tests, benchmarks)
        self._rounds = HostRounds(layout.hosts[host]) if self._leader == self._rank else None
        self._relayed = self._rank not in (0, self._leader) and self._leader != 0
        self._gate = RelayGate(self._relayed)
        self._left: set[int] = set()  # host links whose far end left cleanly
        self._relay_ended = False  # a leader: rank 0 ended this host's relay
        self.relay: Relay | None = None
        self._rank0: CacheCoordinator | None = None
        if coordinator is not None:
            self.relay = Relay(transport, layout, departed)
            self._rank0 = CacheCoordinator(len(layout.hosts))
            responses.send_ordered = self.relay.send
        self._suspended = False  # rank 0: a join is in progress
        self._off = False  # a rank said goodbye: no more marks, no more slots (every rank)
        limit = config.deadlock_time_seconds or config.stall_check_time_seconds
        self._patience = max(0.25, min(limit, config.stall_check_time_seconds) / 2)
        self.eager: Eager | None = None  # small ops agree in their exchange (module eager)

    # ---- every rank ---------------------------------------------------------------------------
    def submit(self, requests: list[Request]) -> list[Request]:
        """Mark this rank's hits; returns the requests to negotiate."""
        eager = self.eager
        if self._off and eager is None:
            return requests
        misses: list[Request] = []
        bits = 0
        for req in requests:
            if eager is not None and req.set_id == _SET and eager.take(req):
                self.hits += 1
                continue
            slot = (self._table.hit(req) if req.set_id == _SET and req.kind is OpKind.ALLREDUCE
                    and not self._off else None)
            if slot is None or slot in self._marked:
                misses.append(req)
                continue
            self._marked[slot] = req
            self.hits += 1
            bits |= 1 << slot
        if self._rank0 is not None:
            self._watch_requests(misses, 0)
        if bits:
            if self._rounds is not None:
                self._rounds.mark(self._rank, bits)
                self._report()
            else:
                try:
                    self._transport.send_control(self._leader, encode(
                        MSG_CACHE_MARK, bits=encode_bits(bits)))
                except HoraError:
                    # The leader left (its goodbye's "off" is in our inbox and invalidates
                    # these slots) or died (its link's close is reported when we read it).
                    pass
        return misses

    def _report(self) -> None:
        """A leader: tell rank 0 the rounds complete on this host."""
        assert self._rounds is not None
        delta = self._rounds.delta()
        if not delta:
            return
        if self._rank0 is not None:
            self._mark(self.layout.host_of[0], delta)
        else:
            self._transport.send_control(0, encode(MSG_CACHE_BITS, bits=encode_bits(delta)))

    def take(self, sender: int, payload: bytes) -> list[Item]:
        """One raw control message: relay frames forwarded, host-link and cache messages
        handled; returns the messages left for the engine, as ``(sender, kind, body)``
        (rank 0's messages that came through the leader have sender 0).

        Raises:
            ProtocolError: a malformed message.
        """
        if is_data(payload) and self.eager is not None:
            self.eager.arrive(sender, payload)  # (rank 0 <-> a rank, directly: not relayed)
            return []
        framed = unframe(payload)
        if framed is not None:  # a leader: rank 0's frame for this host
            to, me, payload = framed
            forward(self._transport, to, payload, self._left)
            if not me:
                return []
        kind, body = decode(payload)
        if self._relayed:
            if sender == self._leader:  # relayed: rank 0's, in its order
                if kind == MSG_RELAY_END:
                    self._left.add(sender)
                    return self._receive_all(self._gate.end())
                return self._receive_all([(0, kind, body)])
            if sender == 0:
                return self._receive_all(self._gate.direct((0, kind, body)))
        if kind == MSG_CACHE_MARK and self._rounds is not None:
            self._rounds.mark(sender, decode_bits(body.get("bits")))
            self._report()
            return []
        if kind == MSG_LOCAL_BYE:
            self._left.add(sender)
            return []
        if kind == MSG_RELAY_END:
            self._relay_ended = True
            return []
        return self._receive_all([(sender, kind, body)])

    def _receive_all(self, items: list[Item]) -> list[Item]:
        return [item for item in items if not self.receive(*item)]

    def lost(self, exc: PeerLostError) -> bool:
        """A control connection closed: True when that is no failure (now): the far end of a
        host link left cleanly, or rank 0's while the relay is on (:meth:`RelayGate.lost`).

        Raises:
            PeerLostError: rank 0's loss, kept until the leader's link closed as well.
        """
        return exc.peer in self._left or self._relayed and self._gate.lost(exc, self._leader)

    def receive(self, sender: int, kind: str, body: dict[str, Any]) -> bool:
        """Look at one control message; True when it was the cache's (the engine skips it).

        Raises:
            ProtocolError: a malformed cache message.
        """
        if self._rank0 is not None:
            if kind == MSG_CACHE_BITS:
                host = self.layout.host_of[sender]
                if self.layout.leaders[host] != sender:
                    raise ProtocolError(f"rank {sender} sent its host's cache marks but does "
                                        "not lead its host")
                self.marks_from[sender] = self.marks_from.get(sender, 0) + 1
                self._mark(host, decode_bits(body.get("bits")))
                return True
            if kind == MSG_CACHE_STALL:
                stale = [s for s in slots_of(decode_bits(body.get("bits")))
                         if self._table.holds(s)]
                log.debug("cross-host cache: slots %s waited %.2f s for ranks %s of host %d; "
                          "negotiating them", stale, self._patience, body.get("late"),
                          self.layout.host_of[sender])
                self._invalidate(stale)
                return True
            if kind == MSG_EAGER_DEAD and self.eager is not None:
                self._kill(self.eager.dead_from(body))
                return True
            if kind == MSG_REQUESTS:
                self._watch_requests(body["reqs"], sender)
            elif kind == MSG_BYE:  # off on every rank: its marks could go to a leader gone
                dead = None  # (one message: the leaver's connection may close after it)
                if self.eager is not None:
                    self.eager.gone.add(sender)
                    dead = self.eager.declare(sender, None)
                if not self._off:
                    self._off = True
                    self._invalidate(self._rank0.pending(), off=True, dead=dead)
                else:
                    self._kill(dead or [])
                host = self.layout.host_of[sender]
                if self.layout.leaders[host] == sender and self.relay is not None:
                    self.relay.end(host, encode(MSG_RELAY_END))  # its ranks: straight from now
            elif kind == MSG_WAITS:
                self.watch_waits(body.get("waits"))
            return False
        if kind == MSG_CACHE_DECIDE:
            self._decided(body)
            return True
        if kind == MSG_EAGER_ASK and self.eager is not None:
            self.eager.answer(body)
            return True
        if kind == MSG_RESPONSES:
            for resp in body["resps"]:
                self._learn(resp)
        elif kind == MSG_SHUTDOWN and self.eager is not None:
            self.eager.gone.add(0)  # (its eager data came before: Eager.drain)
        return False

    def _learn(self, resp: Response) -> None:
        if resp.set_id == _SET and not self._off:
            self._table.learn(resp)
            if self.eager is not None:
                for name in resp.names:
                    slot = self._table.slot_of(_SET, name)
                    if slot is not None:
                        self.eager.learned(slot, self._table.response(slot))

    def leave(self) -> None:
        """The engine's goodbye (after its loop; rank 0 before it sends its own goodbye, the
        others after theirs): see the module's docstring. Never raises."""
        try:
            if self.eager is not None:
                self.eager.drain(LEAVE_WAIT_S)
            if self.relay is not None:
                self.relay.end_all(encode(MSG_RELAY_END))
            elif self._rounds is None and self._leader != 0:
                self._transport.send_control(self._leader, encode(MSG_LOCAL_BYE))
            elif self.layout.linked(self._rank) and not self._relay_ended:
                forward_until_end(self._transport, self._left, LEAVE_WAIT_S)
        except HoraError:
            pass  # the peer is gone already: nothing to tell

    # ---- workers ------------------------------------------------------------------------------
    def _decided(self, body: dict[str, Any]) -> None:
        groups, inval = body.get("groups"), body.get("inval")
        if not (isinstance(groups, list) and isinstance(inval, list)
                and all(isinstance(s, int) for s in inval)
                and all(isinstance(g, list) and g and all(isinstance(s, int) for s in g)
                        for g in groups)):
            raise ProtocolError("malformed 'cdec' control message")
        again = [] if self.eager is None else self.eager.kill(check_pairs(body))
        for slot in inval:
            self._table.invalidate(slot)
            req = self._marked.pop(slot, None)
            if req is not None:
                again.append(req)
        if body.get("off") is True:  # a rank left: the cache is over, everything negotiated
            self._off = True
            again += self._marked.values()
            self._marked.clear()
        if self._rounds is not None and inval:
            self._rounds.drop(inval)
        if again:  # negotiated after all: the coordinator sees every rank's request
            self._transport.send_control(0, encode(MSG_REQUESTS, reqs=again))
        if groups:
            self._responses.execute([self._build(group) for group in groups])

    def _build(self, group: list[int]) -> Response:
        for slot in group:
            self._marked.pop(slot, None)
        return self._table.fused(group)

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

    def due(self, wait: float | None) -> float | None:
        """The engine's sleep, shortened to a leader's next :meth:`poll` (``wait`` None: none)."""
        due = self._rounds.next_due(self._patience) if self._rounds is not None else None
        if self.eager is not None and self.eager.counts is not None:
            eager_due = self.eager.counts.next_due(self._patience)
            if eager_due is not None:
                due = eager_due if due is None else min(due, eager_due)
        if due is None:
            return wait
        left = max(0.0, due - time.monotonic())
        return left if wait is None else min(wait, left)

    def poll(self, now: float | None = None) -> bool:
        """Rank 0: invalidate slots marked on some hosts only, for too long; a leader: tell
        rank 0 of slots marked by some of its host's ranks only, for as long (``cstall``), so
        that it negotiates them and its stall inspector names the ranks. True if any was."""
        if self._rounds is not None and self._rank0 is None:
            late = self._rounds.waiting(self._patience, now)
            if late:
                laggards = sorted({r for s in late for r in self._rounds.laggards(s)})
                self._transport.send_control(0, encode(MSG_CACHE_STALL, bits=encode_bits(
                    sum(1 << s for s in late)), late=laggards))
            return bool(late)
        if self._rank0 is None:
            return False
        if self.eager is not None and self.eager.counts is not None:
            slots = self.eager.counts.waiting(self._patience, now)
            if slots:
                self._kill(self.eager.ask_late(slots))
                return True
        late = self._rank0.waiting(self._patience, now)
        if late:
            missing = [self.layout.hosts[h] for h in self._rank0.missing_hosts(late[0])]
            log.debug("cross-host cache: slots %s waited %.2f s for the hosts of ranks %s; "
                      "negotiating them", late, self._patience, missing)
            self._invalidate(late)
        return bool(late)


__all__ = ["CrossCache"]
