"""Elastic workers on their slot's share of the host's cores (``--cpu-binding``): which slot a
new worker takes, and a real elastic job whose killed worker's replacement takes its cores."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hora.runner import binding
from hora.runner.elastic.members import Member, Places

from .test_elastic_jobs import WORKER, elastic_job

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def worker(wid: int, place: int | None, host: str = "a", ended: bool = False) -> Member:
    return Member(wid=wid, host=host, started=0.0, place=place,
                  exit_code=0 if ended else None)


def test_a_new_worker_takes_the_lowest_free_slot_of_its_host() -> None:
    places = Places()
    assert places.take([], "a", 2) == (0, 2)
    assert places.take([worker(0, 0)], "a", 2) == (1, 2)
    assert places.take([worker(0, 0), worker(1, 1)], "a", 2) is None  # all held
    assert places.take([worker(0, 0), worker(1, 1, ended=True)], "a", 2) == (1, 2)
    assert places.take([worker(0, 0), worker(1, 1, host="b")], "a", 2) == (1, 2)
    assert places.take([worker(0, None)], "a", 2) == (0, 2)  # an unbound worker holds none


def test_a_changed_slot_count_binds_nobody_until_the_old_cut_is_gone() -> None:
    places = Places()
    assert places.take([], "a", 2) == (0, 2)
    live = [worker(0, 0)]
    assert places.take(live, "a", 4) is None  # worker 0 runs on half the cores: no overlap
    assert places.take(live, "b", 4) == (0, 4)  # other hosts have their own cut
    assert places.take([worker(0, 0, ended=True)], "a", 4) == (0, 4)
    assert places.take([worker(2, 0)], "a", 2) is None  # the new cut holds now


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to bind two workers apart")
def test_a_replacement_takes_the_cores_of_the_worker_it_replaces(tmp_path: Path) -> None:
    # 2 slots on this host: worker 1 dies at step 12, worker 2 starts on its slot.
    result = elastic_job("-np", "2", "--min-np", "1", "--max-np", "2", "-H", "localhost:2",
                         EW_KILL="1:12", EW_STEPS="70")
    assert result.rc == 0, result.err[-3000:]
    done = result.json_lines("wid")
    assert sorted(done) == [0, 2]
    for wid, slot in ((0, 0), (2, 1)):
        share = binding.share(CORES, slot, 2)
        assert share is not None
        assert tuple(done[wid]["cpus"]) == share, (wid, done[wid])
        assert done[wid]["bound"] == binding.cpu_list(share)


def test_elastic_workers_are_not_bound_with_none() -> None:
    result = elastic_job("-np", "2", "--min-np", "2", "-H", "localhost:2", "--cpu-binding",
                         "none", EW_STEPS="10")
    assert result.rc == 0, result.err[-3000:]
    for wid, data in result.json_lines("wid").items():
        assert (data["cpus"], data["bound"]) == (CORES, None), wid


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to bind two workers apart")
def test_workers_on_another_host_are_bound_by_the_agent_there(tmp_path: Path) -> None:
    from runner.helpers import PY, Launcher, clean_env, fake_ssh_path
    from runner.test_ssh_launch import PRELUDE

    # "fake1" is reached through the fake ssh (this machine, through hora's agent)
    prelude = PRELUDE.replace("GRACE_S", "0.0").replace(
        "from hora.runner.cli import main", "import hora.runner.elastic.spawner as spawner\n"
        "spawner.is_local_host = launch.is_local_host\nfrom hora.runner.cli import main")
    argv = [PY, "-c", prelude, "run", "-np", "2", "--min-np", "2", "-H", "fake1:2", PY,
            str(WORKER)]
    log = tmp_path / "ssh.log"
    with Launcher(argv=argv, env=clean_env(PATH=fake_ssh_path(tmp_path), EW_STEPS="10",
                                           FAKE_SSH_LOG=str(log)), cwd=tmp_path) as job:
        result = job.wait(60)
    assert result.rc == 0, result.err[-3000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert sum("fake1" in argv and "hora-rank=" in argv[-1] for argv in calls) == 2, calls
    done = result.json_lines("wid")
    assert sorted(done) == [0, 1]
    shares = sorted(tuple(d["cpus"]) for d in done.values())
    assert shares == sorted(binding.share(CORES, i, 2) or () for i in (0, 1)), done
    assert all(d["bound"] == binding.cpu_list(d["cpus"]) for d in done.values())
