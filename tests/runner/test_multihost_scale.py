"""Connections across real hosts (network namespaces with sshd, as test_multihost.py): a rank
holds its ring neighbours, host leaders and rank 0's control connection, not a full mesh; an
alltoall opens the others on first use, across hosts, and gets the right result."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .helpers import PY, Launcher, clean_env

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _netns  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

WORKER = str(Path(__file__).with_name("multihost_scale_worker.py"))


@pytest.fixture(scope="module")
def cluster() -> Iterator[_netns.Cluster]:
    reason = _netns.unavailable(ssh=True)
    if reason is not None:
        pytest.skip(f"multi-host tests need network namespaces and sshd: {reason}")
    with _netns.Cluster(3) as made:
        yield made


def test_connections_scale_and_open_on_first_use(cluster: _netns.Cluster,
                                                 tmp_path: Path) -> None:
    hosts = ",".join(f"{h.address}:2" for h in cluster.hosts)  # 6 ranks, 3 hosts x 2
    argv = cluster.hosts[0].argv(PY, "-m", "hora.runner", "run", "-p", str(_netns.SSH_PORT),
                                 "-i", cluster.identity, "-np", "6", "-H", hosts, PY, WORKER)
    env = clean_env(HORA_HIERARCHICAL_ALLREDUCE="0")  # the flat ring: neighbours only
    env["PATH"] = f"{cluster.ssh_bin}:{env['PATH']}"
    with Launcher(argv=argv, env=env, cwd=tmp_path) as launcher:
        result = launcher.wait(60)
    assert result.rc == 0, result.err[-3000:]
    rows = {}
    for lines in result.lines().values():
        for line in lines:
            if line.startswith("{"):
                row = json.loads(line)
                rows[row["rank"]] = row
    assert sorted(rows) == list(range(6))
    for rank, row in rows.items():
        leader = rank % 2 == 0  # ranks 0, 2, 4 lead hosts 0, 1, 2
        assert row["start"] == [4 if leader else 2, 5 if rank == 0 else 1], row
        # a small allreduce is recursive doubling: on 6 ranks, 2 <-> 5 is opened for it
        assert row["start"][0] <= row["ring"][0] <= row["after"][0]
        assert row["after"][0] == 5, row  # the alltoall reached every other rank
        assert row["sum_ok"] and row["a2a_ok"], row


CACHE_WORKER = str(Path(__file__).parents[1] / "integration" / "cross_cache_worker.py")


def _job(cluster: _netns.Cluster, tmp_path: Path, case: str,
         per_host: int = 1) -> dict[str, dict[int, str]]:
    hosts = cluster.hosts[:2] if per_host > 1 else cluster.hosts  # 3 x 1 or 2 x per_host
    slots = ",".join(f"{h.address}:{per_host}" for h in hosts)
    argv = cluster.hosts[0].argv(PY, "-m", "hora.runner", "run", "-p", str(_netns.SSH_PORT),
                                 "-i", cluster.identity, "-np", str(len(hosts) * per_host),
                                 "-H", slots, PY, CACHE_WORKER, case)
    env = clean_env()
    env["PATH"] = f"{cluster.ssh_bin}:{env['PATH']}"
    with Launcher(argv=argv, env=env, cwd=tmp_path) as launcher:
        result = launcher.wait(60)
    assert result.rc == 0, result.err[-3000:]
    found: dict[str, dict[int, str]] = {"OK": {}, "ERR": {}}
    for lines in result.lines().values():
        for line in lines:
            head, _, rest = line.partition(" ")
            if head in found:
                rank, _, text = rest.partition(" ")
                found[head][int(rank)] = text
    return found


def test_response_cache_across_hosts(cluster: _netns.Cluster, tmp_path: Path) -> None:
    """A named allreduce repeated across 3 hosts agrees through the cache (no requests), and a
    mismatch on a cached name fails on every rank with the coordinator's message."""
    ok = _job(cluster, tmp_path, "hits")["OK"]
    assert sorted(ok) == [0, 1, 2], ok
    for text in ok.values():
        info = json.loads(text)
        assert info["cache"] and info["hits"] == 29 + 25 + 1, info
    err = _job(cluster, tmp_path, "mismatch")["ERR"]
    assert sorted(err) == [0, 1, 2] and len(set(err.values())) == 1, err
    assert "Mismatched ALLREDUCE tensor shapes" in err[0], err


def test_response_cache_two_ranks_per_host(cluster: _netns.Cluster, tmp_path: Path) -> None:
    """2 hosts x 2 ranks: each host's leader combines its ranks' marks over the host's links
    (abstract Unix sockets, one namespace per host) and relays rank 0's messages; rank 0
    hears marks from the leaders only, and a mismatch still fails everywhere alike."""
    ok = _job(cluster, tmp_path, "hits", per_host=2)["OK"]
    assert sorted(ok) == [0, 1, 2, 3], ok
    infos = {rank: json.loads(text) for rank, text in ok.items()}
    for info in infos.values():
        assert info["cache"] and info["hits"] == 29 + 25 + 1 and info["leaders"] == [1, 2], info
    assert infos[0]["marks_from"] == [1, 2], infos[0]
    err = _job(cluster, tmp_path, "mismatch", per_host=2)["ERR"]
    assert sorted(err) == [0, 1, 2, 3] and len(set(err.values())) == 1, err
    assert "Mismatched ALLREDUCE tensor shapes" in err[0], err
