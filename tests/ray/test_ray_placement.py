"""hora.ray's placement arithmetic without a cluster: bundles per layout, rank order by node,
host identities, and each rank's CUDA_VISIBLE_DEVICES (GPU ids as Ray would report them)."""

from __future__ import annotations

from typing import Any

import pytest
from ray_fixtures import needs_ray

pytestmark = needs_ray


def _info(node: str, host: str = "h", gpus: tuple[int, ...] = ()) -> dict[str, Any]:
    return {"node_id": node * 8, "hostname": host, "ip": "10.0.0.1", "pid": 1,
            "gpu_ids": list(gpus)}


def test_bundles_follow_horovods_strategies() -> None:
    from hora.ray.placement import layout

    packed = layout(3, None, 1, 2, False, None, True)
    assert packed.bundles() == ([{"CPU": 2.0}] * 3, "PACK")
    spread = layout(None, 2, 3, 1, True, None, True)
    assert spread.num_workers == 6
    assert spread.bundles() == ([{"CPU": 3.0, "GPU": 3.0}] * 2, "STRICT_SPREAD")
    gpu_only = layout(2, None, 1, 0, True, 0.5, True)
    assert gpu_only.bundles() == ([{"GPU": 0.5}] * 2, "PACK")


def test_ranks_are_contiguous_per_node_and_hosts_named_per_node() -> None:
    from hora.ray.placement import host_labels, rank_order

    info = [_info("a"), _info("b"), _info("a"), _info("c"), _info("b")]
    assert rank_order(info) == [0, 2, 1, 4, 3]
    assert host_labels([_info("a", "x"), _info("b", "y")]) == ["x", "y"]
    # several Ray nodes on one host name (cluster_utils' fake nodes): one identity per node
    assert host_labels([_info("a"), _info("b"), _info("a")]) == ["h-aaaaaaaa", "h-bbbbbbbb",
                                                                 "h-aaaaaaaa"]


def test_visible_devices_per_node_in_local_rank_order() -> None:
    from hora.ray.placement import Workers, visible_devices
    from hora.rendezvous.topology import compute_topology

    info = [_info("a", "x", (3,)), _info("a", "x", (1,)), _info("b", "y", (0,)),
            _info("b", "y", (0,))]  # node b: two workers sharing GPU 0 (0.5 each)
    workers = Workers(None, False, [None] * 4, compute_topology(["x", "x", "y", "y"]), info)
    assert visible_devices(workers) == {0: "3,1", 1: "3,1", 2: "0", 3: "0"}
    no_gpu = Workers(None, False, [None] * 2, compute_topology(["x", "x"]),
                     [_info("a"), _info("a")])
    assert visible_devices(no_gpu) == {}


def test_worker_environment_order_and_secret_never_described() -> None:
    from hora.errors import ConfigError
    from hora.ray.environment import check_extra, describe, driver_knobs, worker_environment
    from hora.rendezvous.topology import compute_topology

    slot = compute_topology(["x", "x", "y"])[2]
    env = worker_environment(slot, store=("10.0.0.1", 5000), secret_hex="ab" * 32, job_id="j1",
                             start_timeout=30, nics=["eth1", "eth2"],
                             knobs={"HORA_CYCLE_TIME": "2"}, extra={"HORA_CYCLE_TIME": "3"},
                             devices="0")
    assert env["HOROVOD_RANK"] == "2" and env["HORA_CROSS_RANK"] == "1"
    assert env["HOROVOD_LOCAL_SIZE"] == "1" and env["HORA_HOSTNAME"] == "y"
    assert env["HORA_CYCLE_TIME"] == "3"  # extra_env_vars over the driver's knobs
    assert env["HORA_GLOO_IFACE"] == "eth1" and env["NCCL_SOCKET_IFNAME"] == "eth1,eth2"
    assert env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "5000" and env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "ab" * 32 not in describe(env)
    assert driver_knobs({"HORA_CYCLE_TIME": "1", "HORA_RANK": "0", "PATH": "/bin",
                         "HORA_SECRET_KEY": "00"}) == {"HORA_CYCLE_TIME": "1"}
    with pytest.raises(ConfigError, match="HORA_SECRET_KEY"):
        check_extra({"HORA_SECRET_KEY": "00"})
