"""``HOROVOD_THREAD_AFFINITY``: pin the engine's background threads to one CPU core per rank.

Horovod pins its background thread to ``cores[local_rank]`` of the comma list. hora's
background work runs on the engine thread and on the fast-lane threads the engine thread
starts (:mod:`hora.core.lane.fastlane`); the engine pins its own thread first thing, so the lane
threads inherit the core (Linux threads start with their creator's affinity). User threads, and
the transport's connection threads started before the engine, are left alone.

:func:`core_for` validates the list against the job's topology at ``init()`` (before the engine
starts), so a bad list is one :class:`~hora.errors.ConfigError` naming the knob, not a failure
inside a thread.
"""

from __future__ import annotations

import os
import threading

from hora.errors import ConfigError

KNOB_VARS = "HORA_THREAD_AFFINITY / HOROVOD_THREAD_AFFINITY"


def core_for(spec: str, local_rank: int, local_size: int) -> int | None:
    """The core ``local_rank`` pins its background threads to, or None (``spec`` empty).

    Args:
        spec: the knob's value: a comma list of core numbers, one per local rank.
        local_rank: this rank's index on its host.
        local_size: ranks on this host.

    Raises:
        ConfigError: the list is shorter than ``local_size``, the platform cannot pin threads,
            or the core is not one this process may run on.
    """
    if not spec.strip():
        return None
    cores = [int(item) for item in spec.split(",")]
    if len(cores) < local_size:
        raise ConfigError(
            f"{KNOB_VARS}={spec!r} lists {len(cores)} core(s) for the {local_size} ranks on "
            f"this host: give one core per local rank, e.g. "
            f"'{','.join(str(i) for i in range(local_size))}' (local rank i is pinned to the "
            f"i-th core), or unset it.")
    core = cores[local_rank]
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError(f"{KNOB_VARS} needs Linux (os.sched_setaffinity), which this "
                          "platform does not have: unset it.")
    allowed = os.sched_getaffinity(0)
    if core not in allowed:
        raise ConfigError(
            f"{KNOB_VARS}={spec!r}: local rank {local_rank} would be pinned to core {core}, "
            f"which this process may not run on (allowed: {_ranges(allowed)}): pick cores "
            "from that set.")
    return core


def pin_current_thread(core: int) -> None:
    """Pin the calling thread (only it) to ``core``; threads it starts later inherit that."""
    os.sched_setaffinity(threading.get_native_id(), {core})


def thread_cores(native_id: int) -> set[int]:
    """The cores thread ``native_id`` of this process may run on."""
    return set(os.sched_getaffinity(native_id))


def _ranges(cores: set[int]) -> str:
    out: list[str] = []
    for c in sorted(cores):
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


__all__ = ["core_for", "pin_current_thread", "thread_cores"]
