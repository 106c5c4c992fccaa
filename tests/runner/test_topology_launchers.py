"""srun- and mpirun-started jobs get the topology `hora run -H` gives the same host layout.

For each layout, ``hora run``'s slots (:func:`assign_hosts` + :func:`compute_topology`, exactly
what the launcher exports) are compared with what a rank computes at ``init`` when Slurm or
Open MPI started it: :func:`hora.rendezvous.env.detect` on the environment that launcher gives
each rank (simulated here, block distribution: ``srun --distribution=block``, Open MPI's
``--map-by slot``), topology fields the launcher does not state filled from
:func:`compute_topology` over every rank's host name, as ``hora.core.engine.context.init`` does.
"""

from __future__ import annotations

import pytest

from hora.rendezvous import env as envmod
from hora.rendezvous.env import WorldInfo, detect
from hora.rendezvous.topology import Slot, compute_topology
from hora.runner.hosts import assign_hosts, parse_hosts

FIELDS = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "hostname")
LAYOUTS = [("n1:2,n2:2", 4), ("n1:3,n2:1", 4), ("n1:1,n2:2,n3:3", 6), ("n1:4,n2:4", 6),
           ("n1:2,n2:2,n3:2,n4:2", 8), ("n1:1", 1)]


def hora_run_slots(hosts: str, np: int) -> list[Slot]:
    return compute_topology(assign_hosts(np, parse_hosts(hosts)))


def srun_env(layout: list[str], rank: int) -> dict[str, str]:
    nodes = list(dict.fromkeys(layout))
    counts = [layout.count(n) for n in nodes]
    here = layout[rank]
    return {"SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": str(len(layout)),
            "SLURM_NTASKS": str(len(layout)), "SLURM_NODEID": str(nodes.index(here)),
            "SLURM_LOCALID": str(layout[:rank].count(here)),
            "SLURM_STEP_TASKS_PER_NODE": ",".join(map(str, counts)),
            "SLURM_STEP_NODELIST": f"n[{','.join(n[1:] for n in nodes)}]",
            "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURMD_NODENAME": here}


def mpirun_env(layout: list[str], rank: int) -> dict[str, str]:
    here = layout[rank]
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(len(layout)),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(layout[:rank].count(here)),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(layout.count(here)),
            "OMPI_MCA_ess_base_jobid": "77", "HORA_RENDEZVOUS_ADDR": layout[0]}


def as_init_computes(infos: list[WorldInfo]) -> list[dict[str, object]]:
    """What init() ends up with: stated values, the rest from the ranks' host names."""
    computed = compute_topology([i.hostname for i in infos])
    out = []
    for info, slot in zip(infos, computed):
        row: dict[str, object] = {}
        for name in FIELDS:
            stated = getattr(info, name)
            row[name] = getattr(slot, name) if stated is None else stated
        out.append(row)
    return out


@pytest.mark.parametrize(("hosts", "np"), LAYOUTS)
@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_same_topology_as_hora_run(monkeypatch: pytest.MonkeyPatch, launcher: str, hosts: str,
                                   np: int) -> None:
    slots = hora_run_slots(hosts, np)
    layout = [s.hostname for s in slots]
    make = srun_env if launcher == "srun" else mpirun_env
    infos = []
    for rank in range(np):
        # The OS host name of the node the rank runs on (what Open MPI ranks would see).
        monkeypatch.setattr(envmod, "local_hostname", lambda h=layout[rank]: h)
        infos.append(detect(make(layout, rank)))
    assert {i.launcher for i in infos} == {"slurm" if launcher == "srun" else "mpirun"}
    expected = [{name: getattr(s, name) for name in FIELDS} for s in slots]
    assert as_init_computes(infos) == expected
