"""Hierarchical allgather in real multi-process jobs, several hosts simulated on this machine.

Each rank is started the way an external launcher would (torchrun's variables, no ``hora run``)
with its own ``HORA_HOSTNAME``: ranks with the same name form a host (shared memory between them
is real), ranks with different names talk only over TCP, as across hosts. Every job runs
allgathers with uneven first dimensions over every dtype (``hier_allgather_worker.py``); the
same job runs with ``HORA_HIERARCHICAL_ALLGATHER=1`` and ``=0`` and the results must be the
same bytes (and equal numpy's on every rank).
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from _case_jobs import spawn_ranks

from hora._util.net import free_port
from hora._util.shm_names import job_segments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WORKER = str(Path(__file__).with_name("hier_allgather_worker.py"))
_ids = itertools.count()
SIGN = "hierarchical allgather"  # what a rank logs (INFO) when a set gathers hierarchically


def run(hostnames: list[str], subset: str, directory: Path, hierarchical: bool) -> list[str]:
    """One job; every rank's output. Fails unless every rank printed OK and left no segment."""
    directory.mkdir()
    job = f"hag{os.getpid()}n{next(_ids)}"
    port, store_port = str(free_port()), str(free_port())
    envs = [{"RANK": str(r), "WORLD_SIZE": str(len(hostnames)), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port, "HORA_RENDEZVOUS_PORT": store_port, "HORA_JOB_ID": job,
             "HORA_HOSTNAME": host, "HORA_HIERARCHICAL_ALLGATHER": str(int(hierarchical)),
             "HORA_LOG_LEVEL": "info", "HORA_START_TIMEOUT": "30", "OMP_NUM_THREADS": "1"}
            for r, host in enumerate(hostnames)]
    outs = []
    for rank, (code, out) in enumerate(spawn_ranks([sys.executable, WORKER, str(directory),
                                                    subset], envs, timeout=150)):
        assert code == 0 and f"OK {rank}" in out, f"rank {rank} exited {code}:\n{out}"
        outs.append(out)
    assert job_segments(job) == []
    return outs


@pytest.mark.parametrize(("hostnames", "subset", "subset_hierarchical"), [
    (["a", "a", "b", "b"], "0,1,2", True),  # 2 x 2; the set: 2 + 1 ranks
    (["a", "a", "a", "b"], "1,2,3", True),  # 3 + 1; the set: 2 + 1 ranks
    (["a", "b", "a", "b"], "0,2,3", True),  # 2 x 2, hosts interleaved in rank order
    (["a", "a", "b", "c"], "1,2,3", False),  # 2 + 1 + 1; the set has one rank per host: flat
])
def test_hierarchical_allgather_equals_flat(tmp_path: Path, hostnames: list[str], subset: str,
                                            subset_hierarchical: bool) -> None:
    hier = run(hostnames, subset, tmp_path / "hier", hierarchical=True)
    flat = run(hostnames, subset, tmp_path / "flat", hierarchical=False)
    members = [int(x) for x in subset.split(",")]
    hosts = len(set(hostnames))
    for rank, out in enumerate(hier):
        assert out.count(f"process set of 4 ranks on {hosts} hosts: {SIGN}") == 1, out
        in_set = rank in members and subset_hierarchical
        assert out.count(f"process set of 3 ranks on 2 hosts: {SIGN}") == int(in_set), out
    assert not any(SIGN in out for out in flat), flat
    for rank in range(len(hostnames)):
        with np.load(tmp_path / "hier" / f"rank{rank}.npz") as a, \
                np.load(tmp_path / "flat" / f"rank{rank}.npz") as b:
            assert sorted(a.files) == sorted(b.files)
            for key in a.files:
                assert a[key].tobytes() == b[key].tobytes(), (rank, key)
