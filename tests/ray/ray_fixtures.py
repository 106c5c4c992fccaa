"""Shared fixtures of the hora.ray tests: one real local Ray per test module, executors that are
always shut down, and a bound on every wait.

No ``__init__.py`` here (a package named ``ray`` under ``tests/`` would shadow the real one) and
no ``conftest.py`` (two top-level ``conftest`` modules would collide): test modules import
the fixtures by their function names (``local_ray_fixture``, ...), and use them by their
fixture names (``local_ray``, ``make_executor``). Ray is imported only when
a test of this directory runs, never at collection: other tests' processes stay free of it.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

HAVE_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed "
                               "(pip install 'ray>=2.9'; scripts/setup.sh installs it)")

# Fail fast instead of hanging: a stalled collective errors out after 20 s.
WORKER_ENV = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "5",
              "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20", "OMP_NUM_THREADS": "1"}


def start_local_ray(num_cpus: int = 4) -> Any:
    """``ray.init(num_cpus=...)`` of a fresh local Ray, with the jobs module sent by value
    (the workers cannot import tests/ray)."""
    ray = pytest.importorskip("ray", reason="ray is not importable")
    import ray_jobs

    if ray.is_initialized():
        ray.shutdown()
    # address="local": a new Ray of our own, never a cluster another process runs here
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    ray.cloudpickle.register_pickle_by_value(ray_jobs)
    return ray


@pytest.fixture(scope="module", name="local_ray")
def local_ray_fixture() -> Iterator[Any]:
    """A local Ray with 4 CPUs for the whole module, shut down after it."""
    ray = start_local_ray(4)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(name="make_executor")
def make_executor_fixture(local_ray: Any) -> Iterator[Callable[..., Any]]:
    """``make_executor(num_workers=2, start=True, **kwargs)``: a started RayExecutor whose
    ``shutdown()`` runs after the test whatever happens."""
    from hora.ray import RayExecutor

    made: list[Any] = []

    def make(num_workers: int | None = 2, *, start: bool = True, timeout_s: float = 30,
             nics: set[str] | None = None, start_kwargs: dict[str, Any] | None = None,
             **kwargs: Any) -> Any:
        settings = RayExecutor.create_settings(timeout_s=timeout_s,
                                               placement_group_timeout_s=20, nics=nics)
        executor = RayExecutor(settings, num_workers=num_workers, **kwargs)
        made.append(executor)
        if start:
            options = dict(start_kwargs or {})
            extra = {**WORKER_ENV, **options.pop("extra_env_vars", {})}
            executor.start(extra_env_vars=extra, **options)
        return executor

    try:
        yield make
    finally:
        for executor in made:
            executor.shutdown()


def pids_alive(pids: list[int]) -> list[int]:
    """The pids of ``pids`` that still run (zombies count as gone)."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            alive.append(pid)
    return alive


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def shm_segments() -> list[str]:
    """hora's shared memory segments on this machine now."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith("hora-"))
    except OSError:
        return []
