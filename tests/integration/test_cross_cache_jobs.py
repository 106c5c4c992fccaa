"""The response cache across hosts (hora.core.engine.cross_link) in real jobs: every rank its own
host (``HORA_HOSTNAME``), started as an external launcher would. Hits agree without requests,
a changed signature is learned again, a mismatch and a deadlock fail on every rank with the
coordinator's usual errors, and a rank that dies during a cached cycle fails the others."""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import pytest
from _case_jobs import spawn_ranks

from hora._util.net import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WORKER = str(Path(__file__).with_name("cross_cache_worker.py"))
_ids = itertools.count()


def run(case: str, size: int = 3, **env: str) -> list[tuple[int, str]]:
    job = f"xc{os.getpid()}n{next(_ids)}"
    port, store_port = str(free_port()), str(free_port())
    envs = [{"RANK": str(r), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port, "HORA_RENDEZVOUS_PORT": store_port, "HORA_JOB_ID": job,
             "HORA_HOSTNAME": f"host{r}", "HORA_START_TIMEOUT": "30", "OMP_NUM_THREADS": "1",
             **env} for r in range(size)]
    return spawn_ranks([sys.executable, WORKER, case], envs, timeout=90)


def lines(results: list[tuple[int, str]], prefix: str) -> dict[int, str]:
    found = {}
    for _, out in results:
        for line in out.splitlines():
            if line.startswith(prefix + " "):
                rank, rest = line[len(prefix) + 1:].split(" ", 1)
                found[int(rank)] = rest
    return found


def test_hits_and_a_changed_shape() -> None:
    results = run("hits")
    ok = lines(results, "OK")
    assert sorted(ok) == [0, 1, 2], results
    infos = [json.loads(v) for v in ok.values()]
    assert all(i["cache"] for i in infos)
    assert all(i["slots"] == 1 for i in infos)  # "grad" learned once, then cached
    # g0..g4, and "grad" learned again (its old slot invalidated by the new shape)
    assert all(i["slots_after"] == 6 for i in infos), infos
    # every repetition but the first of each name: 29 of "grad", 5 x 5 of g0..g4, 1 of the
    # new "grad"
    assert all(i["hits"] == 29 + 25 + 1 for i in infos), infos


def test_join_while_others_reduce_a_cached_name() -> None:
    results = run("join")
    ok = lines(results, "OK")
    assert sorted(ok) == [0, 1, 2], results
    infos = [json.loads(v) for v in ok.values()]
    assert all(i["last_joined"] in (0, 1, 2) for i in infos)
    assert len({i["last_joined"] for i in infos}) == 1


def test_mismatch_fails_on_every_rank_with_the_coordinators_message() -> None:
    err = lines(run("mismatch"), "ERR")
    assert sorted(err) == [0, 1, 2], err
    assert len(set(err.values())) == 1, err  # the same text everywhere
    assert "Mismatched ALLREDUCE tensor shapes" in err[0] and "ranks [1] had [5]" in err[0], err[0]


def test_deadlock_fails_on_every_rank() -> None:
    err = lines(run("deadlock", size=2), "ERR")
    assert sorted(err) == [0, 1], err
    for text in err.values():
        assert text.startswith("DeadlockError"), text


def test_a_rank_dying_during_a_cached_cycle_fails_the_others() -> None:
    results = run("death")
    err = lines(results, "ERR")
    assert sorted(err) == [0, 1], results
    for text in err.values():
        assert "rank 2" in text, text
