"""How many CPU cores this process may run on: the one answer to "does every rank get a core?"."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """Cores in this process's affinity mask (``os.cpu_count()`` where there is none; >= 1)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


__all__ = ["usable_cpus"]
