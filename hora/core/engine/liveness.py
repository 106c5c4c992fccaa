"""The control plane's health: heartbeats, goodbyes and abort reasons between ranks.

Part of the engine (:mod:`hora.core.engine.engine`), which owns the control loop; this module holds
what the ranks tell each other about being alive and about failing:

* **heartbeats**: every rank beats to its control peers (rank 0 to every worker, a worker to
  rank 0) each quarter of ``HORA_HEARTBEAT_TIMEOUT_SECONDS``; a peer not heard from for that
  long is lost (:class:`~hora.errors.PeerLostError`, naming it and the knob). The engine wakes
  when the first peer's time is up (:meth:`Liveness.next_beat_in`), so the loss is seen within
  the timeout, not up to a heartbeat interval later;
* **the launcher**: with the heartbeats (or every :data:`LAUNCHER_CHECK_S` when they are off),
  whether the launcher serving the rendezvous store is still there
  (:mod:`hora.rendezvous.launcher_watch`): a killed launcher fails the rank's ops;
* **goodbyes**: a worker that shuts down says ``BYE`` (its connection closing later is then a
  clean exit); rank 0 shutting down tells every worker ``SHUTDOWN``;
* **abort reasons**: a failing rank sends its reason to its control peers and, when its failure
  may be an echo of another's, listens briefly for theirs so the error names the root cause.
"""

from __future__ import annotations

import time

from hora.core.op.messages import MSG_ABORT, MSG_BYE, MSG_HEARTBEAT, MSG_SHUTDOWN, decode, encode
from hora.errors import HoraError, HoraInternalError, PeerLostError
from hora.rendezvous import launcher_watch
from hora.transports.base import Transport

LAUNCHER_CHECK_S = 7.5
"""Seconds between checks of the launcher while heartbeats are off (a quarter of the default
heartbeat timeout); with heartbeats on, every heartbeat checks it."""


class RemoteAbort(HoraInternalError):
    """Another rank told us the job is failing (its reason is the message)."""

    def __init__(self, message: str, sender: int) -> None:
        super().__init__(message)
        self.sender = sender


class Liveness:
    """Heartbeats, goodbyes and abort messages of one rank (the engine thread's)."""

    def __init__(self, transport: Transport, heartbeat_timeout: float) -> None:
        self._transport = transport
        self.rank, self.size = transport.rank, transport.size
        self._timeout = heartbeat_timeout
        now = time.monotonic()
        peers = range(1, self.size) if self.rank == 0 else ([0] if self.size > 1 else [])
        self._last_heard: dict[int, float] = {p: now for p in peers}
        self._last_beat = now
        self._check_every = heartbeat_timeout / 4 if heartbeat_timeout > 0 else LAUNCHER_CHECK_S
        self._next_check = now + self._check_every
        self.departed: set[int] = set()
        """Workers that said goodbye (rank 0)."""

    def heard(self, peer: int) -> None:
        """Any message from ``peer`` proves it alive."""
        self._last_heard[peer] = time.monotonic()

    def heard_all(self) -> None:
        """After a long local operation: count every peer as just heard from (a collective's
        own timeouts covered that time)."""
        now = time.monotonic()
        for peer in self._last_heard:
            self._last_heard[peer] = now

    def depart(self, peer: int) -> None:
        """``peer`` said goodbye: expect nothing more from it."""
        self.departed.add(peer)
        self._last_heard.pop(peer, None)

    def next_beat_in(self) -> float | None:
        """Seconds until :meth:`beat` has something to do: a heartbeat to send, a peer whose
        time is up, the launcher to check (None: nothing, ever)."""
        due = [self._next_check] if launcher_watch.active() else []
        if self._timeout > 0 and self._last_heard:
            due += [self._last_beat + self._timeout / 4,
                    min(self._last_heard.values()) + self._timeout]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def beat(self) -> None:
        """Send our heartbeat when due; declare a control peer lost after a silent timeout,
        and this rank's job lost when its launcher is gone."""
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self._check_every
            gone = launcher_watch.check()
            if gone is not None:
                raise HoraInternalError(gone)
        if self._timeout <= 0 or not self._last_heard:
            return
        if now - self._last_beat >= self._timeout / 4:
            self._last_beat = now
            message = encode(MSG_HEARTBEAT)
            for peer in self._last_heard:
                self._transport.send_control(peer, message)
        for peer, heard in self._last_heard.items():
            if now - heard >= self._timeout:
                raise PeerLostError(
                    f"{self._transport.describe(peer)} sent nothing for {now - heard:.1f} s, not "
                    f"even a heartbeat (HORA_HEARTBEAT_TIMEOUT_SECONDS={self._timeout:g}): it "
                    "is hung, stopped (e.g. SIGSTOP, a debugger) or its host is unreachable",
                    peer=peer)

    def say_goodbye(self) -> None:
        """A worker tells rank 0 it leaves; rank 0 tells every worker still there to stop."""
        try:
            if self.rank != 0:
                self._transport.send_control(0, encode(MSG_BYE))
            else:
                for peer in range(1, self.size):
                    if peer not in self.departed:
                        self._transport.send_control(peer, encode(MSG_SHUTDOWN))
        except HoraError:
            pass  # peers already gone: nothing to tell

    def send_abort(self, exc: HoraError) -> None:
        """Tell the control peers why this rank fails (a reason received from a peer is passed
        on, never echoed back to its sender)."""
        remote = isinstance(exc, RemoteAbort)
        reason = encode(MSG_ABORT, reason=str(exc) if remote else f"rank {self.rank} failed: {exc}")
        for peer in range(1, self.size) if self.rank == 0 else [0]:
            if peer in self.departed or (remote and peer == getattr(exc, "sender", None)):
                continue
            try:
                self._transport.send_control(peer, reason)
            except HoraError:
                pass

    def gather_abort_reasons(self, seconds: float, lost: int | None = None) -> list[str]:
        """Listen up to ``seconds`` for other ranks' abort reasons (a worker stops at rank 0's,
        which already merged what it knew; rank 0 stops once every worker still there, all but
        the departed and ``lost``, the peer its own error names, has reported)."""
        reasons: list[str] = []
        expected = set(range(1, self.size)) - self.departed - {lost, self.rank}
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                msg = self._transport.recv_control(max(0.0, end - time.monotonic()))
            except HoraError:
                continue
            if msg is None:
                continue
            try:
                kind, body = decode(msg[1])
            except HoraError:
                continue
            if kind == MSG_ABORT:
                reasons.append(str(body.get("reason", "")))
                expected.discard(msg[0])
                if self.rank != 0 or not expected:
                    break
        return reasons
