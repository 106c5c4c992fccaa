"""Where the workers of a :class:`~hora.ray.RayExecutor` run: the placement group, the actors,
and their ranks.

Launcher side (the driver process): imports Ray, base and rendezvous modules, never the engine.

* ``num_workers=N``: one bundle of ``{CPU: cpus_per_worker, GPU: gpus_per_worker}`` per worker,
  strategy ``PACK`` (as few nodes as possible), as Horovod's ``PGStrategy``; or, when the caller
  already runs inside a placement group and ``use_current_placement_group`` is true, that group
  (any bundle), as Horovod does.
* ``num_hosts=H, num_workers_per_host=W``: H bundles of W workers' resources, strategy
  ``STRICT_SPREAD`` (each bundle on its own node), W actors per bundle: Horovod's
  ``ColocatedStrategy``.

Ranks follow the nodes the actors landed on: the actors are grouped by Ray node id, nodes in
order of their first actor, so each node's ranks are contiguous; local and cross ranks come
from :func:`hora.rendezvous.topology.compute_topology` over those nodes, as ``hora run`` computes
them over hosts. The host identity of a rank (``HORA_HOSTNAME``) is its node's host name, or
``<host name>-<node id prefix>`` when several Ray nodes share a host name (e.g. the fake nodes of
``ray.cluster_utils.Cluster``): hora treats distinct identities as distinct hosts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from hora.ray.worker import BaseHorovodWorker, remove_segments
from hora.rendezvous.topology import Slot, compute_topology

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """How many workers, with which resources, placed how (validated by :func:`layout`)."""

    num_workers: int
    num_hosts: int | None
    workers_per_host: int
    cpus_per_worker: float
    gpus_per_worker: float
    use_current_placement_group: bool

    def bundles(self) -> tuple[list[dict[str, float]], str]:
        """The placement group's bundles and strategy for this layout."""
        per = self.workers_per_host if self.num_hosts else 1
        bundle = {k: v * per for k, v in (("CPU", self.cpus_per_worker),
                                          ("GPU", self.gpus_per_worker)) if v}
        if self.num_hosts:
            return [dict(bundle) for _ in range(self.num_hosts)], "STRICT_SPREAD"
        return [dict(bundle) for _ in range(self.num_workers)], "PACK"


def layout(num_workers: int | None, num_hosts: int | None, num_workers_per_host: int,
           cpus_per_worker: float, use_gpu: bool, gpus_per_worker: float | None,
           use_current_placement_group: bool) -> Layout:
    """Check the executor's arguments (Horovod's rules, clearer messages).

    Raises:
        ValueError: neither or both of ``num_workers`` / ``num_hosts``; a count < 1;
            ``gpus_per_worker`` without ``use_gpu``; negative resources; a worker asking for
            no resource at all.
    """
    if gpus_per_worker and not use_gpu:
        raise ValueError("gpus_per_worker is set, but use_gpu is False: pass use_gpu=True to "
                         "give the workers GPUs")
    if use_gpu and gpus_per_worker is not None and gpus_per_worker <= 0:
        raise ValueError(f"gpus_per_worker must be > 0 with use_gpu=True, not {gpus_per_worker}")
    if num_workers is not None and num_hosts is not None:
        raise ValueError("give num_workers=N (packed on as few nodes as possible) or "
                         "num_hosts=H with num_workers_per_host=W (W on each of H nodes), "
                         "not both")
    if num_workers is None and num_hosts is None:
        raise ValueError("RayExecutor needs num_workers=N, or num_hosts=H with "
                         "num_workers_per_host=W")
    for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                        ("num_workers_per_host", num_workers_per_host)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be an int >= 1, not {value!r}")
    if cpus_per_worker < 0:
        raise ValueError(f"cpus_per_worker must be >= 0, not {cpus_per_worker}")
    gpus = float(gpus_per_worker or 1) if use_gpu else 0.0
    if not cpus_per_worker and not gpus:
        raise ValueError("each worker must ask for some resource: cpus_per_worker >= 1 or "
                         "use_gpu=True (Ray cannot place an empty bundle)")
    total = num_workers if num_workers is not None else (num_hosts or 0) * num_workers_per_host
    return Layout(num_workers=total, num_hosts=num_hosts if num_workers is None else None,
                  workers_per_host=num_workers_per_host, cpus_per_worker=float(cpus_per_worker),
                  gpus_per_worker=gpus,
                  use_current_placement_group=use_current_placement_group)


@dataclass
class Workers:
    """Started actors, in rank order, and where they are.

    Attributes:
        group: the placement group the actors use.
        owned: whether this executor created ``group`` (and removes it at shutdown).
        actors: the actor handles; index ``r`` is rank ``r``.
        slots: each rank's topology (its ``hostname`` is the rank's host identity).
        info: each rank's :meth:`BaseHorovodWorker.placement` (node id, host name, ip, pid).
    """

    group: PlacementGroup | None
    owned: bool
    actors: list[Any]
    slots: list[Slot]
    info: list[dict[str, Any]]

    def describe(self, rank: int) -> str:
        """``pid 123 on node vm (10.0.0.5)``: where rank ``rank`` runs, for messages."""
        info = self.info[rank]
        return f"pid {info['pid']} on node {self.slots[rank].hostname} ({info['ip']})"


def _wait_group(group: PlacementGroup, timeout: float, bundles: list[dict[str, float]],
                strategy: str) -> None:
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    if ready:
        return
    remove_placement_group(group)
    raise TimeoutError(
        f"hora.ray: the placement group ({len(bundles)} x {bundles[0]}, {strategy}) was not "
        f"ready after {timeout:g} s: the cluster lacks the resources. Available now: "
        f"{ray.available_resources()}. HINT: ask for fewer workers or resources per worker, "
        "add nodes (or use an autoscaling cluster), or raise placement_group_timeout_s in "
        "RayExecutor.create_settings().")


def host_labels(info: list[dict[str, Any]]) -> list[str]:
    """Each actor's host identity: its node's host name, suffixed with the node id's first 8
    characters when that host name belongs to several Ray nodes."""
    nodes_of: dict[str, set[str]] = {}
    for item in info:
        nodes_of.setdefault(item["hostname"], set()).add(item["node_id"])
    return [item["hostname"] if len(nodes_of[item["hostname"]]) == 1
            else f"{item['hostname']}-{item['node_id'][:8]}" for item in info]


def rank_order(info: list[dict[str, Any]]) -> list[int]:
    """Actor indices in rank order: grouped by node, nodes in order of their first actor."""
    first: dict[str, int] = {}
    for i, item in enumerate(info):
        first.setdefault(item["node_id"], i)
    return sorted(range(len(info)), key=lambda i: (first[info[i]["node_id"]], i))


def start_workers(spec: Layout, *, placement_group_timeout: float, start_timeout: float,
                  ) -> Workers:
    """Reserve the resources, start one actor per worker, and rank them by node.

    Raises:
        TimeoutError: the placement group or the actors were not ready in time (nothing is
            left behind).
        RuntimeError: an actor could not start (e.g. hora is not importable on its node).
    """
    current = get_current_placement_group() if spec.use_current_placement_group else None
    if current is not None and spec.num_hosts is None:
        log.info("hora.ray: using the current placement group (pass "
                 "use_current_placement_group=False to create one)")
        group, owned, bundle_of = current, False, [-1] * spec.num_workers
    else:
        bundles, strategy = spec.bundles()
        group = placement_group(bundles, strategy=strategy)
        _wait_group(group, placement_group_timeout, bundles, strategy)
        owned = True
        per = spec.workers_per_host if spec.num_hosts else 1
        bundle_of = [i // per for i in range(spec.num_workers)]
    cls = ray.remote(BaseHorovodWorker)
    actors: list[Any] = [cls.options(
        num_cpus=spec.cpus_per_worker, num_gpus=spec.gpus_per_worker, max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=bundle_of[i],
            placement_group_capture_child_tasks=False),
    ).remote(world_rank=i, world_size=spec.num_workers) for i in range(spec.num_workers)]
    refs = [a.placement.remote() for a in actors]
    try:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=start_timeout)
        if len(ready) < len(refs):
            raise TimeoutError(
                f"hora.ray: {len(refs) - len(ready)} of {len(refs)} worker actors did not start "
                f"within {start_timeout:g} s. HINT: check `ray status` and the workers' logs; "
                "raise timeout_s in RayExecutor.create_settings() on a slow cluster.")
        try:
            info = ray.get(refs)
        except ray.exceptions.RayError as exc:
            raise RuntimeError(
                f"hora.ray: a worker actor could not start: {exc}. HINT: hora (and what your "
                "function imports) must be installed in the Python environment of every Ray "
                "node.") from exc
    except BaseException:
        stop(actors, group if owned else None)
        raise
    order = rank_order(info)
    actors, info = [actors[i] for i in order], [info[i] for i in order]
    slots = compute_topology(host_labels(info))
    log.info("hora.ray: %d workers on %d node(s): %s", len(actors),
             len({s.hostname for s in slots}),
             ", ".join(f"rank {s.rank} -> {s.hostname}" for s in slots))
    return Workers(group, owned, actors, slots, info)


def visible_devices(workers: Workers) -> dict[int, str]:
    """``CUDA_VISIBLE_DEVICES`` for each rank that has GPUs: every GPU of the ranks on its
    node, in local-rank order, so that ``torch.cuda.set_device(hvd.local_rank())`` picks the
    rank's own GPU and ranks on one node see each other's devices (CUDA IPC), as Horovod
    does. A GPU shared by workers (fractional ``gpus_per_worker``) is listed once."""
    per_host: dict[str, list[str]] = {}
    for slot, info in zip(workers.slots, workers.info, strict=True):
        seen = per_host.setdefault(slot.hostname, [])
        seen.extend(g for g in map(str, info["gpu_ids"]) if g not in seen)  # fractions share
    return {slot.rank: ",".join(per_host[slot.hostname])
            for slot, info in zip(workers.slots, workers.info, strict=True) if info["gpu_ids"]}


def stop(actors: list[Any], group: PlacementGroup | None, *, graceful: float = 0.0,
         job_id: str | None = None, nodes: set[str] | None = None,
         timeout: float = 10.0) -> None:
    """Stop ``actors`` and free ``group``; never raises, returns within about
    ``graceful + timeout`` seconds.

    With ``graceful`` > 0 the actors first get a termination request queued after their
    current work (their ``atexit`` handlers run: hora's shutdown unlinks a rank's shared
    memory); whatever is still alive after ``graceful`` seconds is killed. With ``job_id``, a
    small task on each node of ``nodes`` then unlinks what killed ranks left in ``/dev/shm``.
    """
    if graceful > 0 and actors:
        refs = []
        for actor in actors:
            try:
                refs.append(actor.__ray_terminate__.remote())
            except Exception:  # noqa: BLE001 (a dead handle)
                pass
        try:
            ray.wait(refs, num_returns=len(refs), timeout=graceful)
        except Exception:  # noqa: BLE001
            pass
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 (already gone)
            pass
    if group is not None:
        try:
            remove_placement_group(group)
        except Exception as exc:  # noqa: BLE001
            log.warning("hora.ray: could not remove the placement group: %s", exc)
    if job_id and nodes:
        _sweep(job_id, nodes, timeout)


def _sweep(job_id: str, nodes: set[str], timeout: float) -> None:
    task = ray.remote(num_cpus=0, max_retries=0)(remove_segments)
    deadline = time.monotonic() + timeout
    for node in sorted(nodes):  # one node at a time: the killed ranks must be gone first
        ref = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            node, soft=False)).remote(job_id)
        try:
            removed = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 (node gone, timeout)
            log.warning("hora.ray: could not clean /dev/shm on node %s: %s", node[:8], exc)
            continue
        if removed:
            log.info("hora.ray: removed %d shared memory segment(s) of stopped workers on "
                     "node %s", removed, node[:8])


__all__ = ["Layout", "Workers", "host_labels", "layout", "rank_order", "start_workers", "stop",
           "visible_devices"]
