"""The transport interface: how bytes move between the ranks of one job.

A transport gives the engine two planes:

* a **data plane**, :meth:`Transport.comm`, a :class:`~hora.collectives.comm.Comm` over all
  global ranks used by the collective algorithms (raw byte streams, no framing);
* a **control plane** between rank 0 (the coordinator) and every other rank: framed messages
  (:meth:`send_control` / :meth:`recv_control`) that carry requests, responses and shutdown
  notices. It is separate from the data plane so that a request sent at any time can never be
  mistaken for collective data.

:meth:`recv_control` blocks until a message arrives, the timeout passes, or another thread calls
:meth:`wake` — this is how the engine's background thread sleeps without spinning.

Implementations: :mod:`hora.transports.tcp` (any host), :mod:`hora.transports.loopback`
(threads in one process, for tests). Each passes ``tests/transports`` conformance suite.

Errors implementations raise: :class:`~hora.errors.PeerLostError` (a peer closed its connection;
the message names the peer's rank and host), :class:`~hora.errors.HoraTimeoutError` (no progress
before the deadline), :class:`~hora.errors.AuthenticationError`,
:class:`~hora.errors.TransportError`.
"""

from __future__ import annotations

import abc
import socket

from hora.collectives.comm import Comm

MAX_CONTROL_MESSAGE = 64 * 1024 * 1024
"""Largest control message accepted; a longer length field is a protocol error, not an alloc."""


class Transport(abc.ABC):
    """Connections from this rank to every other rank of the job."""

    name: str = "abstract"

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """Global rank of this process."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Number of ranks in the job."""

    @abc.abstractmethod
    def comm(self) -> Comm:
        """The data plane over all global ranks."""

    @abc.abstractmethod
    def send_control(self, peer: int, payload: bytes) -> None:
        """Send one framed control message to ``peer`` (rank 0 <-> others only)."""

    @abc.abstractmethod
    def recv_control(self, timeout: float | None) -> tuple[int, bytes] | None:
        """Next control message as ``(sender, payload)``.

        Returns None when ``timeout`` seconds pass or :meth:`wake` is called first.

        Raises:
            PeerLostError: a control connection closed (names the peer's rank and host).
        """

    def attach_control(self, peer: int, sock: socket.socket) -> bool:
        """Add a control connection to ``peer`` (a connected stream socket made elsewhere, e.g.
        between two ranks of one host): :meth:`send_control` and :meth:`recv_control` then carry
        framed messages to and from ``peer`` as they do between rank 0 and the others, and its
        loss is reported as :class:`~hora.errors.PeerLostError`. Returns False where the
        transport cannot (the caller keeps to rank 0 <-> others); the default."""
        return False

    @abc.abstractmethod
    def wake(self) -> None:
        """Make a concurrent (or the next) :meth:`recv_control` return None promptly.

        Safe to call from any thread, any number of times.
        """

    @abc.abstractmethod
    def describe(self, peer: int) -> str:
        """``'rank 3 (host a)'`` style identity of a peer for messages."""

    def shutdown_data(self) -> None:
        """Stop the data plane at once: peers blocked sending to or receiving from this rank
        get an error now instead of waiting for their timeout. The control plane stays up, so a
        failing rank can still say why. Called by the engine when it aborts. The default does
        nothing (a transport whose close() is the only way to stop its data plane)."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Close every connection. Idempotent."""
