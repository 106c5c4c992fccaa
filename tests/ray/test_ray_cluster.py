"""hora.ray across two Ray nodes: ``ray.cluster_utils.Cluster`` starts a head and a second node
on this machine (separate raylets, 2 CPUs each). ``num_hosts=2, num_workers_per_host=2`` puts
two workers on each node (STRICT_SPREAD); ranks are contiguous per node, local and cross ranks
follow Horovod's definitions, and the nodes count as distinct hosts for hora (TCP between them,
shared memory within each).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray_jobs
from ray_fixtures import WORKER_ENV, needs_ray

pytestmark = [needs_ray, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def two_node_ray() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="ray is not importable")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        cluster.add_node(num_cpus=2)
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        ray.cloudpickle.register_pickle_by_value(ray_jobs)
        cluster.wait_for_nodes(timeout=60)
        yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_two_nodes_cross_ranks_and_allreduce(two_node_ray: Any) -> None:
    from hora.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30,
                                                       placement_group_timeout_s=30),
                           num_hosts=2, num_workers_per_host=2)
    try:
        executor.start(extra_env_vars=WORKER_ENV)
        results = executor.run(ray_jobs.identity_and_allreduce)
        nodes = executor.execute(lambda _: two_node_ray.get_runtime_context().get_node_id())
    finally:
        executor.shutdown()
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]  # contiguous ranks per node
    assert [r["local_rank"] for r in results] == [0, 1, 0, 1]
    assert {r["local_size"] for r in results} == {2}
    assert [r["cross_rank"] for r in results] == [0, 0, 1, 1]
    assert {r["cross_size"] for r in results} == {2}
    hosts = [r["host"] for r in results]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3]  # one host identity per node
    assert all(r["sum"] == [10.0] * 5 for r in results)
