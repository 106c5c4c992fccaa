"""Rank topology from host identities: local and cross ranks, Horovod's definitions.

One implementation, used by the launcher (slot assignment) and by workers started without it
(mpirun, Slurm, torchrun) to compute the same topology ``hora run`` would export.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """Where one rank sits: its host and its local/cross coordinates."""

    rank: int
    size: int
    hostname: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def compute_topology(hostnames: Sequence[str]) -> list[Slot]:
    """Slots for ranks ``0..n-1`` where rank ``i`` runs on ``hostnames[i]``.

    ``local_rank`` is the index of the rank among ranks on its host (in rank order);
    ``cross_rank`` is the index of its host among hosts that have a rank with the same
    ``local_rank`` (hosts ordered by their first rank); ``cross_size`` the number of such hosts.
    """
    size = len(hostnames)
    host_order: list[str] = []
    per_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hostnames):
        if host not in per_host:
            per_host[host] = []
            host_order.append(host)
        per_host[host].append(rank)
    local_rank = {r: ranks.index(r) for ranks in per_host.values() for r in ranks}
    slots = []
    for rank, host in enumerate(hostnames):
        lr = local_rank[rank]
        peers = [h for h in host_order if len(per_host[h]) > lr]
        slots.append(Slot(rank=rank, size=size, hostname=host, local_rank=lr,
                          local_size=len(per_host[host]), cross_rank=peers.index(host),
                          cross_size=len(peers)))
    return slots


def identity_environment(slot: Slot) -> dict[str, str]:
    """``HOROVOD_RANK`` ... ``HOROVOD_HOSTNAME`` exactly as horovodrun's gloo mode sets them for
    a rank in ``slot``, and the same values as ``HORA_*``."""
    values = {"RANK": slot.rank, "SIZE": slot.size, "LOCAL_RANK": slot.local_rank,
              "LOCAL_SIZE": slot.local_size, "CROSS_RANK": slot.cross_rank,
              "CROSS_SIZE": slot.cross_size, "HOSTNAME": slot.hostname}
    return {f"{prefix}_{name}": str(value) for prefix in ("HOROVOD", "HORA")
            for name, value in values.items()}

