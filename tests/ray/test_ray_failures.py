"""hora.ray failure paths on a real local Ray: an exception on one rank names that rank; a rank
blocked on a failed peer does not hang the driver; an actor that dies mid-run is reported
within seconds as the root cause; a failing executable leaves nothing running. Every test is
bounded, and the suite-wide guard (tests/conftest.py) checks that no shared memory is left.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
import ray_jobs
from ray_fixtures import (
    local_ray_fixture,  # noqa: F401 (fixture)
    make_executor_fixture,  # noqa: F401 (fixture)
    needs_ray,
    pids_alive,
    wait_until,
)

pytestmark = [needs_ray, pytest.mark.timeout(120)]


def test_exception_on_rank_1_names_rank_1(make_executor: Any) -> None:
    from hora.runner.api import RemoteTraceback

    executor = make_executor(3)
    with pytest.raises(ValueError, match="deliberate failure on rank 1") as info:
        executor.run(ray_jobs.raise_on, args=[1])
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised by rank 1 of 3" in notes and "raise_on()" in notes
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback) and cause.rank == 1
    assert "deliberate failure on rank 1" in cause.text and "raise_on" in cause.text
    # the other ranks finished: the executor stays usable
    assert executor.run(ray_jobs.scaled_rank, args=[2]) == [0, 2, 4]
    with pytest.raises(ValueError, match="rank 0"):
        executor.execute_single(lambda _: ray_jobs.raise_on(0, after_init=False))


def test_rank_failing_while_peers_block_does_not_hang(make_executor: Any) -> None:
    executor = make_executor(3)
    pids = [r["pid"] for r in executor.run(ray_jobs.identity_and_allreduce)]
    started = time.monotonic()
    with pytest.raises(ValueError, match="deliberate failure on rank 2") as info:
        executor.run(ray_jobs.raise_while_others_allreduce, args=[2])
    elapsed = time.monotonic() - started
    assert elapsed < 10, elapsed
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "rank 2 of 3" in notes and "Ranks [0, 1] were still running" in notes
    assert "call shutdown() and start()" in notes
    assert wait_until(lambda: not pids_alive(pids), 10), pids_alive(pids)
    with pytest.raises(RuntimeError, match=r"stopped after rank 2 failed.*shutdown\(\) and "
                                           r"start\(\)"):
        executor.run(ray_jobs.scaled_rank, args=[1])
    executor.shutdown()
    executor.start()
    assert executor.run(ray_jobs.scaled_rank, args=[1]) == [0, 1, 2]


def test_worker_killed_mid_run_is_reported_within_seconds(make_executor: Any) -> None:
    from hora.errors import RankFailedError

    executor = make_executor(3)
    pids = [r["pid"] for r in executor.run(ray_jobs.identity_and_allreduce)]
    started = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 1 of 3 \(pid \d+ on node .*\) died "
                                              r"while running allreduce_loop\(\)") as info:
        executor.run(ray_jobs.allreduce_loop, args=[1, 20, 100_000])
    elapsed = time.monotonic() - started
    assert elapsed < 10, elapsed
    assert info.value.rank == 1
    assert "call shutdown() and start()" in str(info.value)
    assert wait_until(lambda: not pids_alive(pids), 10), pids_alive(pids)


def test_actor_killed_from_outside_while_busy(make_executor: Any, local_ray: Any) -> None:
    from hora.errors import RankFailedError

    executor = make_executor(2)
    refs = executor.run_remote(ray_jobs.sleep_forever)
    local_ray.kill(executor.workers[0])
    started = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 0 of 2"):
        executor.execute(lambda _: None)
    assert time.monotonic() - started < 10
    del refs


def test_failing_executable_leaves_nothing_running(make_executor: Any, local_ray: Any) -> None:
    before = local_ray.cluster_resources().get("CPU")  # all free once idle
    executor = make_executor(2, start=False, timeout_s=5)

    class Broken:
        def __init__(self) -> None:
            import os

            if os.environ["HORA_RANK"] == "1":
                raise RuntimeError("executable failed on rank 1")

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="executable failed on rank 1"):
        executor.start(executable_cls=Broken)
    assert time.monotonic() - started < 15
    assert executor.workers == []
    assert wait_until(lambda: local_ray.available_resources().get("CPU") == before, 10)


def test_interrupt_during_run_stops_every_worker(make_executor: Any) -> None:
    import _thread
    import threading

    executor = make_executor(2)
    pids = [r["pid"] for r in executor.run(ray_jobs.identity_and_allreduce)]
    # Python's own Ctrl-C handler, whatever this process inherited: a shell that starts pytest
    # in the background (`cmd &`, CI) ignores SIGINT, and interrupt_main() then does nothing.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, _thread.interrupt_main)  # Ctrl-C, as the terminal sends it
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            executor.run(ray_jobs.sleep_forever)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - started < 10
    assert wait_until(lambda: not pids_alive(pids), 10), pids_alive(pids)
    with pytest.raises(RuntimeError, match="interrupt"):
        executor.run(ray_jobs.scaled_rank, args=[1])
