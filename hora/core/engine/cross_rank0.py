"""Rank 0's side of the response cache across hosts (:class:`Rank0Side`, a base of
:class:`~hora.core.engine.cross_link.CrossCache`): what a negotiated request, a join, a wait
report or a host's marks do to the slots, and how rank 0 decides and invalidates them (decision
slots: :mod:`hora.core.engine.cross_cache`; eager slots' dead rounds:
:mod:`hora.core.engine.eager`). The engine thread only."""

from __future__ import annotations

from typing import Any

from hora.config import Config
from hora.core.data.fusion import fuse
from hora.core.engine.coordinator import Coordinator
from hora.core.engine.cross_cache import (
    MSG_CACHE_DECIDE,
    CacheCoordinator,
    HostRounds,
    SlotTable,
    slots_of,
)
from hora.core.engine.cross_host import Relay
from hora.core.engine.eager_link import Eager
from hora.core.op.messages import OpKind, Request, encode

_SET = 0  # the process set the cache serves (the global one)


class Rank0Side:
    """Rank 0's methods of :class:`~hora.core.engine.cross_link.CrossCache` (its attributes
    are set there)."""

    _config: Config
    _coordinator: Coordinator | None
    _rank0: CacheCoordinator | None
    _table: SlotTable
    _marked: dict[int, Request]
    _rounds: HostRounds | None
    _responses: Any
    _suspended: bool
    _off: bool
    eager: Eager | None
    decisions: int
    relay: Relay | None

    def _watch_requests(self, requests: list[Request], sender: int) -> None:
        if self.eager is not None:  # a negotiated request, a join: dead rounds (round-exact)
            joins = any(r.kind is OpKind.JOIN and r.set_id == _SET for r in requests)
            self._kill(self.eager.declare(sender, None) if joins else self.eager.declare(
                sender, [r.name for r in requests if r.set_id == _SET]))
        if self._off:
            return
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
            if slot is not None and (self.eager is None or not self.eager.is_eager(slot)):
                stale.append(slot)
        if stale:
            self._invalidate(sorted(set(stale)))

    def watch_waits(self, waits: object) -> None:
        """Rank 0: a rank (this one included) blocked on an op whose name holds a slot: negotiate
        it, so that the deadlock detector sees it (its marks may sit at a leader whose host
        never completes the round: rank 0 would hear nothing of them)."""
        if not isinstance(waits, (list, tuple)):
            return
        stale = []
        for item in waits:
            if isinstance(item, (list, tuple)) and len(item) == 4 and item[0] is True \
                    and item[1] == _SET:
                slot = self._table.slot_of(_SET, str(item[2]))
                if self.eager is not None and self.eager.counts is not None and \
                        str(item[2]) in self.eager.counts.by_name:
                    self._kill(self.eager.ask_late(self.eager.slots_named([str(item[2])])))
                elif slot is not None:
                    stale.append(slot)
        if stale:
            self._invalidate(sorted(set(stale)))

    def _mark(self, host: int, bits: int) -> None:
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
        self._rank0.add(host, valid)
        ready = self._rank0.ready()
        if ready:
            self._decide(ready)

    def _decide(self, slots: list[int]) -> None:
        fused = fuse([self._table.response(s) for s in slots], self._config.fusion_threshold)
        by_name = {self._table.response(s).names[0]: s for s in slots}
        groups = [[by_name[name] for name in resp.names] for resp in fused]
        self._send_all(encode(MSG_CACHE_DECIDE, groups=groups, inval=[]))
        self.decisions += 1
        for slot in slots:
            self._marked.pop(slot, None)
        self._responses.execute(fused)

    def _invalidate(self, slots: list[int], off: bool = False,
                    dead: list[tuple[int, int]] | None = None) -> None:
        """Drop decision ``slots`` (``off``: the cache is over) and kill eager rounds ``dead``
        (:mod:`hora.core.engine.eager`), in one message to every rank; ops marked or pending
        on them here are negotiated."""
        assert self._rank0 is not None and self._coordinator is not None
        if not slots and not off and not dead:
            return
        self._rank0.invalidate(slots)
        again = self.eager.kill(dead) if dead and self.eager is not None else []
        for slot in slots:
            self._table.invalidate(slot)
            req = self._marked.pop(slot, None)
            if req is not None:
                again.append(req)
        if off:
            again += self._marked.values()
            self._marked.clear()
        if self._rounds is not None:
            self._rounds.drop(slots)
        extra: dict[str, Any] = {"off": True} if off else {}
        if dead:
            extra["dead"] = [list(p) for p in dead]
        self._send_all(encode(MSG_CACHE_DECIDE, groups=[], inval=slots, **extra))
        if again:
            self._coordinator.add(again)

    def _kill(self, pairs: list[tuple[int, int]]) -> None:
        """Rank 0: dead eager rounds, to every rank and here (ops on them negotiated)."""
        self._invalidate([], dead=pairs)

    def _send_all(self, message: bytes) -> None:
        assert self.relay is not None
        self.relay.send_all(message)


__all__ = ["Rank0Side"]
