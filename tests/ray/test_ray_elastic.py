"""hora.ray.ElasticRayExecutor on a real multi-node Ray: ``ray.cluster_utils.Cluster`` runs a
head and extra nodes on this machine (separate raylets, 1 CPU each, so a node is one slot).
Nodes are added and removed while a job trains, as Ray's autoscaler would; a worker is
SIGKILLed from outside. The executor runs hora's elastic driver (the one of `hora run
--min-np`), so these tests check the Ray parts: discovery from Ray's node table, actors as
workers, a dead actor or node counted as a failed worker, results of the final generation in
rank order, and errors raised from ``run()``.

The tests follow the job through ``ray_logger`` values (see ray_elastic_jobs.py) and act on
them from a thread; every wait is bounded and, on a timeout, training is told to stop so that
the test fails with the reason instead of hanging.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray_elastic_jobs
from ray_fixtures import WORKER_ENV, needs_ray

pytestmark = [needs_ray, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A Ray head with 1 CPU (and a ``node:fake-a`` resource, a host name for a discovery of
    one's own, as in Horovod's tests); tests add (and remove) their own nodes."""
    ray = pytest.importorskip("ray", reason="ray is not importable")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    made = Cluster(initialize_head=True,
                   head_node_args={"num_cpus": 1, "resources": {"node:fake-a": 1}})
    try:
        ray.init(address=made.address, log_to_driver=False, configure_logging=False)
        ray.cloudpickle.register_pickle_by_value(ray_elastic_jobs)
        yield made
    finally:
        ray.shutdown()
        made.shutdown()


class Journal:
    """The values the workers log, and bounded waits on them (called from the test's thread)."""

    def __init__(self) -> None:
        self.values: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.over = False  # run() returned: nothing more will come

    def __call__(self, value: dict[str, Any]) -> None:
        self.values.append(value)

    def wait(self, what: str, predicate: Callable[[list[dict[str, Any]]], bool],
             timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(list(self.values)):
                return True
            if self.over:
                self.errors.append(f"the job ended while the test waited for {what}")
                return False
            time.sleep(0.05)
        self.errors.append(f"timed out after {timeout:g} s waiting for {what}")
        return False

    def steps(self) -> list[tuple[int, int]]:
        """``(step, size)`` of every commit rank 0 logged."""
        return [(v["step"], v["size"]) for v in self.values if "step" in v]

    def started(self) -> dict[int, dict[str, Any]]:
        """worker id -> ``{"pid", "node"}`` of every worker that started."""
        return {v["wid"]: v for v in self.values if v.get("event") == "started"}

    def on_node(self, node_id: str) -> list[int]:
        """The ids of the workers that started on Ray node ``node_id``."""
        return sorted(w for w, v in self.started().items() if v["node"] == node_id)


def add_node(cluster: Any) -> Any:
    node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes(timeout=60)
    return node


def remove_node(cluster: Any, node: Any) -> None:
    if node in cluster.worker_nodes:
        cluster.remove_node(node, allow_graceful=True)


def executor(min_num_proc: int, max_num_proc: int | None, elastic_timeout: float) -> Any:
    from hora.ray import ElasticRayExecutor

    settings = ElasticRayExecutor.create_settings(
        min_num_proc=min_num_proc, max_num_proc=max_num_proc, elastic_timeout=elastic_timeout,
        timeout_s=30)
    made = ElasticRayExecutor(settings, cpus_per_slot=1, env_vars=WORKER_ENV)
    made.start()
    return made


def test_discovery_lists_alive_nodes_with_their_slots(cluster: Any) -> None:
    import ray

    from hora.ray.elastic import RayHostDiscovery

    extra = add_node(cluster)
    try:
        discovery = RayHostDiscovery(cpus_per_slot=1)
        hosts = discovery.find_available_hosts_and_slots()
        assert list(hosts.values()) == [1, 1], hosts
        nodes = {discovery.node_id(h) for h in hosts}
        assert nodes == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(set(hosts)) == 2  # two raylets on one machine: two host names
        assert RayHostDiscovery(cpus_per_slot=0.5).find_available_hosts_and_slots() == {
            h: 2 for h in hosts}
        assert RayHostDiscovery(use_gpu=True).find_available_hosts_and_slots() == {}
    finally:
        remove_node(cluster, extra)
    assert wait_gone(discovery, 1), discovery.find_available_hosts_and_slots()
    assert list(discovery.find_available_hosts_and_slots()) == [
        h for h in hosts if discovery.node_id(h) != extra.node_id]  # names are kept


def wait_gone(discovery: Any, count: int) -> bool:
    deadline = time.monotonic() + 30
    while len(discovery.find_available_hosts_and_slots()) != count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


class Background:
    """``job.run(...)`` in a thread (Ray's Cluster adds and removes nodes only from the main
    thread, which therefore follows the job); :meth:`result` returns or raises its outcome."""

    def __init__(self, job: Any, fn: Callable[[], Any], journal: Journal) -> None:
        self.value: Any = None
        self.error: BaseException | None = None

        def target() -> None:
            try:
                self.value = job.run(fn, callbacks=[journal])
            except BaseException as exc:  # noqa: BLE001 (re-raised by result())
                self.error = exc
            finally:
                journal.over = True

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def result(self, timeout: float) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"run() did not return within {timeout:g} s"
        if self.error is not None:
            raise self.error
        return self.value


def test_training_survives_a_killed_worker_a_new_node_and_a_removed_node(
        cluster: Any, tmp_path: Path) -> None:
    # head + node B: workers 0 and 1, one on each (min 2, max 3). The one on B is SIGKILLed
    # at step >= 10: a replacement (worker 2) starts on B's freed slot and joins; node C is
    # added: worker 3 starts there and joins at a commit (size 3); node B is removed: worker 2
    # dies with it, and the head's worker and worker 3 train on (size 2) until the test stops
    # them.
    stop = tmp_path / "stop"
    journal = Journal()
    node_b = add_node(cluster)
    nodes = [node_b]
    try:
        job = Background(executor(2, 3, elastic_timeout=60),
                         lambda: ray_elastic_jobs.torch_train_until_stopped(str(stop)), journal)
        if journal.wait("step 10 with 2 workers",
                        lambda vs: any(v.get("step", 0) >= 10 for v in vs)):
            os.kill(journal.started()[journal.on_node(node_b.node_id)[0]]["pid"],
                    signal.SIGKILL)
        if journal.wait("the replacement (worker 2) to start", lambda vs: 2 in journal.started()):
            joined = len(journal.values)
            if journal.wait("worker 2 to train", lambda vs: any("step" in v for v in vs[joined:])):
                nodes.append(add_node(cluster))
        if journal.wait("worker 3 (node C) to join", lambda vs: any(
                v.get("size") == 3 for v in vs)):
            remove_node(cluster, node_b)
            shrunk = len(journal.values)
            journal.wait("2 workers again after node B left", lambda vs: any(
                v.get("size") == 2 for v in vs[shrunk:]))
        stop.touch()
        results = job.result(60)
    finally:
        stop.touch()
        for node in nodes:
            remove_node(cluster, node)
    assert not journal.errors, (journal.errors, journal.steps())
    assert sorted(journal.started()) == [0, 1, 2, 3]
    on_b, on_c = journal.on_node(node_b.node_id), journal.on_node(nodes[1].node_id)
    assert len(on_b) == 2 and on_b[1] == 2 and on_c == [3], journal.started()
    head_worker = ({0, 1} - set(on_b)).pop()
    sizes = [size for _, size in journal.steps()]
    assert sizes[0] == 2 and 3 in sizes and sizes[-1] == 2, journal.steps()
    # the final generation: the head's worker (the oldest: rank 0) and worker 3, in rank order
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["wid"] for r in results] == [head_worker, 3]
    assert {r["size"] for r in results} == {2}
    assert results[0]["step"] == results[1]["step"] >= journal.steps()[-1][0]
    assert results[0]["params"] == results[1]["params"]  # identical state on every rank


def test_below_min_num_proc_after_the_elastic_timeout_raises(cluster: Any,
                                                             tmp_path: Path) -> None:
    from hora.errors import ElasticError

    stop = tmp_path / "stop"
    journal = Journal()
    node = add_node(cluster)
    try:
        # the elastic timeout also bounds the start: long enough for two workers to start here
        job = Background(executor(2, None, elastic_timeout=15),
                         lambda: ray_elastic_jobs.numpy_train_until_stopped(str(stop)), journal)
        if journal.wait("step 10", lambda vs: any(v.get("step", 0) >= 10 for v in vs)):
            remove_node(cluster, node)
            removed = time.monotonic()
            job.thread.join(30)  # it must fail meanwhile: the test stops it only after that
            failed_after = time.monotonic() - removed
        stop.touch()
        with pytest.raises(ElasticError, match=r"only 1 worker\(s\) \(worker [01] on .*\) "
                                               r"were ready, fewer than min_num_proc 2, for 15 "
                                               r"s \(elastic_timeout\).*The first workers' "
                                               r"failures: worker [01] on .* died: its actor is "
                                               r"gone \(The actor died because its node has "
                                               r"died\)"):
            job.result(30)
    finally:
        stop.touch()
        remove_node(cluster, node)
    assert not journal.errors, journal.errors
    assert 15 <= failed_after < 30, failed_after


def test_a_worker_error_that_ends_the_job_is_raised(cluster: Any) -> None:
    from hora.runner.api import RemoteTraceback

    job = executor(1, None, elastic_timeout=30)
    with pytest.raises(ValueError, match="bad hyperparameter") as info:
        job.run(ray_elastic_jobs.bad_hyperparameter)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised by elastic worker 0" in notes, notes
    assert "blacklisted" in notes, notes  # the job's reason: its one host failed twice
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "bad_hyperparameter" in info.value.__cause__.text


class FixedHosts:
    """A discovery of one's own (``override_discovery=False``)."""

    def __init__(self, hosts: dict[str, int]) -> None:
        self.hosts = hosts

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return dict(self.hosts)


def test_a_discovery_of_ones_own_places_workers_or_says_why_not(cluster: Any,
                                                               tmp_path: Path) -> None:
    from hora.errors import ElasticError
    from hora.ray import ElasticRayExecutor

    stop = tmp_path / "stop"
    stop.touch()
    for hosts in ({"fake-a": 1}, {"nowhere": 1}):
        settings = ElasticRayExecutor.create_settings(min_num_proc=1, elastic_timeout=30)
        settings.discovery = FixedHosts(hosts)
        job = ElasticRayExecutor(settings, override_discovery=False, env_vars=WORKER_ENV)
        job.start()
        run = functools.partial(ray_elastic_jobs.numpy_train_until_stopped, str(stop), 0.0)
        if "fake-a" in hosts:  # placed by the node:fake-a resource
            assert [r["step"] for r in job.run(run)] == [5]
            continue
        with pytest.raises(ElasticError, match=r"every host that ran workers is blacklisted.*"
                                               r"worker 0 on nowhere: hora.ray: host 'nowhere' "
                                               r"\(from the host discovery\) is not a Ray node"):
            job.run(run)


def test_settings_and_arguments_are_checked() -> None:
    from hora.ray import ElasticRayExecutor, RayExecutor

    create = ElasticRayExecutor.create_settings
    with pytest.raises(ValueError, match="min_num_proc must be an int >= 1"):
        create(min_num_proc=0)
    with pytest.raises(ValueError, match=r"min_num_proc \(3\) <= num_proc \(3\) <= "
                                         r"max_num_proc \(2\)"):
        create(min_num_proc=3, max_num_proc=2)
    with pytest.raises(ValueError, match="elastic_timeout"):
        create(elastic_timeout=0)
    with pytest.raises(TypeError, match="unexpected keyword.*bogus"):
        create(bogus=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings = create(min_np=2, max_np=4)
    assert (settings.min_num_proc, settings.max_num_proc, settings.num_proc) == (2, 4, 2)
    assert [w.category for w in caught] == [DeprecationWarning] * 2
    with pytest.raises(ValueError, match="use_gpu"):
        ElasticRayExecutor(create(), gpus_per_slot=1)
    with pytest.raises(ValueError, match="override_discovery=False needs"):
        ElasticRayExecutor(create(), override_discovery=False)
    with pytest.raises(RuntimeError, match="start"):
        ElasticRayExecutor(create()).run(ray_elastic_jobs.bad_hyperparameter)
    elastic = RayExecutor(RayExecutor.create_settings(), min_workers=1, max_workers=4)
    with pytest.raises(NotImplementedError, match="executable_cls is not available"):
        elastic.start(executable_cls=dict)
    with pytest.raises(NotImplementedError, match="run_remote.*ephemeral"):
        elastic.run_remote(ray_elastic_jobs.bad_hyperparameter)


def test_ray_executor_with_min_workers_runs_an_elastic_job(cluster: Any, tmp_path: Path) -> None:
    # Horovod's newer spelling of ElasticRayExecutor: RayExecutor(settings, min_workers=...)
    from hora.ray import RayExecutor

    stop = tmp_path / "stop"
    stop.touch()  # trains 5 steps, then every rank sees the file at the first commit
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), min_workers=1,
                           max_workers=2, cpus_per_worker=1)
    executor.start(extra_env_vars=WORKER_ENV)
    results = executor.run(ray_elastic_jobs.numpy_train_until_stopped, args=[str(stop)],
                           kwargs={"step_delay": 0.0})
    executor.shutdown()
    assert results == [{"rank": 0, "size": 1, "wid": 0, "step": 5, "total": 5.0}]
