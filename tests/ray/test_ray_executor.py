"""hora.ray.RayExecutor on a real local Ray (4 CPUs): ranks, collectives, the Horovod API
(run / run_remote / execute / execute_single / executables / callbacks), the workers'
environment and secret, argument checks, placement, shutdown, and start-up time.

    .venv/bin/pytest tests/ray -q
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import ray_jobs
from ray_fixtures import (
    HERE,
    ROOT,
    local_ray_fixture,  # noqa: F401 (fixture)
    make_executor_fixture,  # noqa: F401 (fixture)
    needs_ray,
    pids_alive,
    wait_until,
)

pytestmark = [needs_ray, pytest.mark.timeout(120)]


def test_four_workers_ranks_topology_and_allreduce(make_executor: Any) -> None:
    executor = make_executor(4)
    results = executor.run(ray_jobs.identity_and_allreduce)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]  # rank order
    assert {r["size"] for r in results} == {4}
    assert [r["local_rank"] for r in results] == [0, 1, 2, 3]  # one node
    assert {r["local_size"] for r in results} == {4}
    assert {(r["cross_rank"], r["cross_size"]) for r in results} == {(0, 1)}
    assert {r["host"] for r in results} == {socket.gethostname()}
    assert all(r["sum"] == [10.0] * 5 for r in results)
    assert len({r["pid"] for r in results}) == 4
    # a second run reuses the same workers and the same hora job
    assert executor.run(ray_jobs.scaled_rank, args=[10], kwargs={"offset": 1}) == [1, 11, 21, 31]


def test_run_remote_execute_and_execute_single(make_executor: Any, local_ray: Any) -> None:
    executor = make_executor(2, start_kwargs={"executable_cls": ray_jobs.Counter,
                                              "executable_args": [100],
                                              "executable_kwargs": {"step": 10}})
    assert executor.execute(lambda counter: counter.value) == [100, 110]
    assert executor.execute(lambda counter: counter.bump()) == [101, 111]
    assert executor.execute_single(lambda counter: counter.bump()) == 102
    refs = executor.run_remote(ray_jobs.scaled_rank, args=[3], kwargs={"offset": 2})
    assert len(refs) == 2
    assert local_ray.get(refs, timeout=30) == [2, 5]
    assert executor.execute(lambda counter: counter.value) == [102, 111]


def test_callbacks_receive_rank_0_values_in_order(make_executor: Any) -> None:
    executor = make_executor(2)
    seen: list[dict[str, int]] = []
    assert executor.run(ray_jobs.log_values, args=[5], callbacks=[seen.append]) == [0, 1]
    assert seen == [{"step": i, "rank": 0} for i in range(5)]
    with pytest.raises(TypeError, match="callables"):
        executor.run(ray_jobs.log_values, args=[1], callbacks=[42])
    # without callbacks the values go nowhere (a warning on the worker), the run still works
    assert executor.run(ray_jobs.log_values, args=[2]) == [0, 1]


def test_worker_environment_and_secret(make_executor: Any) -> None:
    executor = make_executor(2, start_kwargs={"extra_env_vars": {"MY_SETTING": 7}})
    names = ["HOROVOD_RANK", "HORA_SIZE", "HOROVOD_LOCAL_RANK", "HORA_RENDEZVOUS_ADDR",
             "HOROVOD_GLOO_RENDEZVOUS_PORT", "HORA_JOB_ID", "HORA_LAUNCHER", "MY_SETTING",
             "HORA_START_TIMEOUT", "HOROVOD_CONTROLLER", "HORA_LAUNCHER_PID"]
    envs = executor.run(ray_jobs.environment, args=[names])
    assert [e["HOROVOD_RANK"] for e in envs] == ["0", "1"]
    assert {e["HORA_SIZE"] for e in envs} == {"2"}
    assert {e["HORA_RENDEZVOUS_ADDR"] for e in envs} == {"127.0.0.1"}  # all on this machine
    assert {e["MY_SETTING"] for e in envs} == {"7"}
    assert {e["HORA_LAUNCHER"] for e in envs} == {"hora.ray"}
    assert {e["HORA_START_TIMEOUT"] for e in envs} == {"30"}
    assert {e["HORA_LAUNCHER_PID"] for e in envs} == {None}
    assert len({e["HORA_JOB_ID"] for e in envs}) == 1
    for cmdline, secret in executor.run(ray_jobs.cmdline_and_secret):
        assert len(bytes.fromhex(secret)) == 32
        assert secret not in cmdline  # the secret travels through Ray, never argv


def test_nics_choose_the_interface(make_executor: Any) -> None:
    executor = make_executor(2, nics={"lo"})
    envs = executor.run(ray_jobs.environment, args=[["HORA_GLOO_IFACE", "NCCL_SOCKET_IFNAME",
                                                      "HORA_RENDEZVOUS_ADDR"]])
    assert envs == [{"HORA_GLOO_IFACE": "lo", "NCCL_SOCKET_IFNAME": "lo",
                     "HORA_RENDEZVOUS_ADDR": "127.0.0.1"}] * 2
    assert [r["sum"][0] for r in executor.run(ray_jobs.identity_and_allreduce)] == [3.0, 3.0]


def test_extra_env_vars_cannot_set_identity(make_executor: Any) -> None:
    from hora.errors import ConfigError

    executor = make_executor(2, start=False)
    with pytest.raises(ConfigError, match="HORA_RANK"):
        executor.start(extra_env_vars={"HORA_RANK": "3"})
    assert executor.workers == []


def test_context_manager_starts_and_shuts_down(local_ray: Any) -> None:
    from hora.ray import RayExecutor

    with RayExecutor(RayExecutor.create_settings(), num_workers=2) as executor:
        pids = [r["pid"] for r in executor.run(ray_jobs.identity_and_allreduce)]
        assert "started" in repr(executor)
    assert executor.workers == []
    assert wait_until(lambda: not pids_alive(pids), 10), pids_alive(pids)


def test_argument_checks() -> None:
    from hora.ray import RayExecutor

    settings = RayExecutor.create_settings()
    with pytest.raises(ValueError, match="num_workers=N"):
        RayExecutor(settings)
    with pytest.raises(ValueError, match="not both"):
        RayExecutor(settings, num_workers=2, num_hosts=2)
    with pytest.raises(ValueError, match="use_gpu"):
        RayExecutor(settings, num_workers=2, gpus_per_worker=1)
    with pytest.raises(ValueError, match=">= 1"):
        RayExecutor(settings, num_workers=0)
    with pytest.raises(ValueError, match="some resource"):
        RayExecutor(settings, num_workers=2, cpus_per_worker=0)
    with pytest.raises(ValueError, match="min_workers"):
        RayExecutor(settings, max_workers=4)
    with pytest.raises(ValueError, match="not both"):
        RayExecutor(settings, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="timeout"):
        RayExecutor.create_settings(timeout_s=0)
    executor = RayExecutor(settings, num_workers=2)
    with pytest.raises(RuntimeError, match="start"):
        executor.run(ray_jobs.scaled_rank, args=[1])
    executor.shutdown()  # harmless before start


def test_num_hosts_spreads_and_placement_timeout(make_executor: Any, local_ray: Any) -> None:
    before = local_ray.cluster_resources().get("CPU")  # all free once idle
    executor = make_executor(None, num_hosts=1, num_workers_per_host=2)
    results = executor.run(ray_jobs.identity_and_allreduce)
    assert [(r["rank"], r["local_rank"], r["local_size"]) for r in results] == [
        (0, 0, 2), (1, 1, 2)]
    executor.shutdown()

    too_big = make_executor(8, start=False)
    too_big.settings.placement_group_timeout_s = 1
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="placement_group_timeout_s"):
        too_big.start()
    assert time.monotonic() - started < 10
    assert wait_until(lambda: local_ray.available_resources().get("CPU") == before, 10)


def test_shutdown_leaves_no_actor_process_or_reservation(make_executor: Any,
                                                          local_ray: Any) -> None:
    before = local_ray.cluster_resources().get("CPU")  # all free once idle
    executor = make_executor(3)
    pids = [r["pid"] for r in executor.run(ray_jobs.identity_and_allreduce)]
    store = executor._store.host, executor._store.port
    assert local_ray.available_resources().get("CPU", 0) <= before - 3
    started = time.monotonic()
    executor.shutdown()
    assert time.monotonic() - started < 10
    assert executor.workers == []
    assert wait_until(lambda: not pids_alive(pids), 10), pids_alive(pids)
    assert wait_until(lambda: local_ray.available_resources().get("CPU") == before, 10)
    with pytest.raises(OSError):  # the rendezvous store is closed
        socket.create_connection(store, timeout=2).close()
    executor.shutdown()  # idempotent
    # and a new start works on the same executor
    executor.start()
    assert executor.run(ray_jobs.scaled_rank, args=[1]) == [0, 1, 2]


def test_the_driver_never_loads_the_engine() -> None:
    """The driver process imports Ray and the launcher side only, even across a real job."""
    code = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
import ray, ray_jobs
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
ray.cloudpickle.register_pickle_by_value(ray_jobs)
from hora.ray import RayExecutor
ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
ex.start()
assert [r["sum"][0] for r in ex.run(ray_jobs.identity_and_allreduce)] == [3.0, 3.0]
ex.shutdown()
ray.shutdown()
print(sorted(m for m in sys.modules if m.startswith(("hora.core", "hora.transports",
      "hora.numpy_api", "hora.torch", "hora.collectives"))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=90, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
