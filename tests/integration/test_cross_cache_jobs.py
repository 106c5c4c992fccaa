"""The response cache across hosts (hora.core.engine.cross_link) in real jobs, started as an
external launcher would, on fake hosts (``HORA_HOSTNAME``): every rank its own host, and 2 hosts
x 2 ranks (each host's marks combined by its leader over the host's links, rank 0's messages
relayed by the leaders). Hits agree without requests, a changed signature is learned again, a
mismatch, a stall and a deadlock fail on every rank with the coordinator's usual errors, and a
rank (or a host's leader) that dies during a cached cycle fails the others, naming it."""

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


def run(case: str, size: int = 3, *args: str, per_host: int = 1,
        **env: str) -> list[tuple[int, str]]:
    """Run ``case`` on ``size`` ranks, ``per_host`` ranks per (fake) host."""
    job = f"xc{os.getpid()}n{next(_ids)}"
    port, store_port = str(free_port()), str(free_port())
    envs = [{"RANK": str(r), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port, "HORA_RENDEZVOUS_PORT": store_port, "HORA_JOB_ID": job,
             "HORA_HOSTNAME": f"host{r // per_host}", "HORA_START_TIMEOUT": "30",
             "OMP_NUM_THREADS": "1", **env} for r in range(size)]
    return spawn_ranks([sys.executable, WORKER, case, *args], envs, timeout=90)


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


# ---- eager slots (hora.core.engine.eager): one rank per host, small ops ------------------------

def test_eager_hits_agree_in_their_exchange_bitwise_equal_on_every_rank() -> None:
    """Every reduction op on 4 KiB: cached hits complete with no decision of rank 0, and every
    rank's result is the rank-order reduction, bit for bit (the worker checks each)."""
    ok = lines(run("bitwise", 4), "OK")
    assert sorted(ok) == [0, 1, 2, 3], ok
    infos = [json.loads(v) for v in ok.values()]
    assert all(i["eager"] and i["decisions"] == 0 for i in infos), infos
    assert all(i["hits"] == 11 * 5 and i["rounds"] == 11 * 5 for i in infos), infos
    assert len({i["digest"] for i in infos}) == 1, infos


def test_eager_off_with_the_knob_rank0_decides() -> None:
    ok = lines(run("bitwise", 3, HORA_EAGER_CACHE="0"), "OK")
    assert sorted(ok) == [0, 1, 2], ok
    infos = {r: json.loads(v) for r, v in ok.items()}
    assert not any(i["eager"] for i in infos.values()), infos
    assert infos[0]["decisions"] > 0 and all(i["hits"] == 55 for i in infos.values()), infos
    assert len({i["digest"] for i in infos.values()}) == 1, infos


def test_eager_stall_names_the_missing_rank() -> None:
    """The late rank is asked about the round it has not committed and declares it dead: the
    others' ops are negotiated and the stall inspector names it."""
    results = run("stall", 3, HORA_STALL_CHECK_TIME_SECONDS="1",
                  HORA_STALL_SHUTDOWN_TIME_SECONDS="3")
    assert "Missing ranks:\n2: [allreduce.s]" in results[0][1], results[0][1]
    stalled = lines(results, "STALLED")
    assert sorted(stalled) == [0, 1], results
    for text in stalled.values():
        assert "never by ranks [2]" in text, text
    assert sorted(lines(results, "OK")) == [0, 1, 2], results


def test_eager_deadlock_among_three_fails_on_every_rank() -> None:
    err = lines(run("deadlock", 3), "ERR")
    assert sorted(err) == [0, 1, 2], err
    for text in err.values():
        assert text.startswith("DeadlockError"), text


@pytest.mark.parametrize("victim", [2, 1, 0])
def test_eager_rank_killed_mid_exchange_fails_the_others(victim: int) -> None:
    """The victim commits a round (its data sent to rank 0, or rank 0 holding it) and dies
    before the others commit it."""
    results = run("marked_death", 3, str(victim))
    err = lines(results, "ERR")
    assert sorted(err) == sorted({0, 1, 2} - {victim}), results
    for text in err.values():
        assert f"rank {victim}" in text, text


@pytest.mark.parametrize("victim", [2, 1])
def test_eager_a_rank_leaving_early_is_a_clean_shutdown(victim: int) -> None:
    results = run("early_exit", 3, str(victim))
    assert sorted(lines(results, "LEFT")) == [victim], results
    err = lines(results, "ERR")
    assert sorted(err) == sorted({0, 1, 2} - {victim}), results
    for text in err.values():
        assert text.startswith("ShutdownError"), text


# ---- 2 hosts x 2 ranks: host 0 = ranks 0, 1 (leader 1), host 1 = ranks 2, 3 (leader 2) --------

def run22(case: str, *args: str, **env: str) -> list[tuple[int, str]]:
    return run(case, 4, *args, per_host=2, **env)


def test_2x2_hits_reach_rank0_from_the_leaders_only() -> None:
    results = run22("hits")
    ok = lines(results, "OK")
    assert sorted(ok) == [0, 1, 2, 3], results
    infos = {r: json.loads(v) for r, v in ok.items()}
    assert all(i["cache"] and i["leaders"] == [1, 2] for i in infos.values()), infos
    assert all(i["slots_after"] == 6 for i in infos.values()), infos
    assert all(i["hits"] == 29 + 25 + 1 for i in infos.values()), infos
    assert infos[0]["marks_from"] == [1, 2], infos[0]  # no rank's own marks at rank 0


def test_2x2_mismatch_fails_on_every_rank_with_the_coordinators_message() -> None:
    err = lines(run22("mismatch"), "ERR")
    assert sorted(err) == [0, 1, 2, 3], err
    assert len(set(err.values())) == 1, err
    assert "Mismatched ALLREDUCE tensor shapes" in err[0] and "ranks [1] had [5]" in err[0], err[0]


def test_2x2_stall_names_the_missing_rank() -> None:
    results = run22("stall", HORA_STALL_CHECK_TIME_SECONDS="1",
                    HORA_STALL_SHUTDOWN_TIME_SECONDS="3")
    assert "Missing ranks:\n3: [allreduce.s]" in results[0][1], results[0][1]
    stalled = lines(results, "STALLED")
    assert sorted(stalled) == [0, 1, 2], results
    for text in stalled.values():
        assert "never by ranks [3]" in text, text
    assert sorted(lines(results, "OK")) == [0, 1, 2, 3], results


def test_2x2_stall_on_every_host_names_the_missing_ranks() -> None:
    """No host completes the round and nobody waits (no wait reports): each leader's patience
    tells rank 0 (``cstall``), whose stall inspector then names the late ranks."""
    results = run22("stall_every_host", HORA_STALL_CHECK_TIME_SECONDS="1")
    assert "Missing ranks:\n1: [allreduce.s]\n3: [allreduce.s]" in results[0][1], results[0][1]
    assert sorted(lines(results, "OK")) == [0, 1, 2, 3], results


def test_2x2_deadlock_fails_on_every_rank() -> None:
    err = lines(run22("deadlock"), "ERR")
    assert sorted(err) == [0, 1, 2, 3], err
    for text in err.values():
        assert text.startswith("DeadlockError") and "rank 0 waits in allreduce.a" in text, text


def test_2x2_join() -> None:
    ok = lines(run22("join"), "OK")
    assert sorted(ok) == [0, 1, 2, 3], ok
    assert len({json.loads(v)["last_joined"] for v in ok.values()}) == 1, ok


@pytest.mark.parametrize("victim", [3, 2], ids=["a rank", "its host's leader"])
def test_2x2_death_between_marking_and_deciding_fails_the_others(victim: int) -> None:
    results = run22("marked_death", str(victim))
    err = lines(results, "ERR")
    assert sorted(err) == sorted({0, 1, 2, 3} - {victim}), results
    for text in err.values():
        assert f"rank {victim}" in text, text


@pytest.mark.parametrize("victim", [3, 2, 1], ids=["a rank", "a leader", "rank 0's leader"])
def test_2x2_a_rank_leaving_early_is_a_clean_shutdown(victim: int) -> None:
    """A rank (or a host's leader: the relay ends, its ranks hear rank 0 directly) calls
    shutdown() while the others go on: their next op fails with ShutdownError, never with a
    lost connection, and nothing hangs."""
    results = run22("early_exit", str(victim))
    assert sorted(lines(results, "LEFT")) == [victim], results
    err = lines(results, "ERR")
    assert sorted(err) == sorted({0, 1, 2, 3} - {victim}), results
    for text in err.values():
        assert text.startswith("ShutdownError"), text
