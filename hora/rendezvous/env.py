"""Who am I, and where is the rendezvous? Launcher-environment detection.

:func:`detect` reads the environment a launcher left for this process and returns a
:class:`WorldInfo`: rank, size, whatever topology the launcher states, the rendezvous store's
address, the job secret, and whether this process must serve the store itself. Sources, first
match wins:

1. ``hora run`` — ``HORA_RANK``/``HOROVOD_RANK``, ``*_SIZE``, ``*_LOCAL_RANK``, ``*_LOCAL_SIZE``,
   ``*_CROSS_RANK``, ``*_CROSS_SIZE``, ``HORA_HOSTNAME``/``HOROVOD_HOSTNAME``,
   ``HORA_RENDEZVOUS_ADDR``/``PORT`` (aliases ``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``PORT``) and the
   hex secret ``HORA_SECRET_KEY``. The launcher serves the store.
2. Open MPI (``OMPI_COMM_WORLD_*``) or MPICH / Intel MPI (``PMI_RANK``, ``PMI_SIZE``,
   ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``) — rank 0 serves the store.
3. Slurm ``srun`` (``SLURM_PROCID`` inside a job step) — rank 0 serves the store on the first
   host of the step's node list.
4. ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
   ``MASTER_PORT``) — rank 0 serves the store on ``MASTER_ADDR`` at ``MASTER_PORT + 1``.
5. Nothing — a single process (``launcher == "single"``), no store.

Without ``hora run`` the store address defaults as follows: ``HORA_RENDEZVOUS_ADDR`` /
``HORA_RENDEZVOUS_PORT`` when set; otherwise 127.0.0.1 for single-host jobs, the first Slurm node,
or ``MASTER_ADDR``; the port is derived from the launcher's job id (hashed into 20000-59999) so
that every rank computes the same one without talking. When ``HORA_LAUNCHER`` is set (``hora run``
exports it, also when it drives mpirun), a hora launcher serves the store and rank 0 does not.

**The secret without hora run.** ``HORA_SECRET_KEY`` (hex) when exported, which is recommended.
Otherwise it is *derived from the launcher's job identifiers*, which every rank can compute. That
derived secret only prevents accidental cross-talk between jobs (e.g. a stale rank of an earlier
run connecting to a new store); anyone who can read the job's environment can compute it, so it is
no defence against an attacker on the network. Export ``HORA_SECRET_KEY`` (e.g.
``mpirun -x HORA_SECRET_KEY=$(python -c 'import secrets; print(secrets.token_hex(32))')``) when the
network is shared.

:func:`hora.rendezvous.store_bootstrap.bootstrap` turns a :class:`WorldInfo` into a connected
store client (and server, when this rank hosts it); :mod:`hora.rendezvous.slurm_lists` expands
Slurm's host and task lists. Topology fields the launcher does not state stay None; the caller
computes them from every rank's host name with :func:`hora.rendezvous.topology.compute_topology`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from hora._util.log import get_logger
from hora._util.net import local_hostname
from hora.errors import RendezvousError
from hora.rendezvous.slurm_lists import expand_nodelist, expand_tasks_per_node

log = get_logger(__name__)

LAUNCHERS = ("hora", "mpirun", "slurm", "torchrun", "single")
PORT_RANGE = (20000, 32768)
"""Derived store ports fall in ``[low, high)``: above the common service ports, below Linux's
default ephemeral range (32768-60999, ``net.ipv4.ip_local_port_range``), from which outgoing
connections take their local ports: a derived port inside it could be held by any busy
connection of the host when rank 0 binds it."""


@dataclass(frozen=True)
class WorldInfo:
    """What the environment says about this process's place in the job.

    Attributes:
        rank: global rank.
        size: number of ranks.
        local_rank: index among ranks on this host, or None if the launcher does not say.
        local_size: ranks on this host, or None.
        cross_rank: index of this host among hosts with this local rank (Horovod's definition),
            or None.
        cross_size: number of such hosts, or None.
        hostname: this process's host identity (launcher-provided or the OS host name).
        launcher: ``"hora"``, ``"mpirun"``, ``"slurm"``, ``"torchrun"`` or ``"single"``.
        store_host: the rendezvous store's address, or None when there is no store.
        store_port: the store's port, or None.
        secret: the job secret (never printed: excluded from ``repr``).
        serve_store: True when this process must host the store itself (rank 0 when no hora
            launcher serves it).
    """

    rank: int
    size: int
    local_rank: int | None
    local_size: int | None
    cross_rank: int | None
    cross_size: int | None
    hostname: str
    launcher: str
    store_host: str | None
    store_port: int | None
    secret: bytes = field(repr=False)
    serve_store: bool = False


# ---- parsing helpers ---------------------------------------------------------------------------

def _first(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = env.get(name)
        if value is not None and value.strip() != "":
            return name, value.strip()
    return None


def _int(env: Mapping[str, str], *names: str, required: bool = False,
         minimum: int = 0) -> int | None:
    found = _first(env, names)
    if found is None:
        if required:
            raise RendezvousError(
                f"{' / '.join(names)} is not set; the launcher did not say this process's "
                "place in the job"
            )
        return None
    name, raw = found
    try:
        value = int(raw)
    except ValueError:
        raise RendezvousError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise RendezvousError(f"{name}={raw!r} must be >= {minimum}")
    return value


def _check_index(env: Mapping[str, str], index: int | None, index_names: tuple[str, ...],
                 count: int | None, count_names: tuple[str, ...]) -> None:
    if index is not None and count is not None and index >= count:
        iname = (_first(env, index_names) or (index_names[0], ""))[0]
        cname = (_first(env, count_names) or (count_names[0], ""))[0]
        raise RendezvousError(f"{iname}={index} is not smaller than {cname}={count}")


def _hostname(env: Mapping[str, str], *extra: str) -> str:
    found = _first(env, ("HORA_HOSTNAME", "HOROVOD_HOSTNAME", *extra))
    return found[1] if found else local_hostname()


def _secret_from_env(env: Mapping[str, str]) -> bytes | None:
    raw = env.get("HORA_SECRET_KEY")
    if raw is None or raw.strip() == "":
        return None
    try:
        secret = bytes.fromhex(raw.strip())
    except ValueError:
        raise RendezvousError(
            "HORA_SECRET_KEY is not a hex string (its value is not shown); generate one with "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`"
        ) from None
    if not secret:
        raise RendezvousError("HORA_SECRET_KEY is empty")
    return secret


def derive_secret(*job_ids: str) -> bytes:
    """A secret every rank of a job computes alike from its launcher's job identifiers.

    Guards against accidental cross-job connections only; see the module docstring.
    """
    return hashlib.sha256(b"hora-derived-secret\0" + "\0".join(job_ids).encode()).digest()


def derive_port(*job_ids: str) -> int:
    """A port in :data:`PORT_RANGE` every rank of a job computes alike from its job ids."""
    digest = hashlib.sha256(b"hora-port\0" + "\0".join(job_ids).encode()).digest()
    low, high = PORT_RANGE
    return low + int.from_bytes(digest[:8], "big") % (high - low)


# ---- per-launcher detection --------------------------------------------------------------------

_HORA_IDS = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")


def _names(suffix: str) -> tuple[str, str]:
    return f"HORA_{suffix}", f"HOROVOD_{suffix}"


def _from_hora(env: Mapping[str, str]) -> WorldInfo:
    rank, size, local_rank, local_size, cross_rank, cross_size = (
        _int(env, *_names(s), required=s in ("RANK", "SIZE"), minimum=0 if "RANK" in s else 1)
        for s in _HORA_IDS
    )
    assert rank is not None and size is not None
    _check_index(env, rank, _names("RANK"), size, _names("SIZE"))
    _check_index(env, local_rank, _names("LOCAL_RANK"), local_size, _names("LOCAL_SIZE"))
    _check_index(env, cross_rank, _names("CROSS_RANK"), cross_size, _names("CROSS_SIZE"))
    hostname = _hostname(env)
    addr = _first(env, ("HORA_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_ADDR"))
    if addr is None:
        if size > 1:
            raise RendezvousError(
                f"HORA_RANK/HOROVOD_RANK say this is rank {rank} of {size}, but "
                "HORA_RENDEZVOUS_ADDR is not set, so the ranks cannot find each other. HINT: "
                "start the job with `hora run -np N ...`."
            )
        return WorldInfo(rank, size, local_rank, local_size, cross_rank, cross_size, hostname,
                         "hora", None, None, b"", False)
    port = _int(env, "HORA_RENDEZVOUS_PORT", "HOROVOD_GLOO_RENDEZVOUS_PORT", required=True,
                minimum=1)
    assert port is not None
    secret = _secret_from_env(env)
    if secret is None:
        raise RendezvousError(
            f"this process was started with {addr[0]} (a horovodrun-style launch), but "
            "HORA_SECRET_KEY is not set: hora authenticates every connection with a per-job "
            "secret. HINT: launch with `hora run` instead of horovodrun, or export "
            "HORA_SECRET_KEY (hex) to every rank and to the store."
        )
    return WorldInfo(rank, size, local_rank, local_size, cross_rank, cross_size, hostname,
                     "hora", addr[1], port, secret, False)


def _job_id(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    found = _first(env, names)
    return f"{found[0]}={found[1]}" if found else None


def _foreign(env: Mapping[str, str], launcher: str, rank: int, size: int,
             local_rank: int | None, local_size: int | None, cross_rank: int | None,
             cross_size: int | None, hostname: str, job_id: str | None, default_host: str | None,
             multi_host_hint: str) -> WorldInfo:
    """WorldInfo for launchers that run no store: rank 0 serves it unless a hora launcher does."""
    addr_var = _first(env, ("HORA_RENDEZVOUS_ADDR",))
    port = _int(env, "HORA_RENDEZVOUS_PORT", minimum=1)
    single_host = local_size is not None and local_size == size
    host = addr_var[1] if addr_var else ("127.0.0.1" if single_host else default_host)
    if host is None:
        raise RendezvousError(
            f"{launcher} started rank {rank} of {size} on several hosts (or did not say which), "
            "and hora cannot tell where rank 0 runs to reach its rendezvous store. HINT: export "
            f"HORA_RENDEZVOUS_ADDR=<address of rank 0's host> to every rank, e.g. "
            f"{multi_host_hint}"
        )
    if job_id is None:
        if not single_host:
            raise RendezvousError(
                f"{launcher} provides no job id hora can derive a store port from. HINT: export "
                "HORA_RENDEZVOUS_PORT=<free port on rank 0's host> (and HORA_SECRET_KEY) to "
                "every rank."
            )
        job_id = f"ppid={os.getppid()}"  # all ranks of a single-host job share their parent
    if port is None:
        port = derive_port(launcher, job_id)
    secret = _secret_from_env(env)
    if secret is None:
        secret = derive_secret(launcher, job_id, str(size), host, str(port))
    serve = rank == 0 and size > 1 and "HORA_LAUNCHER" not in env
    return WorldInfo(rank, size, local_rank, local_size, cross_rank, cross_size, hostname,
                     launcher, host, port, secret, serve)


def _from_mpi(env: Mapping[str, str]) -> WorldInfo:
    if "OMPI_COMM_WORLD_RANK" in env:
        names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE")
        job_keys: tuple[str, ...] = ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid",
                                     "PMIX_NAMESPACE", "OMPI_MCA_orte_hnp_uri")
    else:
        names = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
        job_keys = ("PMI_KVSNAME", "PMIX_NAMESPACE", "I_MPI_HYDRA_JOBID")
    rank = _int(env, names[0], required=True)
    size = _int(env, names[1], required=True, minimum=1)
    local_rank = _int(env, names[2])
    local_size = _int(env, names[3], minimum=1)
    assert rank is not None and size is not None
    _check_index(env, rank, names[:1], size, names[1:2])
    _check_index(env, local_rank, names[2:3], local_size, names[3:4])
    return _foreign(env, "mpirun", rank, size, local_rank, local_size, None, None,
                    _hostname(env), _job_id(env, job_keys), None,
                    "`mpirun -x HORA_RENDEZVOUS_ADDR=<host of rank 0> ...`.")


def _from_slurm(env: Mapping[str, str]) -> WorldInfo:
    rank = _int(env, "SLURM_PROCID", required=True)
    size = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", required=True, minimum=1)
    local_rank = _int(env, "SLURM_LOCALID")
    node_id = _int(env, "SLURM_NODEID")
    assert rank is not None and size is not None
    _check_index(env, rank, ("SLURM_PROCID",), size, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"))
    local_size: int | None = None
    per_node = _first(env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    if per_node is not None and node_id is not None:
        counts = expand_tasks_per_node(per_node[1], per_node[0])
        if node_id >= len(counts):
            raise RendezvousError(f"SLURM_NODEID={node_id} is out of range for "
                                  f"{per_node[0]}={per_node[1]!r}")
        local_size = counts[node_id]
    elif "SLURM_NTASKS_PER_NODE" in env:
        local_size = _int(env, "SLURM_NTASKS_PER_NODE", minimum=1)
    _check_index(env, local_rank, ("SLURM_LOCALID",), local_size,
                 ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"))
    nodelist = _first(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    nodes = expand_nodelist(nodelist[1], nodelist[0]) if nodelist else []
    if len(nodes) == 1:
        local_size = size if local_size is None else local_size
    first = "127.0.0.1" if len(nodes) == 1 else (nodes[0] if nodes else None)
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or ""
    job_id = f"slurm={job}.{step}" if job else None
    return _foreign(env, "slurm", rank, size, local_rank, local_size, None, None,
                    _hostname(env, "SLURMD_NODENAME"), job_id, first,
                    "`export HORA_RENDEZVOUS_ADDR=$(hostname)` in the batch script before srun.")


def _from_torchrun(env: Mapping[str, str]) -> WorldInfo:
    rank = _int(env, "RANK", required=True)
    size = _int(env, "WORLD_SIZE", required=True, minimum=1)
    local_rank = _int(env, "LOCAL_RANK")
    local_size = _int(env, "LOCAL_WORLD_SIZE", minimum=1)
    group_rank = _int(env, "GROUP_RANK")
    master_port = _int(env, "MASTER_PORT", required=True, minimum=1)
    assert rank is not None and size is not None and master_port is not None
    _check_index(env, rank, ("RANK",), size, ("WORLD_SIZE",))
    _check_index(env, local_rank, ("LOCAL_RANK",), local_size, ("LOCAL_WORLD_SIZE",))
    cross_rank = cross_size = None
    if local_size is not None and group_rank is not None and size % local_size == 0:
        nodes = _int(env, "GROUP_WORLD_SIZE", minimum=1) or size // local_size
        if nodes * local_size == size and group_rank < nodes:  # homogeneous: node rank = cross
            cross_rank, cross_size = group_rank, nodes
    master = env["MASTER_ADDR"].strip()
    env = dict(env)
    env.setdefault("HORA_RENDEZVOUS_PORT", str(master_port + 1))
    job_id = ":".join(("torchrun", env.get("TORCHELASTIC_RUN_ID", ""), master, str(master_port),
                       env.get("TORCHELASTIC_RESTART_COUNT", "0")))
    return _foreign(env, "torchrun", rank, size, local_rank, local_size, cross_rank, cross_size,
                    _hostname(env), job_id, master,
                    "`HORA_RENDEZVOUS_ADDR=<master host> torchrun ...`.")


def detect(environ: Mapping[str, str] | None = None) -> WorldInfo:
    """Work out this process's place in the job from its launcher's environment.

    Args:
        environ: the environment to read (default ``os.environ``).

    Without ``hora run`` and without ``HORA_SECRET_KEY`` the job secret is derived from the
    launcher's job ids: it stops accidental cross-job connections, not an attacker (anyone who
    can read the job's environment can compute it). Export ``HORA_SECRET_KEY`` on shared
    networks.

    Returns:
        The :class:`WorldInfo`; topology fields the launcher does not state are None.

    Raises:
        RendezvousError: a malformed value (non-integer rank, rank >= size, bad node list,
            non-hex secret), naming the variable; or a launch hora cannot join (a horovodrun
            launch without ``HORA_SECRET_KEY``, a multi-host job without
            ``HORA_RENDEZVOUS_ADDR``), with the remedy.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    if "HORA_RANK" in env or "HOROVOD_RANK" in env:
        info = _from_hora(env)
    elif "OMPI_COMM_WORLD_RANK" in env or ("PMI_RANK" in env and "PMI_SIZE" in env):
        info = _from_mpi(env)
    elif "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        info = _from_slurm(env)  # without a step id this is a batch script, not an srun task
    elif all(v in env for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        info = _from_torchrun(env)
    else:
        info = WorldInfo(0, 1, 0, 1, 0, 1, _hostname(env), "single", None, None,
                         _secret_from_env(env) or b"", False)
    log.debug("environment: %s", info)
    return info


__all__ = ["LAUNCHERS", "WorldInfo", "derive_port", "derive_secret", "detect"]
