"""The engine's side of the eager slots of the response cache across hosts (the rules:
:mod:`hora.core.engine.eager`; the cache: :mod:`hora.core.engine.cross_link`, which calls
:class:`Eager` from the engine thread only).

* :meth:`Eager.learned`: a slot the table learned is eager when its response is (the same on
  every rank).
* :meth:`Eager.take`: this rank's request. A hit on an eager slot commits the slot's next
  round: a rank other than 0 sends its input's bytes to rank 0 (one control message, tagged);
  rank 0, once every rank's data is in, reduces them and sends the result to every other rank
  (:meth:`arrive`, from the engine's receive loop; never blocking), and each completes its op
  with it. A miss on an eager slot declares the slot's next round dead here (rank 0 declares
  it for everyone from the request).
* :meth:`drain`: a rank leaving completes the eager ops whose data or result is on its way.
* :meth:`kill`: rank 0's ``(slot, dead round)`` pairs: pending ops on dead rounds become
  negotiated requests.
* Rank 0: :meth:`declare` (a negotiated request, a join or a goodbye), :meth:`ask_late` (a
  round waiting too long, or one a blocked rank waits on: ``cask`` to the late ranks).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from hora.collectives.ops import SUPPORTED_DTYPES, ReduceOp, reduce_inplace, scale_inplace
from hora.config import Config
from hora.core.engine.cross_cache import SlotTable
from hora.core.engine.cross_host import HostLayout
from hora.core.engine.eager import (
    MAX_RANKS,
    MSG_EAGER_ASK,
    MSG_EAGER_DEAD,
    EagerCounts,
    EagerRounds,
    Pending,
    is_data,
    pack,
    unpack,
)
from hora.core.op.messages import (
    MSG_BYE,
    MSG_SHUTDOWN,
    OpKind,
    Request,
    Response,
    decode,
    encode,
)
from hora.errors import HoraError, PeerLostError, ProtocolError
from hora.transports.base import Transport

_OPS = {int(op): op for op in ReduceOp}
_ELEMENTWISE = (ReduceOp.Sum, ReduceOp.Average, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)


class Eager:
    """See the module's docstring. Build with :meth:`for_job` (None where it does not apply)."""

    @classmethod
    def for_job(cls, transport: Transport, config: Config, layout: HostLayout,
                table: SlotTable, responses: Any) -> Eager | None:
        """Eager slots for a job of at most ``MAX_RANKS`` ranks, one per host, with the
        ``eager_cache`` knob on and the builtin data plane (the same decision on every rank)."""
        if (not config.eager_cache or transport.size > MAX_RANKS
                or config.data_plane != "builtin" or config.small_allreduce_bytes <= 0
                or any(len(ranks) != 1 for ranks in layout.hosts)):
            return None
        return cls(transport, config, table, responses)

    def __init__(self, transport: Transport, config: Config, table: SlotTable,
                 responses: Any) -> None:
        self._transport = transport
        self._rank, self._size = transport.rank, transport.size
        self._table = table
        self._responses = responses  # (Responses: waiting_op, done)
        self._limit = config.small_allreduce_bytes
        self.rounds = EagerRounds(self._rank, self._size)
        self.counts = EagerCounts(self._size) if self._rank == 0 else None
        self._how: dict[int, tuple[np.dtype[Any], ReduceOp, float]] = {}  # slot -> reduction
        self._peers = [p for p in range(self._size) if p != self._rank]
        self.gone: set[int] = set()  # peers that said goodbye (sends to them skipped)

    def learned(self, slot: int, resp: Response) -> None:
        """The table gave ``resp``'s (single-name) slot ``slot``: eager if it qualifies."""
        dtype = SUPPORTED_DTYPES.get(resp.dtype)
        op = _OPS.get(resp.op)
        if (slot in self._how or dtype is None or op not in _ELEMENTWISE
                or resp.kind is not OpKind.ALLREDUCE or len(resp.names) != 1 or resp.joined
                or resp.prescale != 1.0
                or math.prod(resp.shapes[0]) * dtype.itemsize > self._limit):
            return
        assert op is not None
        scale = resp.postscale / self._size if op is ReduceOp.Average else resp.postscale
        self._how[slot] = (dtype, op, scale)
        if self.counts is not None:
            self.counts.add(slot, resp.names[0])

    def is_eager(self, slot: int) -> bool:
        return slot in self._how

    # ---- every rank ---------------------------------------------------------------------------
    def take(self, req: Request) -> bool:
        """This rank's request: True when it committed an eager round (the op completes when
        every rank's data is in); False: negotiate it (a miss on an eager slot declares the
        slot's next round dead here)."""
        slot = self._table.slot_of(req.set_id, req.name)
        if slot is None or slot not in self._how:
            return False
        entry = self._responses.waiting_op(req.set_id, req.name)
        data = self._data(slot, req, entry)
        if data is None or not self.rounds.can_commit(slot):
            _, over = self.rounds.kill(slot, self.rounds.committed.get(slot, 0))
            if over:
                self._table.invalidate(slot)
            return False
        rnd, done = self.rounds.commit(slot, entry, data)
        if self.counts is not None:
            self.counts.commit(0, slot, rnd)
        if self._rank != 0:
            try:
                self._transport.send_control(0, pack(slot, rnd, data))
            except HoraError:
                pass  # rank 0 is gone: its connection's close is reported
        if done is not None:
            self._finish(done)
        return True

    def _data(self, slot: int, req: Request, entry: Any) -> bytes | None:
        """This rank's input for ``slot`` as bytes; None when the op cannot run eagerly (a
        changed signature, a grouped op, a device or non-contiguous buffer)."""
        if entry is None or req.group or self._table.hit(req) != slot:
            return None
        x, out = entry.tensor, entry.output
        dtype = self._how[slot][0]
        if (type(x) is not np.ndarray or type(out) is not np.ndarray or x.dtype != dtype
                or out.dtype != dtype or not out.flags.c_contiguous or out.flags.writeable
                is False):
            return None
        return x.tobytes()

    def arrive(self, sender: int, payload: bytes) -> None:
        """A peer's eager data (raw control message).

        Raises:
            ProtocolError: malformed, or data for a round this rank completed.
        """
        slot, rnd, data, result = unpack(payload)
        if result != (sender == 0) or (self._rank == 0) == result:
            raise ProtocolError(f"rank {self._rank}: eager {'result' if result else 'data'} "
                                f"from rank {sender}")
        if result:
            done = self.rounds.result(slot, rnd, data)
            if done is not None:
                self._finish(done)
            return
        if self.counts is not None:
            self.counts.commit(sender, slot, rnd)
        done = self.rounds.arrive(sender, slot, rnd, data)
        if done is not None:
            self._finish(done)

    def _finish(self, pending: Pending) -> None:
        """Rank 0: every rank's data is in: reduce in rank order, scale, send the result to the
        others, complete the op. The others: rank 0's result, copied, completes the op."""
        entry = pending.op
        self._responses.done(entry.request.set_id, entry.request.name)
        dtype, op, scale = self._how[pending.slot]
        out = entry.output.reshape(-1)
        parts = pending.parts
        np.copyto(out, np.frombuffer(parts[0], dtype))  # type: ignore[arg-type]
        if len(parts) > 1:
            for part in parts[1:]:
                reduce_inplace(out, np.frombuffer(part, dtype), op)  # type: ignore[arg-type]
            if scale != 1.0:
                scale_inplace(out, scale)
            message = pack(pending.slot, pending.round, out.tobytes(), result=True)
            for peer in self._peers:
                if peer not in self.gone:
                    try:
                        self._transport.send_control(peer, message)
                    except HoraError:
                        pass  # it died: its connection's close is reported
        result = entry.output
        if entry.finish is not None:
            result = entry.finish(result)
        entry.handle.set_result(result)
        if self.rounds.over(pending.slot):
            self._table.invalidate(pending.slot)

    def kill(self, pairs: list[tuple[int, int]]) -> list[Request]:
        """Rank 0's dead rounds: the requests of ops pending on them (to negotiate)."""
        again = []
        for slot, dead in pairs:
            converted, over = self.rounds.kill(slot, dead)
            if converted is not None:
                again.append(converted.op.request)
            if over:
                self._table.invalidate(slot)
        return again

    def asked(self, slot: int, rnd: int) -> bool:
        """Rank 0 asks about round ``rnd`` of ``slot`` (it waited for this rank): True when
        this rank had not committed it and now never will (declared dead here)."""
        if self.rounds.committed.get(slot, 0) != rnd or not self.rounds.can_commit(slot):
            return False
        _, over = self.rounds.kill(slot, rnd)
        if over:
            self._table.invalidate(slot)
        return True

    def drain(self, wait: float) -> None:
        """Leaving (rank 0's shutdown, or this rank's): complete the ops pending here whose
        data is still on its way (a peer's data travels before its goodbye, its connection's
        close or, from rank 0, its shutdown), for at most ``wait`` seconds; what cannot
        complete any more (a rank left without committing its round) is left to fail with the
        engine's shutdown error. Other messages are dropped (the engine has stopped)."""
        end = time.monotonic() + wait
        while self.rounds.pending and (0 not in self.gone if self._rank else any(
                p.parts[r] is None and r not in self.gone
                for p in self.rounds.pending.values() for r in range(self._size))):
            left = end - time.monotonic()
            if left <= 0:
                return
            try:
                msg = self._transport.recv_control(left)
            except PeerLostError as exc:
                if exc.peer is None:
                    return
                self.gone.add(exc.peer)
                continue
            except HoraError:
                return
            if msg is None:
                continue
            sender, payload = msg
            try:
                if is_data(payload):
                    self.arrive(sender, payload)
                elif decode(payload)[0] in (MSG_BYE, MSG_SHUTDOWN):
                    self.gone.add(sender)
            except HoraError:
                return

    # ---- rank 0 -------------------------------------------------------------------------------
    def declare(self, rank: int, names: list[str] | None) -> list[tuple[int, int]]:
        """Rank 0: ``rank`` negotiates ``names`` (None: it joins or leaves: every slot): the
        dead rounds to send."""
        assert self.counts is not None
        if names is None:
            return self.counts.declare_all(rank)
        out = []
        for name in names:
            slot = self.counts.by_name.get(name)
            dead = None if slot is None else self.counts.declare(slot, rank)
            if slot is not None and dead is not None:
                out.append((slot, dead))
        return out

    def ask_late(self, slots: list[int]) -> list[tuple[int, int]]:
        """Rank 0: ask the ranks late on ``slots``' open rounds (once per round); returns the
        dead rounds rank 0 itself declared (it was late)."""
        assert self.counts is not None
        out = []
        for slot in slots:
            late = self.counts.ask(slot)
            if late is None:
                continue
            rnd, ranks = late
            for rank in ranks:
                if rank == 0:
                    if self.asked(slot, rnd):
                        dead = self.counts.declared(slot, rnd)
                        if dead is not None:
                            out.append((slot, dead))
                    continue
                try:
                    self._transport.send_control(rank, encode(MSG_EAGER_ASK, slot=slot,
                                                              round=rnd))
                except HoraError:
                    pass  # its loss is reported on the connection
        return out

    def answer(self, body: dict[str, Any]) -> None:
        """A rank other than 0: rank 0's question (``cask``); declares the round dead if it was
        not committed (``cdead`` to rank 0)."""
        slot, rnd = body.get("slot"), body.get("round")
        if isinstance(slot, int) and isinstance(rnd, int) and self.asked(slot, rnd):
            self._transport.send_control(0, encode(MSG_EAGER_DEAD, slot=slot, round=rnd))

    def dead_from(self, body: dict[str, Any]) -> list[tuple[int, int]]:
        """Rank 0: a rank's ``cdead`` (the answer to ``cask``): the dead rounds to send."""
        assert self.counts is not None
        slot, rnd = body.get("slot"), body.get("round")
        if not isinstance(slot, int) or not isinstance(rnd, int):
            raise ProtocolError("malformed 'cdead' control message")
        dead = self.counts.declared(slot, rnd)
        return [] if dead is None else [(slot, dead)]

    def slots_named(self, names: list[str]) -> list[int]:
        """Rank 0: the eager slots of ``names`` (for the wait reports)."""
        assert self.counts is not None
        return [s for s in (self.counts.by_name.get(n) for n in names) if s is not None]


__all__ = ["Eager"]
