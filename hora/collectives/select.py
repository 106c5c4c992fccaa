"""Algorithm choice: the one place that decides which collective algorithm runs.

Policy only (no communication). Every rank evaluates the same function on the same agreed
inputs (byte count, group size, configured knobs), so all ranks pick the same algorithm without
talking. Each decision is logged at debug level.

Cost model used below (``alpha`` = per-message latency, ``B`` = link bandwidth, ``n`` bytes,
``N`` ranks). On this class of machine a Python-level message costs ``alpha`` ~ 20-40 us (thread
handoffs plus a socket call) and a link moves ~1 GB/s, so ``alpha * B`` ~ 32 KiB: a message
"costs" about as much as moving 32 KiB more data.

* ring allreduce: ``2 (N-1) alpha + 2 (N-1)/N * n / B``
* recursive doubling: ``log2(N) (alpha + n / B)``
* binomial-tree broadcast: ``ceil(log2 N) (alpha + n / B)``
* pipelined chain broadcast in ``k`` chunks: ``(k + N - 2) (alpha + n / (k B))``
"""

from __future__ import annotations

import math

from hora._util.log import get_logger
from hora.errors import ConfigError

log = get_logger(__name__)

DEFAULT_SMALL_ALLREDUCE_BYTES = 64 * 1024
"""Default of the ``small_allreduce_bytes`` knob. Equating the ring and recursive-doubling costs
above gives a crossover of ``n* = (2(N-1) - log2 N) / (log2 N - 2(N-1)/N) * alpha * B``, about
8-9 ``alpha * B`` for N = 4..8, i.e. ~250 KiB with ``alpha * B`` ~ 32 KiB. Recursive doubling also
reduces (and, on half the ranks, copies) the full buffer every round, which the model ignores,
so the default is a conservative 64 KiB: the tensors where latency clearly dominates."""

ALLREDUCE_REQUESTS = ("auto", "ring", "star", "small")
"""Values :func:`select_allreduce` accepts; 'small' (recursive doubling) is for benchmarks."""

LATENCY_BYTES = 32 * 1024
"""``alpha * B``: bytes a link moves in the time one message's fixed overhead costs."""

PIPELINE_CHUNK_BYTES = 1024 * 1024
"""Chunk size of the chain broadcast: large enough that the per-message overhead (~32 KiB worth)
is a few percent, small enough that the pipeline fills quickly (``N - 2`` chunks of delay)."""


def select_allreduce(nbytes: int, size: int, requested: str,
                     small_bytes: int = DEFAULT_SMALL_ALLREDUCE_BYTES) -> str:
    """The allreduce algorithm to run: ``"ring"``, ``"star"`` or ``"small"``.

    Args:
        nbytes: size of the (fused) buffer in bytes; the same on every rank.
        size: number of ranks in the group.
        requested: the ``allreduce_algorithm`` knob: ``"auto"`` picks ``"small"`` (recursive
            doubling) for ``0 < nbytes <= small_bytes`` on more than one rank and ``"ring"``
            otherwise (``size == 1`` is a no-op, reported as ``"ring"``); ``"ring"``,
            ``"star"`` and ``"small"`` are returned as given.
        small_bytes: the ``small_allreduce_bytes`` knob (see
            :data:`DEFAULT_SMALL_ALLREDUCE_BYTES`).

    Returns:
        A name accepted by :func:`hora.collectives.allreduce.allreduce`.

    Raises:
        ConfigError: ``requested`` is not one of :data:`ALLREDUCE_REQUESTS`.
    """
    if requested not in ALLREDUCE_REQUESTS:
        raise ConfigError(
            f"unknown allreduce algorithm {requested!r}; choose one of "
            f"{', '.join(ALLREDUCE_REQUESTS)} (HORA_ALLREDUCE_ALGORITHM)"
        )
    if requested != "auto":
        choice = requested
    elif size > 1 and 0 < nbytes <= small_bytes:
        choice = "small"
    else:
        choice = "ring"
    log.debug("allreduce: %s for %d bytes on %d ranks", choice, nbytes, size)
    return choice


def select_broadcast(nbytes: int, size: int, chunk_bytes: int = PIPELINE_CHUNK_BYTES) -> str:
    """The broadcast algorithm to run: ``"tree"`` (binomial) or ``"chain"`` (pipelined).

    Compares the two costs in the module docstring with ``alpha * B`` = :data:`LATENCY_BYTES`.
    The tree sends the whole buffer ``ceil(log2 N)`` times in sequence, which is best for small
    buffers and few ranks; the chain streams ``chunk_bytes`` pieces along the ranks so its
    time tends to one buffer's transfer time whatever ``N`` is, which wins for large buffers.

    Args:
        nbytes: buffer size in bytes; the same on every rank.
        size: number of ranks in the group.
        chunk_bytes: the chain's chunk size.

    Returns:
        ``"tree"`` or ``"chain"``.
    """
    choice = "tree"
    if size > 2 and nbytes > chunk_bytes:
        chunks = math.ceil(nbytes / chunk_bytes)
        rounds = math.ceil(math.log2(size))
        tree_cost = rounds * (LATENCY_BYTES + nbytes)
        chain_cost = (chunks + size - 2) * (LATENCY_BYTES + nbytes / chunks)
        if chain_cost < tree_cost:
            choice = "chain"
    log.debug("broadcast: %s for %d bytes on %d ranks", choice, nbytes, size)
    return choice


# ---- same-host shared memory (hora.collectives.shm) ------------------------------------------

SHM_SMALL_ALLREDUCE_BYTES = 256 * 1024
"""Largest buffer the shared-memory allreduce handles with the ``replicated`` algorithm (one
signal round; every rank reduces every rank's copy) instead of ``chunked`` (two signals per
chunk; each rank reduces only its slice). The redundant reductions are in-cache work, cheaper
than the second signal round, which risks waiting for a peer that is not running; above this
size on more than 2 ranks the chunked algorithm's smaller memory traffic wins (the
measurements: docs/benchmarks.md, "Measurements behind the code's constants")."""

SHM_CHUNK_BYTES = 512 * 1024
"""Chunk of the ``chunked`` shared-memory allreduce for buffers over
:data:`SHM_ONE_CHUNK_BYTES` when every rank of the group can have a core. Each rank's working
set (a few chunks of its buffer and five chunk slots of segments) stays in the 2 MiB per-core
L2, so data crosses cores through the cache; each chunk's two signals (microseconds when both
ranks run) stay small next to its copy-and-reduce time. Smaller chunks pay more signals, larger
ones fall out of L2 (measured against 128 KiB-4 MiB: docs/benchmarks.md, "Measurements behind
the code's constants")."""

SHM_CHUNK_BYTES_OVERSUBSCRIBED = 1024 * 1024
"""The chunk when the group has more ranks than this process may use cores: every signal round
may then wait for a peer to be scheduled, so fewer, larger chunks (docs/benchmarks.md,
"Measurements behind the code's constants")."""

SHM_ONE_CHUNK_BYTES = 2 * 1024 * 1024
"""Buffers up to this size run the ``chunked`` algorithm as one chunk: two signal rounds in all
instead of two per :data:`SHM_CHUNK_BYTES`. A small buffer's copies are short next to the
Python and the signals of more chunks; from a few MiB on, chunks pipeline the ranks' phases and
bound each wait to a chunk's work, which matters most when a rank is a little behind or loses
its core for a moment (docs/benchmarks.md, "Measurements behind the code's constants")."""


def select_shm_allreduce(nbytes: int, size: int,
                         small_bytes: int = SHM_SMALL_ALLREDUCE_BYTES) -> str:
    """The shared-memory allreduce algorithm: ``"replicated"`` or ``"chunked"``.

    Args:
        nbytes: buffer size in bytes; the same on every rank.
        size: number of ranks in the (same-host) group.
        small_bytes: largest size for ``"replicated"`` (see :data:`SHM_SMALL_ALLREDUCE_BYTES`).

    Returns:
        A name accepted by :meth:`hora.collectives.shm.ShmGroup.allreduce`.
    """
    return "replicated" if nbytes <= shm_replicated_bytes(size, small_bytes) else "chunked"


def shm_replicated_bytes(size: int, small_bytes: int = SHM_SMALL_ALLREDUCE_BYTES) -> float:
    """The largest buffer :func:`select_shm_allreduce` gives ``"replicated"`` on a group of
    ``size`` ranks (every size when ``size == 1``): a group computes it once and compares each
    op's bytes with it (no call, no log line per op)."""
    return math.inf if size == 1 else small_bytes
