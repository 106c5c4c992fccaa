"""``op=Adasum`` in real multi-process jobs (``adasum_worker.py``), flat and hierarchical.

Each rank is started the way an external launcher would (torchrun's variables) with its own
``HORA_HOSTNAME``: ranks with the same name form a host (real shared memory between them),
ranks with different names talk only over TCP, as across hosts. Every job reduces float16,
float32 and float64 vectors of several sizes and checks them against numpy on every rank.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest
from _case_jobs import spawn_ranks

from hora._util.net import free_port
from hora._util.shm_names import job_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(200)]

WORKER = str(Path(__file__).with_name("adasum_worker.py"))
_ids = itertools.count()


def run(hostnames: list[str], mode: str, **env: str) -> list[tuple[int, str]]:
    """One job; every rank's (exit code, output)."""
    job = f"ada{os.getpid()}n{next(_ids)}"
    port, store_port = str(free_port()), str(free_port())
    envs = [{"RANK": str(r), "WORLD_SIZE": str(len(hostnames)), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port, "HORA_RENDEZVOUS_PORT": store_port, "HORA_JOB_ID": job,
             "HORA_HOSTNAME": host, "HORA_LOG_LEVEL": "info", "HORA_START_TIMEOUT": "30",
             "OMP_NUM_THREADS": "1", **env} for r, host in enumerate(hostnames)]
    results = spawn_ranks([sys.executable, WORKER, ",".join(hostnames), mode], envs,
                          timeout=150)
    assert job_segments(job) == []
    return results


@pytest.mark.parametrize(("hostnames", "mode", "path"), [
    (["a"] * 4, "flat", "shm"),  # one host, 4 ranks: Adasum over every rank
    (["a", "a", "b", "b"], "hier", "shard"),  # 2 hosts x 2: host means, Adasum across hosts
    (["a", "b", "a", "b"], "hier", "shard"),  # the same, hosts interleaved in rank order
    (["a", "a", "b"], "hier", "leader"),  # 3 ranks on 2 hosts: 2 hosts is what counts
])
def test_adasum_matches_numpy(hostnames: list[str], mode: str, path: str) -> None:
    for rank, (code, out) in enumerate(run(hostnames, mode)):
        assert code == 0 and f"OK {rank}" in out, f"rank {rank} exited {code}:\n{out}"
        assert f"data path: {path}" in out, out


def test_hierarchical_allreduce_off_gives_adasum_over_every_rank() -> None:
    results = run(["a", "a", "b", "b"], "flat", HOROVOD_HIERARCHICAL_ALLREDUCE="0")
    for rank, (code, out) in enumerate(results):
        assert code == 0 and f"OK {rank}" in out, f"rank {rank} exited {code}:\n{out}"
        assert "data path: ring" in out, out


@pytest.mark.parametrize(("hostnames", "env", "message"), [
    (["a", "a", "b", "c"], {}, "non-power of 2 nodes is not supported yet: this process set "
                               "spans 3 hosts"),
    (["a", "a", "b"], {"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"},
     "non-power of 2 ranks is not supported yet: this process set has 3 ranks"),
])
def test_refused_on_every_rank(hostnames: list[str], env: dict[str, str], message: str) -> None:
    for rank, (code, out) in enumerate(run(hostnames, "hier", **env)):
        assert code == 0, f"rank {rank} exited {code}:\n{out}"
        assert f"REFUSED {rank} NotImplementedError: Running Adasum with {message}" in out, out
