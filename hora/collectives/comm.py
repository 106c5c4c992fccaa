"""The interfaces every collective algorithm is written against: :class:`Comm` (point-to-point
bytes, any transport) and :class:`Fabric` (shared segments and signals of one host).

A :class:`Comm` is a group of ``size`` ranks numbered ``0..size-1`` that can exchange raw bytes.
Messages between a pair of ranks arrive in the order they were sent (a FIFO byte stream per
ordered pair); there is no framing or tagging, so both sides must agree on every message's size.
Every call has a deadline (the transport's timeout) and raises
:class:`~hora.errors.PeerLostError` / :class:`~hora.errors.HoraTimeoutError` naming the peer
instead of blocking forever.

Buffers are any C-contiguous object with the buffer protocol (numpy arrays, memoryviews,
bytearrays); implementations move ``memoryview(buf).cast("B")`` bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

Buffer = Any  # a C-contiguous object supporting the buffer protocol


@runtime_checkable
class Comm(Protocol):
    """Point-to-point byte exchange among ``size`` ranks."""

    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        ...

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        ...

    def send(self, peer: int, buf: Buffer) -> None:
        """Send all bytes of ``buf`` to ``peer``; returns when ``buf`` may be reused.

        May block until the peer receives (do not rely on buffering): algorithms must order
        their sends and receives so that no cycle of blocked sends can form.
        """
        ...

    def recv_into(self, peer: int, buf: Buffer) -> None:
        """Receive exactly ``len(bytes(buf))`` bytes from ``peer`` into ``buf``."""
        ...

    def sendrecv(self, send_peer: int, send_buf: Buffer, recv_peer: int, recv_buf: Buffer) -> None:
        """Send ``send_buf`` to ``send_peer`` while receiving ``recv_buf`` from ``recv_peer``.

        The two transfers overlap (a ring step is not two serial transfers), and the call cannot
        deadlock when every rank of a ring calls it at once.
        """
        ...

    def describe(self, peer: int) -> str:
        """Human-readable identity of ``peer`` for error messages, e.g. ``rank 3 (host a)``."""
        ...


class SubComm:
    """A :class:`Comm` over a subset of a parent's ranks (a process set).

    ``ranks`` are parent ranks, sorted; sub-rank ``i`` is parent rank ``ranks[i]``.
    """

    def __init__(self, parent: Comm, ranks: Sequence[int]) -> None:
        self._parent = parent
        self._ranks = list(ranks)
        if parent.rank not in self._ranks:
            raise ValueError(f"rank {parent.rank} is not a member of {self._ranks}")
        self._rank = self._ranks.index(parent.rank)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self._ranks)

    @property
    def ranks(self) -> list[int]:
        """Parent ranks of the members, in sub-rank order."""
        return list(self._ranks)

    def send(self, peer: int, buf: Buffer) -> None:
        self._parent.send(self._ranks[peer], buf)

    def recv_into(self, peer: int, buf: Buffer) -> None:
        self._parent.recv_into(self._ranks[peer], buf)

    def sendrecv(self, send_peer: int, send_buf: Buffer, recv_peer: int, recv_buf: Buffer) -> None:
        self._parent.sendrecv(self._ranks[send_peer], send_buf, self._ranks[recv_peer], recv_buf)

    def describe(self, peer: int) -> str:
        return self._parent.describe(self._ranks[peer])


U8 = npt.NDArray[np.uint8]
"""A byte buffer (shared-memory segments are handed out as these)."""


class Fabric(Protocol):
    """Segments and signals of a same-host group (:class:`hora.transports.shm_fabric.ShmFabric`).

    Every rank owns data segments ``0`` and ``1``; signals are counted per rank over the group's
    lifetime. Waits raise :class:`~hora.errors.HoraTimeoutError` after the fabric's timeout and
    :class:`~hora.errors.PeerLostError` when the peer died or closed, naming it.
    """

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def describe(self, peer: int) -> str: ...

    def reserve(self, parity: int, nbytes: int) -> U8:
        """This rank's segment ``parity``, grown to at least ``nbytes`` (published to peers)."""
        ...

    def own(self, parity: int) -> U8: ...

    def peer(self, peer: int, parity: int, nbytes: int) -> U8:
        """``peer``'s segment ``parity`` (at least ``nbytes``); only after its signal."""
        ...

    @property
    def posted(self) -> int: ...

    def post(self) -> int:
        """Signal every peer; returns this rank's signal count."""
        ...

    def wait_all(self, target: int, spins: int = 0) -> None:
        """Wait until every peer has posted ``target`` signals; ``spins``: check at least this
        many times before sleeping where every rank has a core (a wait expected to be long)."""
        ...

    @property
    def spin_checks(self) -> int:
        """How many times a wait checks its word before it sleeps."""
        ...

    def board(self, peer: int) -> memoryview:
        """``peer``'s board: shared uint32 words for protocols above (the fast lane's)."""
        ...

    def board_address(self, peer: int, word: int) -> int:
        """Address of word ``word`` of ``peer``'s board (for futex waits and wakes)."""
        ...

    def close(self) -> None: ...
