"""How many CPU cores this process may run on: the one answer to "does every rank get a core?"."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """Cores in this process's affinity mask (``os.cpu_count()`` where there is none; >= 1)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


BOUND_VAR = "HORA_BOUND_CPUS"
"""Set by ``hora run`` for each rank it bound to a share of its host's cores (``--cpu-binding``):
the cores, as a list like ``0-3,8``."""


def cores_per_rank(local_size: int) -> float:
    """The cores one of ``local_size`` ranks on this host has to itself: its own mask when
    ``hora run`` bound it to its share (:data:`BOUND_VAR`), else the mask shared by all of
    them, divided among them."""
    usable = usable_cpus()
    if os.environ.get(BOUND_VAR):
        return float(usable)
    return usable / max(1, local_size)


AFFINITY_BYTES = 128
"""Bytes of an :func:`affinity_record` (CPUs 0-1023; higher ones count as CPU 1023)."""


def affinity_record() -> bytes:
    """This process's CPU mask as :data:`AFFINITY_BYTES` bytes (bit ``c``: CPU ``c``), for
    processes to exchange; all ones where the mask cannot be read (every CPU)."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return b"\xff" * AFFINITY_BYTES
    mask = 0
    for cpu in cpus:
        mask |= 1 << min(cpu, 8 * AFFINITY_BYTES - 1)
    return mask.to_bytes(AFFINITY_BYTES, "little")


def union_cores(records: list[bytes]) -> int:
    """Cores in the union of several processes' :func:`affinity_record` masks (at least 1):
    what they may run on together. A launcher that binds each rank to a core of its own
    (``mpirun``) leaves every process one core, and the group as many as it has ranks."""
    union = 0
    for record in records:
        union |= int.from_bytes(record, "little")
    return max(1, bin(union).count("1"))


__all__ = ["AFFINITY_BYTES", "BOUND_VAR", "affinity_record", "cores_per_rank", "union_cores",
           "usable_cpus"]
