"""In-process transport: ``n`` ranks as ``n`` threads of one process, for tests and ``size == 1``.

:func:`make_world` builds ``n`` connected :class:`LoopbackTransport` objects sharing one
in-memory world:

* **data plane** (:meth:`LoopbackTransport.comm`): a FIFO byte stream per ordered pair of ranks.
  ``send`` copies the bytes into the stream and never blocks; ``recv_into`` waits (at most the
  world's timeout without progress) until enough bytes have arrived;
* **control plane**: a mailbox per rank holding ``(sender, payload)`` messages, restricted to
  the rank-0 star like every transport's.

Closing a transport (:meth:`LoopbackTransport.close`) is how a rank "dies": peers that wait for
its data, or read their control mailbox past the messages it sent before closing, get
:class:`~hora.errors.PeerLostError` naming it. Bytes it sent before closing can still be read.

:func:`run_world` runs a function on every rank in its own thread and returns the per-rank
results; it is the ``fake_world`` that algorithm and engine tests are built on.

Correctness and clear errors matter more than speed here; every wait has a deadline.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np

from hora._util.log import get_logger
from hora._util.typing_compat import override
from hora.collectives.comm import Buffer
from hora.errors import HoraTimeoutError, PeerLostError, TransportError
from hora.transports.base import MAX_CONTROL_MESSAGE, Transport

log = get_logger(__name__)

HOST = "loopback"
"""Host name every loopback rank reports."""

T = TypeVar("T")

def _byte_view(buf: Buffer, writable: bool) -> memoryview:
    """A flat unsigned-byte memoryview of a C-contiguous buffer (numpy arrays of any dtype)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("loopback transport needs C-contiguous buffers")
        view = buf.reshape(-1).view(np.uint8).data
    else:
        view = memoryview(buf)
        if not view.c_contiguous:
            raise ValueError("loopback transport needs C-contiguous buffers")
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
    if writable and view.readonly:
        raise ValueError("cannot receive into a read-only buffer")
    return view


class _Pipe:
    """Bytes in flight from one rank to another: a FIFO of immutable chunks."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.chunks: deque[bytes] = deque()
        self.head = 0  # bytes of chunks[0] already consumed
        self.pending = 0  # unread bytes in total


class _Mailbox:
    """One rank's control-plane inbox; a None payload marks the sender's close."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.messages: deque[tuple[int, bytes | None]] = deque()
        self.woken = False


class _World:
    """State shared by the transports of one :func:`make_world` call."""

    def __init__(self, size: int, timeout: float) -> None:
        self.size = size
        self.timeout = timeout
        self.pipes = {(src, dst): _Pipe() for src in range(size) for dst in range(size)}
        self.mailboxes = [_Mailbox() for _ in range(size)]
        self.closed = [False] * size
        self.lock = threading.Lock()


class LoopbackComm:
    """The data plane of one loopback rank (a :class:`~hora.collectives.comm.Comm`)."""

    def __init__(self, transport: LoopbackTransport) -> None:
        self._transport = transport
        self._world = transport._world
        self._rank = transport.rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._world.size

    def describe(self, peer: int) -> str:
        return self._transport.describe(peer)

    def send(self, peer: int, buf: Buffer) -> None:
        """Append ``buf``'s bytes to the stream to ``peer``; never blocks.

        Raises:
            PeerLostError: ``peer`` has closed its transport.
            TransportError: this rank's transport is closed.
            ValueError: ``peer`` out of range or ``buf`` not contiguous.
        """
        self._transport._check_peer(peer)
        data = bytes(_byte_view(buf, writable=False))
        self._transport._check_open()
        if self._world.closed[peer]:
            raise PeerLostError(
                f"rank {self._rank}: cannot send to {self.describe(peer)}: it closed its "
                "connection; HINT: look at that rank's output for the original error",
                peer=peer,
            )
        if not data:
            return
        pipe = self._world.pipes[(self._rank, peer)]
        with pipe.cond:
            pipe.chunks.append(data)
            pipe.pending += len(data)
            pipe.cond.notify_all()

    def recv_into(self, peer: int, buf: Buffer) -> None:
        """Fill ``buf`` with the next bytes from ``peer``.

        Raises:
            HoraTimeoutError: no byte arrived for the world's timeout (names the peer).
            PeerLostError: ``peer`` closed before sending enough bytes (names the peer).
            TransportError: this rank's transport is closed.
            ValueError: ``peer`` out of range or ``buf`` not contiguous / read-only.
        """
        self._transport._check_peer(peer)
        view = _byte_view(buf, writable=True)
        want, got = view.nbytes, 0
        pipe = self._world.pipes[(peer, self._rank)]
        timeout = self._world.timeout
        deadline = time.monotonic() + timeout
        with pipe.cond:
            while got < want:
                self._transport._check_open()
                if pipe.chunks:
                    chunk = pipe.chunks[0]
                    take = min(want - got, len(chunk) - pipe.head)
                    view[got:got + take] = memoryview(chunk)[pipe.head:pipe.head + take]
                    got += take
                    pipe.pending -= take
                    pipe.head += take
                    if pipe.head == len(chunk):
                        pipe.chunks.popleft()
                        pipe.head = 0
                    deadline = time.monotonic() + timeout
                    continue
                if self._world.closed[peer]:
                    raise PeerLostError(
                        f"rank {self._rank}: {self.describe(peer)} closed its connection while "
                        f"rank {self._rank} waited for {want - got} more bytes from it; HINT: "
                        "look at that rank's output for the original error",
                        peer=peer,
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise HoraTimeoutError(
                        f"rank {self._rank}: timed out after {timeout:g} s waiting for data from "
                        f"{self.describe(peer)} ({got} of {want} bytes received); HINT: that "
                        "rank may be stuck, or the ranks called different collectives or "
                        "sizes (every rank must call the same collectives in the same order)"
                    )
                pipe.cond.wait(remaining)

    def sendrecv(self, send_peer: int, send_buf: Buffer, recv_peer: int,
                 recv_buf: Buffer) -> None:
        """Send then receive; sends never block here, so this cannot deadlock."""
        self.send(send_peer, send_buf)
        self.recv_into(recv_peer, recv_buf)


class LoopbackTransport(Transport):
    """One rank of an in-process world built by :func:`make_world`."""

    name = "loopback"

    def __init__(self, world: _World, rank: int) -> None:
        self._world = world
        self._rank = rank
        self._comm = LoopbackComm(self)

    def __repr__(self) -> str:
        state = "closed" if self._world.closed[self._rank] else "open"
        return f"LoopbackTransport(rank={self._rank}, size={self._world.size}, {state})"

    @property
    @override
    def rank(self) -> int:
        return self._rank

    @property
    @override
    def size(self) -> int:
        return self._world.size

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called on this rank."""
        return self._world.closed[self._rank]

    @override
    def comm(self) -> LoopbackComm:
        return self._comm

    @override
    def describe(self, peer: int) -> str:
        return f"rank {peer} (host {HOST})"

    @override
    def send_control(self, peer: int, payload: bytes) -> None:
        """Queue ``payload`` in ``peer``'s mailbox.

        Raises:
            ValueError: not between rank 0 and another rank, ``peer`` out of range, or the
                payload exceeds :data:`~hora.transports.base.MAX_CONTROL_MESSAGE`.
            PeerLostError: ``peer`` has closed its transport.
            TransportError: this rank's transport is closed.
        """
        self._check_peer(peer)
        if (self._rank == 0) == (peer == 0):
            raise ValueError(
                f"control messages go between rank 0 and the other ranks only; rank "
                f"{self._rank} cannot send one to rank {peer}"
            )
        if len(payload) > MAX_CONTROL_MESSAGE:
            raise ValueError(
                f"control message of {len(payload)} bytes exceeds MAX_CONTROL_MESSAGE "
                f"({MAX_CONTROL_MESSAGE} bytes)"
            )
        data = bytes(payload)
        self._check_open()
        if self._world.closed[peer]:
            raise PeerLostError(
                f"rank {self._rank}: cannot send a control message to {self.describe(peer)}: "
                "it closed its connection",
                peer=peer,
            )
        box = self._world.mailboxes[peer]
        with box.cond:
            box.messages.append((self._rank, data))
            box.cond.notify_all()

    @override
    def recv_control(self, timeout: float | None) -> tuple[int, bytes] | None:
        """Next ``(sender, payload)`` from the mailbox, in arrival order.

        Queued messages come first; then a pending :meth:`wake` (several wakes collapse into
        one) or this transport's own close makes the call return None; otherwise it waits up to
        ``timeout`` seconds (None: indefinitely) and returns None when nothing arrived.

        Raises:
            PeerLostError: the next queued item is a peer's close, i.e. the peer closed after
                sending the messages before it (``.peer`` is its rank). Raised once per closed
                peer; later calls go on with what other peers sent.
        """
        box = self._world.mailboxes[self._rank]
        deadline = None if timeout is None else time.monotonic() + timeout
        with box.cond:
            while True:
                if box.messages:
                    sender, payload = box.messages.popleft()
                    if payload is None:
                        raise PeerLostError(
                            f"rank {self._rank}: {self.describe(sender)} closed its control "
                            "connection",
                            peer=sender,
                        )
                    return sender, payload
                if box.woken or self.closed:
                    box.woken = False
                    return None
                if deadline is None:
                    box.cond.wait()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                box.cond.wait(remaining)

    @override
    def wake(self) -> None:
        box = self._world.mailboxes[self._rank]
        with box.cond:
            box.woken = True
            box.cond.notify_all()

    @override
    def close(self) -> None:
        """Mark this rank closed and wake everyone who might be waiting on it. Idempotent."""
        world, me = self._world, self._rank
        with world.lock:
            if world.closed[me]:
                return
            world.closed[me] = True
        for (src, dst), pipe in world.pipes.items():
            if me in (src, dst):
                with pipe.cond:
                    pipe.cond.notify_all()
        control_peers = range(1, world.size) if me == 0 else [0]
        for peer in control_peers:
            box = world.mailboxes[peer]
            with box.cond:
                box.messages.append((me, None))
                box.cond.notify_all()
        own = world.mailboxes[me]
        with own.cond:
            own.cond.notify_all()

    def pending_data(self) -> dict[int, int]:
        """Unread data-plane bytes waiting for this rank, by sender (empty when drained)."""
        pending = {}
        for src in range(self._world.size):
            pipe = self._world.pipes[(src, self._rank)]
            with pipe.cond:
                if pipe.pending:
                    pending[src] = pipe.pending
        return pending

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self._world.size:
            raise ValueError(f"peer {peer} is not a rank of a world of {self._world.size}")

    def _check_open(self) -> None:
        if self._world.closed[self._rank]:
            raise TransportError(f"rank {self._rank}: the loopback transport is closed")


def make_world(n: int, timeout: float = 10.0) -> list[LoopbackTransport]:
    """``n`` connected loopback transports; element ``i`` is rank ``i``.

    Args:
        n: number of ranks (at least 1).
        timeout: seconds a data-plane receive may wait without progress before raising
            :class:`~hora.errors.HoraTimeoutError`.

    Raises:
        ValueError: ``n < 1`` or ``timeout <= 0``.
    """
    if n < 1:
        raise ValueError(f"a loopback world needs at least one rank, got {n}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    world = _World(n, timeout)
    return [LoopbackTransport(world, rank) for rank in range(n)]


def run_world(n: int, fn: Callable[[LoopbackTransport], T], *, timeout: float = 10.0,
              join_timeout: float = 60.0, check_drained: bool = True) -> list[T]:
    """Run ``fn(transport)`` for every rank of a fresh world, each in its own thread.

    A rank whose ``fn`` raises closes its transport at once, so peers waiting on it fail fast
    with :class:`~hora.errors.PeerLostError` instead of timing out. Every transport is closed
    before returning.

    Args:
        n: number of ranks.
        fn: the per-rank body; gets its :class:`LoopbackTransport`.
        timeout: the data-plane timeout (see :func:`make_world`).
        join_timeout: hard limit in seconds for the whole run; ranks still running then are
            reported and their transports closed (which wakes any blocked transport call).
        check_drained: after a successful run, fail if any data-plane bytes were never read
            (a collective whose ranks disagreed on sizes).

    Returns:
        ``fn``'s results in rank order.

    Raises:
        BaseException: the first exception any rank raised (in time order), re-raised with a
            note naming the rank where Python supports notes.
        HoraTimeoutError: some ranks did not finish within ``join_timeout``.
        AssertionError: ``check_drained`` found unread bytes.
    """
    transports = make_world(n, timeout)
    results: list[Any] = [None] * n
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def body(rank: int) -> None:
        try:
            results[rank] = fn(transports[rank])
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            with lock:
                errors.append((rank, exc))
            transports[rank].close()

    stuck: list[int] = []
    real_errors = -1  # errors raised before a forced close (-1: no forced close)
    threads = [threading.Thread(target=body, args=(rank,), name=f"loopback-rank-{rank}",
                                daemon=True) for rank in range(n)]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + join_timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
        if stuck:
            with lock:  # errors raised by the forced close below are consequences, not causes
                real_errors = len(errors)
            for transport in transports:
                transport.close()
            for thread in threads:
                thread.join(1.0)
    finally:
        for transport in transports:
            transport.close()
    if real_errors >= 0:
        del errors[real_errors:]
    if errors:
        rank, exc = errors[0]
        for other_rank, other in errors[1:]:
            log.debug("loopback world: rank %d also raised %r", other_rank, other)
        if hasattr(exc, "add_note"):
            stuck_note = f"; ranks {stuck} were still running" if stuck else ""
            exc.add_note(f"(raised on rank {rank} of a loopback world of {n}; "
                         f"{len(errors)} rank(s) raised{stuck_note})")
        raise exc
    if stuck:
        raise HoraTimeoutError(
            f"loopback world of {n}: ranks {stuck} did not finish within {join_timeout:g} s"
        )
    if check_drained:
        leftovers = {t.rank: t.pending_data() for t in transports if t.pending_data()}
        if leftovers:
            raise AssertionError(
                f"unread data-plane bytes after the run (receiver: {{sender: bytes}}): "
                f"{leftovers}; the ranks disagreed on message sizes"
            )
    return cast("list[T]", results)
