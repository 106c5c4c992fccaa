"""Running agreed responses: rank 0 fans each out to the members that must run it, then every
rank runs the batch in order (the engine thread only).

A response list is the coordinator's decision for one batch: collectives (possibly fused),
process-set changes, joins and errors. Every rank runs the same list in the same order, which is
what keeps the ranks' transports in step. :class:`Responses` owns this rank's table of ops
waiting for their response, and tells the fast lanes each negotiated allreduce and allgather
before it runs (:meth:`~hora.core.lane.lanes.Lanes.learn`, the one place lanes learn). It also
keeps the one flag the engine's failure path needs: whether a collective was running when
something failed (then the error may be an echo of another rank's failure, and the engine
listens for the root cause).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hora.core.data.executor import Executor
from hora.core.engine import trace
from hora.core.engine.liveness import Liveness
from hora.core.lane.lanes import Lanes
from hora.core.op.entry import Entry
from hora.core.op.messages import (
    ERROR_SHUTDOWN,
    ERROR_STALL,
    MSG_RESPONSES,
    OpKind,
    Response,
    encode,
)
from hora.core.op.naming import AutoNames
from hora.core.op.process_set import Registry
from hora.errors import op_error
from hora.timeline.writer import Timeline
from hora.transports.base import Transport


class Responses:
    """Sends and runs response batches for one engine (the engine thread only).

    It owns the table of this rank's negotiated ops waiting for their response (set id ->
    name -> entry): the engine adds each op it requests (:meth:`expect`), running a response
    completes and removes its ops, and :meth:`fail_all` fails what is left. Ranks that said
    goodbye (``liveness.departed``) are sent nothing.
    """

    def __init__(self, transport: Transport, registry: Registry, executor: Executor,
                 lanes: Lanes, names: AutoNames, liveness: Liveness, timeline: Timeline) -> None:
        self._transport = transport
        self._registry = registry
        self._executor = executor
        self._lanes = lanes
        self._names = names
        self._liveness = liveness
        self._timeline = timeline
        self._pending: dict[int, dict[str, Entry]] = {}  # set -> name -> op awaiting its response
        self._departed = liveness.departed  # (the live set: read, never written here)
        self._rank, self._size = transport.rank, transport.size
        self.executing = False
        """True while a batch runs; left True if it raised (the engine's abort reads it)."""
        self.send_ordered: Callable[[list[int], bytes], None] = self._send_direct
        """Rank 0: how a message that must keep its place among the responses reaches its
        peers (the response cache across hosts relays it through the hosts' leaders:
        :class:`~hora.core.engine.cross_host.Relay`)."""

    def _send_direct(self, peers: list[int], payload: bytes) -> None:
        for peer in peers:
            self._transport.send_control(peer, payload)

    def expect(self, entry: Entry) -> None:
        """The engine requested ``entry``'s op: its response will complete it."""
        self._pending.setdefault(entry.request.set_id, {})[entry.request.name] = entry

    def waiting_op(self, set_id: int, name: str) -> Entry | None:
        """The op awaiting its response under ``name`` (the cache's eager slots read it)."""
        ops = self._pending.get(set_id)
        return None if ops is None else ops.get(name)

    def done(self, set_id: int, name: str) -> Entry | None:
        """Forget the op ``name`` (an eager slot completed it without a response)."""
        ops = self._pending.get(set_id)
        return None if ops is None else ops.pop(name, None)

    def fail_all(self, error: BaseException) -> None:
        """Fail every op still waiting for its response with ``error`` (a copy each, its
        attributes kept; an internal error names the op)."""
        pending, self._pending = self._pending, {}
        for ops in pending.values():
            for entry in ops.values():
                entry.handle.set_error(op_error(error, entry.request.name))

    def dispatch(self, responses: list[Response]) -> bool:
        """Rank 0: send ``responses`` to the members that must run them, then run them here.
        Returns False (nothing done) for an empty list."""
        if not responses:
            return False
        trace.negotiation_done(self._timeline, responses)
        for payload, peers in self._payloads(responses):
            self.send_ordered(peers, payload)
        self.execute(responses)
        return True

    def _payloads(self, responses: list[Response]) -> list[tuple[bytes, list[int]]]:
        """Each distinct response list some peers must run, encoded once, with its peers (the
        common case, one list for every rank: one encoding, the same bytes sent N-1 times)."""
        by_peer: dict[int, list[int]] = {}  # peer -> indexes into responses
        for i, resp in enumerate(responses):
            members: Iterable[int] = self._registry.members(resp.set_id) or ()
            if resp.kind is OpKind.ADD_PROCESS_SET or resp.kind is OpKind.REMOVE_PROCESS_SET:
                members = range(self._size)  # every rank keeps the same registry
            for peer in members:
                if peer != 0 and peer not in self._departed:
                    by_peer.setdefault(peer, []).append(i)
        groups: dict[tuple[int, ...], list[int]] = {}
        for peer, picked in by_peer.items():
            groups.setdefault(tuple(picked), []).append(peer)
        return [(encode(MSG_RESPONSES, resps=[responses[i] for i in picked]), peers)
                for picked, peers in groups.items()]

    def execute(self, responses: list[Response]) -> None:
        """Run one batch in order on this rank. Raises what a collective raised (the engine
        aborts the job)."""
        self.executing = True
        try:
            self._execute_all(responses)
            self.executing = False
        finally:
            # While a collective ran nobody's messages were read: don't count that as silence.
            self._liveness.heard_all()

    def _execute_all(self, responses: list[Response]) -> None:
        for resp in responses:
            members = self._registry.ranks(resp.set_id)
            in_set = members is not None and self._rank in members
            if resp.kind is OpKind.REMOVE_PROCESS_SET:
                self._lanes.remove(resp.value)
            elif resp.kind is OpKind.JOIN and in_set:
                self._lanes.joined(resp.set_id, self._executor.existing_route(resp.set_id))
            elif resp.kind is OpKind.ERROR and in_set and resp.value not in (ERROR_STALL,
                                                                             ERROR_SHUTDOWN):
                for name in resp.names:  # a failed op some members never issued: number
                    self._names.observe(resp.set_id, name)  # the next one alike everywhere
                if "join" in resp.names:  # a failed join (deadlock): this rank is back in
                    self._lanes.join_failed(resp.set_id)
            elif in_set and (resp.kind is OpKind.ALLREDUCE or resp.kind is OpKind.ALLGATHER):
                # before it runs, on every member alike: the set's lane opens or learns
                self._lanes.learn(self._executor.route_for(resp.set_id), resp)
            if in_set or resp.kind in (OpKind.ADD_PROCESS_SET, OpKind.REMOVE_PROCESS_SET,
                                       OpKind.ERROR):
                self._executor.execute(resp, self._pending.setdefault(resp.set_id, {}))
