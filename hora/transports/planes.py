"""What every external data plane shares: the interface, completion tickets, and the watch
that keeps hora's failure detection working while another engine moves the bytes.

hora's control plane (negotiation, fusion, checks, stall and deadlock detection) always runs
over its own TCP connections. With ``HORA_DATA_PLANE=torch`` or ``mpi`` only the *bytes* of a
data collective go through another engine: :mod:`hora.transports.torch_plane`
(``torch.distributed``, gloo) or :mod:`hora.transports.mpi_plane` (mpi4py). Each is an
:class:`ExternalPlane` over the members of one process set; the core's
:mod:`hora.core.data.plane_route` calls it.

**Waiting.** An op is started on the external engine and returns a :class:`Ticket`; the engine
completes it from its own thread and rings the plane's :class:`Doorbell` (a pipe). The caller
waits in :meth:`PeerWatch.wait`, which polls the doorbell *and* hora's own data connections to
the set's peers: those stay idle while another engine moves the data, so the only thing that
can happen on them is end-of-file, when a peer's process died (the kernel closes its sockets)
or when it aborted (a failing hora rank shuts its data connections down). Either way the wait
raises :class:`~hora.errors.PeerLostError` naming the rank and host at once, however the
external engine reacts to the loss (gloo notices it too; Open MPI's shared-memory transport
never does, and MPI calls have no timeout). An op that does not complete within the timeout
raises :class:`~hora.errors.HoraTimeoutError`.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from hora.errors import HoraTimeoutError, PeerLostError, TransportError
from hora.transports.tcp import TcpTransport

LOST_HINT = "it probably exited or crashed; see its output"
LOST_GRACE_S = 0.1
"""After a peer's connection closed, how long an op may still take to complete normally."""


class Doorbell:
    """A pipe that an engine thread writes one byte to when an op completes."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._closed = False
        self._lock = threading.Lock()  # a late ring never writes to a closed (reused) fd

    def fileno(self) -> int:
        return self._read

    def ring(self) -> None:
        """Wake the waiter (any thread; a full pipe already holds a wake-up)."""
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._write, b"\0")
            except OSError:  # full: a wake-up is pending already
                pass

    def drain(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._read)
                os.close(self._write)


class Ticket:
    """One op in flight on an external engine: done once :meth:`finish` was called."""

    __slots__ = ("_bell", "done", "error", "keep", "settle")

    def __init__(self, bell: Doorbell, keep: Any = None,
                 settle: Callable[[], None] | None = None) -> None:
        self._bell = bell
        self.done = False
        self.error: str | None = None
        self.keep = keep  # the engine's buffers and handles, alive until the op is done
        self.settle = settle
        """Called by the waiter's thread once the op is done, before it reads the results
        (device memory: makes that thread's stream wait for the engine's, ``work.wait()``)."""

    def finish(self, error: str | None = None) -> None:
        """The engine's thread: the op completed (``error``: why it failed)."""
        self.error = error
        self.done = True
        self.keep = None
        self._bell.ring()


class ExternalPlane(Protocol):
    """An external engine's collectives over the members of one process set.

    Buffers are numpy arrays or, for a plane with ``native = True``, the framework's own tensors
    on their device (the core's device buffers, ``hora.core.op.device``); ``op`` is ``"sum"``,
    ``"min"``, ``"max"`` or ``"product"``; counts are elements of the buffer's dtype (host
    buffers of the moving ops come as bytes). Every method starts the op and returns at once;
    the op is complete when its ticket is done.
    """

    name: str
    bell: Doorbell

    def reduces(self, dtype: np.dtype[Any], op: str) -> bool:
        """Whether the engine can reduce ``dtype`` with ``op`` (the same answer on every rank)."""
        ...

    def allreduce(self, buf: np.ndarray, op: str) -> Ticket: ...

    def allgather(self, send: np.ndarray, counts: Sequence[int], out: np.ndarray) -> Ticket: ...

    def broadcast(self, buf: np.ndarray, root: int) -> Ticket: ...

    def alltoall(self, send: np.ndarray, send_counts: Sequence[int], out: np.ndarray,
                 recv_counts: Sequence[int]) -> Ticket: ...

    def reducescatter(self, buf: np.ndarray, counts: Sequence[int], op: str,
                      out: np.ndarray) -> Ticket: ...

    def close(self) -> None:
        """Release the engine's group (local). After a failed op it may only be abandoned."""
        ...


class PeerWatch:
    """Waits for an external plane's op while watching hora's connections to the set's peers.

    Args:
        transport: hora's TCP transport (its data connections are watched, never used).
        peers: the global ranks of the set's other members.
        timeout: seconds an op may take before it fails (``HORA_TIMEOUT_SECONDS``).
        plane: the plane's name, for messages.
    """

    def __init__(self, transport: TcpTransport, peers: Sequence[int], timeout: float,
                 plane: str) -> None:
        self._transport = transport
        self._socks = transport.data_connections(list(peers))
        self._by_fd = {sock.fileno(): peer for peer, sock in self._socks.items()}
        self._timeout = timeout
        self._plane = plane
        self._poller: select.poll | None = None
        self._bell_fd = -1
        self._lock = threading.Lock()

    def _poll(self, bell: Doorbell) -> select.poll:
        if self._poller is None or self._bell_fd != bell.fileno():
            poller = select.poll()
            poller.register(bell.fileno(), select.POLLIN)
            for fd in self._by_fd:
                poller.register(fd, select.POLLIN)
            self._poller, self._bell_fd = poller, bell.fileno()
        return self._poller

    def lost(self) -> int | None:
        """A peer whose connection reached end-of-file or broke (no waiting), or None."""
        for fd, peer in self._by_fd.items():
            if self._closed(fd):
                return peer
        return None

    def _closed(self, fd: int) -> bool:
        sock = self._socks[self._by_fd[fd]]
        try:
            return sock.recv(1, _PEEK) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def wait(self, ticket: Ticket, bell: Doorbell, what: str) -> None:
        """Block until ``ticket`` is done.

        Raises:
            PeerLostError: a peer died or aborted while the op ran (names it).
            TransportError: the engine reported the op failed (its message).
            HoraTimeoutError: the op did not complete within the timeout.
        """
        with self._lock:
            poller = self._poll(bell)
            deadline = time.monotonic() + self._timeout
            while not ticket.done:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HoraTimeoutError(
                        f"rank {self._transport.rank}: the {self._plane} data plane's {what} did "
                        f"not complete within {self._timeout:g} s; a peer may be stuck, much "
                        "slower, or waiting in a different collective. HINT: raise "
                        "HORA_TIMEOUT_SECONDS (hora run --timeout-seconds) if this is expected.")
                lost = None
                for fd, _ in poller.poll(min(left, 1.0) * 1000):
                    if fd == self._bell_fd:
                        bell.drain()
                    elif fd in self._by_fd and self._closed(fd):
                        lost = self._by_fd[fd]
                    elif fd in self._by_fd:  # bytes nobody sent on purpose: stop watching it
                        poller.unregister(fd)
                if lost is not None and not self._finishes(ticket, bell):
                    self._raise_lost(lost, what)
        if ticket.error is not None:
            peer = self.lost()  # the engine's error is often a peer's death: name the rank
            if peer is None:
                time.sleep(0.05)  # the kernel may close the dead peer's sockets a bit later
                peer = self.lost()
            if peer is not None:
                self._raise_lost(peer, what)
            raise TransportError(f"rank {self._transport.rank}: the {self._plane} data plane's "
                                 f"{what} failed: {ticket.error}")

    @staticmethod
    def _finishes(ticket: Ticket, bell: Doorbell) -> bool:
        """Whether the op completes within :data:`LOST_GRACE_S` anyway: a peer whose op
        completed may exit (closing its connections) before ours has seen the last bytes."""
        end = time.monotonic() + LOST_GRACE_S
        while not ticket.done and time.monotonic() < end:
            select.select([bell], [], [], max(0.0, end - time.monotonic()))
            bell.drain()
        return ticket.done

    def _raise_lost(self, peer: int, what: str) -> None:
        raise PeerLostError(
            f"{self._transport.describe(peer)} closed its connection while rank "
            f"{self._transport.rank} was waiting for the {self._plane} data plane's {what}: "
            f"{LOST_HINT}", peer=peer)


_PEEK = socket.MSG_PEEK | socket.MSG_DONTWAIT


def reduce_name(op: int) -> str:
    """hora's ReduceOp value (Horovod's numbering) as a plane's op name; '' for Adasum."""
    return {0: "sum", 1: "sum", 3: "min", 4: "max", 5: "product"}.get(int(op), "")


__all__ = ["Doorbell", "ExternalPlane", "PeerWatch", "Ticket", "reduce_name"]
