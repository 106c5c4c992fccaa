"""Barrier: no rank leaves until every rank has arrived (dissemination algorithm).

In round ``k`` (distance ``d = 2**k``) each rank sends one byte to ``rank + d`` and receives one
from ``rank - d``. After ``ceil(log2 size)`` rounds every rank has heard, directly or
transitively, from every other, so none can leave before all have entered. Unlike a tree
barrier there is no root, and every round is a single ``sendrecv``.
"""

from __future__ import annotations

import numpy as np

from hora.collectives.comm import Comm


def barrier(comm: Comm) -> None:
    """Block until every rank of ``comm`` has called :func:`barrier`.

    Every rank of ``comm`` must call this in the same order relative to other collectives.
    Moves one byte per round, ``ceil(log2 size)`` rounds; returns at once when ``size == 1``.

    Raises:
        PeerLostError, HoraTimeoutError: from the transport, naming the peer.
    """
    size, rank = comm.size, comm.rank
    token = np.zeros(1, dtype=np.uint8)
    received = np.empty(1, dtype=np.uint8)
    distance = 1
    while distance < size:
        comm.sendrecv((rank + distance) % size, token, (rank - distance) % size, received)
        distance <<= 1
