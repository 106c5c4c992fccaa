"""Host discovery from Ray's cluster state: Horovod's ``RayHostDiscovery``.

Launcher side (the driver process). The elastic driver (:mod:`hora.runner.elastic.driver`) polls
:meth:`RayHostDiscovery.find_available_hosts_and_slots` about once a second: every *alive* Ray
node is a host, with ``CPU // cpus_per_slot`` slots (and at most ``GPU // gpus_per_slot`` with
``use_gpu``), counted from the node's total resources as Horovod counts them. A node that Ray's
autoscaler adds appears at the next poll; a node that dies or is removed disappears.

Host names: a node is known by its host name (``NodeManagerHostname``), or by ``<host
name>-<first 8 characters of its node id>`` when several Ray nodes share that host name (the
fake nodes of ``ray.cluster_utils.Cluster``, several raylets on one machine), the rule
:func:`hora.ray.placement.host_labels` follows for :class:`~hora.ray.RayExecutor`. A node keeps
the name it was first given for the life of the discovery object, so a host name never moves
to another node. :meth:`RayHostDiscovery.node_id` maps a name back to its node, which is where
:class:`hora.ray.spawner.RaySpawner` places that host's workers.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from typing import Any

import ray

from hora.errors import DiscoveryError

log = logging.getLogger(__name__)


def _alive(node: dict[str, Any]) -> bool:
    return bool(node.get("Alive", node.get("alive", False)))


class RayHostDiscovery:
    """Ray's alive nodes as elastic hosts (Horovod's class of the same name).

    Args:
        use_gpu: count GPU slots too (a node's slots are then the fewer of its CPU and GPU
            slots).
        cpus_per_slot: CPUs one worker needs (>= 0; 0 only with ``use_gpu``).
        gpus_per_slot: GPUs one worker needs with ``use_gpu`` (> 0).

    Raises:
        ValueError: a negative or zero requirement that leaves a worker needing nothing.
    """

    def __init__(self, use_gpu: bool = False, cpus_per_slot: float = 1,
                 gpus_per_slot: float = 1) -> None:
        if cpus_per_slot < 0 or (use_gpu and not gpus_per_slot > 0):
            raise ValueError(f"cpus_per_slot ({cpus_per_slot}) must be >= 0 and gpus_per_slot "
                             f"({gpus_per_slot}) > 0 with use_gpu")
        if not cpus_per_slot and not use_gpu:
            raise ValueError("cpus_per_slot must be > 0 without use_gpu: a worker must need "
                             "some resource for its node's slots to be counted")
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot
        self._names: dict[str, str] = {}  # node id -> host name, fixed at first sight
        self._nodes: dict[str, str] = {}  # host name -> node id
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"RayHostDiscovery(use_gpu={self.use_gpu}, cpus_per_slot={self.cpus_per_slot}, "
                f"gpus_per_slot={self.gpus_per_slot})")

    def slots(self, resources: dict[str, float]) -> int:
        """How many workers a node with ``resources`` (Ray's totals) can hold."""
        counts = []
        if self.cpus_per_slot:
            counts.append(math.floor(resources.get("CPU", 0.0) / self.cpus_per_slot + 1e-9))
        if self.use_gpu:
            counts.append(math.floor(resources.get("GPU", 0.0) / self.gpus_per_slot + 1e-9))
        return max(0, min(counts))

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """``{host name: slots}`` of the alive nodes that can hold at least one worker, in
        Ray's node order.

        Raises:
            DiscoveryError: Ray's node table cannot be read (Ray not initialized, GCS gone).
        """
        try:
            nodes = ray.nodes()
        except Exception as exc:  # noqa: BLE001 (whatever Ray raises: the driver retries)
            raise DiscoveryError(f"hora.ray: cannot read Ray's node table (ray.nodes()): "
                                 f"{type(exc).__name__}: {exc}") from None
        shared = Counter(str(n.get("NodeManagerHostname") or n.get("NodeManagerAddress"))
                         for n in nodes)
        hosts: dict[str, int] = {}
        with self._lock:
            for node in nodes:
                if not _alive(node):
                    continue
                name = self._name(node, shared)
                slots = self.slots(node.get("Resources") or {})
                if slots > 0:
                    hosts[name] = slots
        if not hosts and any(_alive(n) for n in nodes):
            log.info("hora.ray: %d alive Ray node(s), none with a slot of %s",
                     sum(_alive(n) for n in nodes), self._need())
        return hosts

    def node_id(self, host: str) -> str | None:
        """The Ray node id (hex) of ``host`` (a name this discovery gave), else None."""
        with self._lock:
            return self._nodes.get(host)

    def _name(self, node: dict[str, Any], shared: Counter[str]) -> str:
        node_id = str(node["NodeID"])
        name = self._names.get(node_id)
        if name is None:
            base = str(node.get("NodeManagerHostname") or node.get("NodeManagerAddress"))
            name = base if shared[base] == 1 and base not in self._nodes else \
                f"{base}-{node_id[:8]}"
            self._names[node_id] = name
            self._nodes[name] = node_id
        return name

    def _need(self) -> str:
        need = [f"{self.cpus_per_slot:g} CPU"] if self.cpus_per_slot else []
        if self.use_gpu:
            need.append(f"{self.gpus_per_slot:g} GPU")
        return " + ".join(need)


__all__ = ["RayHostDiscovery"]
