"""Binding each rank ``hora run`` starts to its own share of its host's cores (``--cpu-binding``,
hora-only; ``HORA_CPU_BINDING``).

With ``auto`` (the default) local rank ``i`` of ``n`` runs on the ``i``-th of ``n`` contiguous,
near-equal parts of the cores the launcher (on another host: hora's agent there) may use, when
there are at least as many cores as local ranks. Why: the frameworks size their thread pools
to the mask they start with (torch, TensorFlow and XLA read it), so ranks stop taking each other's
cores, and a rank's threads and caches stay on its cores (measured: docs/benchmarks.md, "CPU
binding"). ``mpirun`` binds to cores by default for the same reasons; horovodrun passes
``--bind-to none``, which hora's ``--binding-args`` keeps for its mpirun launch.

Ranks on other hosts are bound the same way by hora's agent there (:mod:`hora.runner.remote`),
with that host's cores: this module is standard-library only, and :mod:`hora.runner.ssh` ships its
source with the agent's.

An elastic worker's place is its slot on its host instead (slot ``i`` of the ``n`` that discovery
lists there): its rank changes from one generation to the next, its slot does not
(:class:`hora.runner.elastic.members.Places`).

Not bound: a single local rank (it has every core anyway), more local ranks than cores, a job
that sets ``HOROVOD_THREAD_AFFINITY`` (its cores are the user's choice), an elastic worker
started while its host's slot count differs from the one its live workers were bound by, and
ranks that ``mpirun`` starts.

The mask is set in the child between fork and exec (``preexec_fn``), before the program starts a
thread; every thread and process it starts inherits it. The rank gets
:data:`~hora._util.cpus.BOUND_VAR` naming its cores.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

BOUND_VAR = "HORA_BOUND_CPUS"
"""The variable naming a bound rank's cores (:data:`hora._util.cpus.BOUND_VAR`, which the ranks
read; spelled out here too because this module runs where hora is not installed)."""

Preexec = Callable[[], None]


def share(cores: Sequence[int], local_rank: int, local_size: int) -> tuple[int, ...] | None:
    """Local rank ``local_rank``'s part of ``cores`` (sorted, split into ``local_size``
    contiguous parts whose sizes differ by at most one), or None when there is nothing to bind:
    one local rank, or fewer cores than local ranks."""
    if local_size < 2 or len(cores) < local_size or not 0 <= local_rank < local_size:
        return None
    ordered = sorted(cores)
    base, extra = divmod(len(ordered), local_size)
    start = local_rank * base + min(local_rank, extra)
    return tuple(ordered[start:start + base + (1 if local_rank < extra else 0)])


def wanted(mode: str, thread_affinity: str) -> bool:
    """Whether ranks are bound under ``--cpu-binding`` ``mode``: ``auto``, and no
    ``HOROVOD_THREAD_AFFINITY`` (``thread_affinity``) placing hora's threads instead."""
    return mode == "auto" and not thread_affinity.strip()


def cores_for(mode: str, thread_affinity: str, local_rank: int,
              local_size: int) -> tuple[int, ...] | None:
    """The cores to bind a rank to on this host under ``--cpu-binding`` ``mode``, or None."""
    if not wanted(mode, thread_affinity) or not hasattr(os, "sched_setaffinity"):
        return None
    return share(list(os.sched_getaffinity(0)), local_rank, local_size)


def cpu_list(cores: Sequence[int]) -> str:
    """``cores`` as a CPU list: ``0-3,8``."""
    out: list[list[int]] = []
    for c in sorted(cores):
        if out and out[-1][1] == c - 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def bound_environment(cores: Sequence[int] | None) -> dict[str, str]:
    """What a bound rank gets in its environment (nothing when it is not bound)."""
    return {BOUND_VAR: cpu_list(cores)} if cores else {}


def with_binding(cores: Sequence[int] | None, then: Preexec | None) -> Preexec | None:
    """A ``preexec_fn`` that binds the child to ``cores`` and then runs ``then`` (``then``
    alone when ``cores`` is None). It runs between fork and exec: one system call, no lock."""
    if not cores:
        return then
    mask = frozenset(cores)

    def preexec() -> None:
        try:
            os.sched_setaffinity(0, mask)
        except OSError:  # a core went offline since: the rank runs unbound
            pass
        if then is not None:
            then()

    return preexec


__all__ = ["BOUND_VAR", "bound_environment", "cores_for", "cpu_list", "share", "wanted",
           "with_binding"]
