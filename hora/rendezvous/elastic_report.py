"""A survivor's report of the peers its failed generation lost (elastic mode).

Rendezvous layer, beside :mod:`hora.rendezvous.elastic` (the membership protocol): when a
collective of generation ``g`` fails, each survivor posts, before it says it is ready, the ranks
of ``g`` its error names (``rank 1 (host a) sent nothing for 30 s, not even a heartbeat``) under
``lost.<worker id>`` in :data:`~hora.rendezvous.elastic.SCOPE`. The driver maps those ranks to
the workers of ``g``: a worker that its peers name and that does not say it is ready itself
(hung: SIGSTOP, a debugger, a dead host) is dropped instead of waited for.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_NAMED = re.compile(r"\brank (\d+) \(host ")
"""How the transports name a peer in their errors (``describe_peer``: ``rank 3 (host a)``)."""


@dataclass(frozen=True)
class LostReport:
    """What one survivor of generation ``generation`` says it lost."""

    generation: int
    ranks: tuple[int, ...]
    error: str  # the first line of the survivor's error, for the driver's message


def lost_key(worker_id: int) -> str:
    return f"lost.{worker_id}"


def named_ranks(text: str, own_rank: int | None = None) -> tuple[int, ...]:
    """The peers an error text names (``rank N (host H)``), without ``own_rank``, in order."""
    found: list[int] = []
    for match in _NAMED.finditer(text):
        rank = int(match.group(1))
        if rank != own_rank and rank not in found:
            found.append(rank)
    return tuple(found)


def encode_report(report: LostReport) -> bytes:
    return json.dumps({"generation": report.generation, "ranks": list(report.ranks),
                       "error": report.error}).encode()


def decode_report(raw: bytes) -> LostReport | None:
    """The report, or None when ``raw`` is not one (never raises)."""
    try:
        data = json.loads(raw.decode())
        return LostReport(int(data["generation"]), tuple(int(r) for r in data["ranks"]),
                          str(data["error"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


__all__ = ["LostReport", "decode_report", "encode_report", "lost_key", "named_ranks"]
