"""What a job is and how it starts: :class:`LaunchSpec` and :func:`launch`.

Runner layer. The flow is ``hora run`` flags -> :class:`LaunchSpec` (this module, built by
:mod:`hora.runner.cli`) -> :func:`launch`, which decides *what* every rank gets:

* a slot: ranks are assigned to hosts in the order given, filling each host's slots, and the
  local / cross ranks come from :func:`hora.rendezvous.topology.compute_topology` (Horovod's
  definitions);
* an environment: the launcher's own (minus variables that must not be forwarded), the
  tunables from the spec, then the identity Horovod's gloo launcher exports
  (``HOROVOD_RANK`` ... ``HOROVOD_HOSTNAME``, and the same as ``HORA_*``), the rendezvous
  store's address, and the per-job secret ``HORA_SECRET_KEY`` (environment only: never argv,
  never printed);
* a rendezvous store (:class:`hora.rendezvous.kvstore.KVStoreServer`) served by the launcher
  for the life of the job.

:func:`hora.runner.local.run_local` then runs the processes (with the mpi data plane, ``mpirun``
starts them instead: :mod:`hora.runner.mpi_launch`): ranks on this machine directly,
ranks on other hosts through ``ssh`` (:mod:`hora.runner.ssh`: the hosts are checked first, in
parallel; each remote rank's environment, secret included, travels over ssh's stdin). Host lists
and slot assignment live in :mod:`hora.runner.hosts`, the choice of the store's address in
:mod:`hora.runner.network`.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from hora.config import KNOBS_BY_NAME, Config, cli_value_to_env, load
from hora.errors import ConfigError
from hora.rendezvous.kvstore import KVStoreServer
from hora.rendezvous.topology import Slot, compute_topology, identity_environment
from hora.runner import binding, network, processes, ssh
from hora.runner.hosts import HostSlots, assign_hosts, is_local_host, parse_hostfile, parse_hosts
from hora.runner.local import CONSOLE, Console, RankLaunch, run_local
from hora.runner.mpi_launch import launch_mpi

SECRET_VAR = "HORA_SECRET_KEY"

# Identity and rendezvous variables the launcher sets for each rank. A value inherited from the
# launcher's own environment (e.g. `hora run` inside a rank of another job) is replaced.
IDENTITY_VARS: frozenset[str] = frozenset(
    {f"{p}_{s}" for p in ("HORA", "HOROVOD")
     for s in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
               "HOSTNAME")}
    | {"HORA_RENDEZVOUS_ADDR", "HORA_RENDEZVOUS_PORT", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
       "HOROVOD_GLOO_RENDEZVOUS_PORT", SECRET_VAR, "HORA_JOB_ID", "HORA_LAUNCHER",
       "HORA_LAUNCHER_PID"}
)

# Set for every rank as horovodrun does, unless the launcher's environment sets them (a
# Horovod setting is honoured or refused, never silently replaced: HOROVOD_CPU_OPERATIONS=mpi
# selects the mpi data plane, HOROVOD_CONTROLLER=mpi is refused); ``LaunchSpec.env`` (e.g.
# ``-x``) may override them too.
LAUNCHER_DEFAULTS: Mapping[str, str] = {
    "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "PYTHONUNBUFFERED": "1"}

# Never forwarded to ranks (Horovod's list, §5.4). CUDA_VISIBLE_DEVICES is in Horovod's list
# for *remote* hosts only; local ranks keep it, as they do under horovodrun.
_NOT_FORWARDED = re.compile(r"^(BASH_FUNC_.*|OLDPWD|_HOROVOD_SECRET_KEY)$")
_NOT_FORWARDED_REMOTE = re.compile(r"^.*CUDA_VISIBLE_DEVICES$")


@dataclass(frozen=True)
class LaunchSpec:
    """Everything :func:`launch` needs to start a job. Built by the CLI or by API users.

    Attributes:
        np: number of ranks.
        command: the program and its arguments, run directly (no shell).
        hosts: hosts with slot counts, in rank order; empty means ``localhost:<np>``.
        env: variables set for every rank on top of the launcher's environment (tunables as
            ``HORA_*``, ``-x`` variables). Identity and rendezvous variables are set by
            :func:`launch` and cannot be overridden here.
        output_filename: directory for ``rank.<r>/{stdout,stderr}`` copies of the output.
        verbose: print what the launcher starts and with which variables (never the secret).
        start_timeout: seconds the ranks have to start and meet at the rendezvous; exported as
            ``HORA_START_TIMEOUT`` when set.
        prefix_timestamp: put a time stamp before each relayed output line.
        ssh_port: ``-p``: the ssh port of every remote host.
        ssh_identity_file: ``-i``: the ssh private key for the remote hosts.
        mpi_args: ``--mpi-args``: extra mpirun arguments (the mpi data plane's launch).
        binding_args: ``--binding-args``: mpirun's binding arguments (the same).
    """

    np: int
    command: tuple[str, ...]
    hosts: tuple[HostSlots, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    output_filename: str | None = None
    verbose: bool = False
    start_timeout: float | None = None
    prefix_timestamp: bool = False
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    mpi_args: str | None = None
    binding_args: str | None = None

    def __post_init__(self) -> None:
        # Accept any sequence for convenience; store immutable tuples.
        object.__setattr__(self, "command", tuple(self.command))
        object.__setattr__(self, "hosts", tuple(self.hosts))
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))


# ---- environment -------------------------------------------------------------------------------

def forwardable_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's variables that ranks inherit: all but Horovod's never-forwarded ones and
    the identity variables the launcher sets itself."""
    return {k: v for k, v in environ.items()
            if not _NOT_FORWARDED.match(k) and k not in IDENTITY_VARS}


def launcher_variables(spec: LaunchSpec,
                       environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables the launcher sets for every rank, before identity, rendezvous and secret.

    ``environ`` is the environment the ranks inherit (default ``os.environ``): a default of
    :data:`LAUNCHER_DEFAULTS` (or one of its ``HORA_*`` names) it sets is left to it.
    """
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in LAUNCHER_DEFAULTS.items()
           if not k.startswith("HOROVOD_")
           or (k not in environ and "HORA_" + k[len("HOROVOD_"):] not in environ)}
    env.update(spec.env)
    if spec.start_timeout is not None:
        env["HORA_START_TIMEOUT"] = cli_value_to_env(
            KNOBS_BY_NAME["start_timeout"], spec.start_timeout)
    env.update({"HORA_LAUNCHER": "hora run", "HORA_LAUNCHER_PID": str(os.getpid())})
    if spec.verbose and not any(k in env or k in os.environ
                                for k in ("HORA_LOG_LEVEL", "HOROVOD_LOG_LEVEL")):
        env["HORA_LOG_LEVEL"] = "info"  # ranks then log choices such as each set's data path
    return env


def validate(spec: LaunchSpec, env: Mapping[str, str]) -> Config:
    if spec.np < 1:
        raise ConfigError(f"-np must be >= 1, not {spec.np}")
    if not spec.command:
        raise ConfigError("no command given; usage: hora run -np N <command> [args...]")
    overridden = sorted(k for k in spec.env if k in IDENTITY_VARS)
    if overridden:
        raise ConfigError(f"{', '.join(overridden)} cannot be set for the ranks: `hora run` "
                          "sets it for each rank itself")
    # One clear error here instead of the same ConfigError from every rank.
    return load(env, strict=True)


# ---- launch ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Remote:
    """How this job reaches the hosts that are not this machine (none: an empty ``hosts``)."""

    hosts: tuple[str, ...]
    options: ssh.SshOptions
    python: str
    grace: float


def store_address(remote: Remote, config: Config) -> network.StoreAddress:
    first: tuple[str, ...] = ()
    if remote.hosts:
        first = (remote.hosts[0] if config.gloo_iface else
                 network.resolve(ssh.ssh_hostname(remote.hosts[0], remote.options)),)
    return network.store_address(first, config.gloo_iface)


def _check_remote_hosts(remote: Remote, address: str, config: Config,
                        console: Console, verbose: bool) -> None:
    """Every remote host must run ranks and reach ``address`` (a probe listener there)."""
    if verbose:
        console.say(f"checking ssh to {len(remote.hosts)} host(s) in parallel: "
                    f"{', '.join(remote.hosts)} (timeout {config.start_timeout:g} s)")
    with socket.create_server((address, 0), family=socket.AF_INET6 if ":" in address
                              else socket.AF_INET) as probe:
        results = ssh.check_hosts(remote.hosts, remote.options, python=remote.python,
                                  connect_back=(address, probe.getsockname()[1]),
                                  iface=config.gloo_iface, timeout=config.start_timeout)
    if verbose:
        console.say("ssh check passed: " + ", ".join(f"{r.host} ({r.seconds:.2f} s)"
                                                      for r in results))


def rank_launch(slot: Slot, env: dict[str, str], spec: LaunchSpec, remote: Remote,
                 gate: ssh.StartGate, config: Config | None = None,
                 place: tuple[int, int] | None = None) -> RankLaunch:
    """A local rank runs ``spec.command`` with ``env``; a remote one runs ssh, and ``env`` (less
    what Horovod never forwards to other hosts) goes over ssh's stdin. With ``config`` the rank
    is bound to its share of its host's cores as ``--cpu-binding`` says
    (:mod:`hora.runner.binding`; on another host hora's agent there binds it): the share of
    ``place`` (slot, slots on the host: an elastic worker's), by default of its local rank."""
    mode = config.cpu_binding if config is not None else "none"
    affinity = config.thread_affinity if config is not None else ""
    where = place if place is not None else (slot.local_rank, slot.local_size)
    if slot.hostname not in remote.hosts:
        cpus = binding.cores_for(mode, affinity, *where)
        return RankLaunch(slot, {**env, **binding.bound_environment(cpus)}, cpus=cpus)
    sent = {k: v for k, v in env.items() if not _NOT_FORWARDED_REMOTE.match(k)}
    request = ssh.rank_request(argv=spec.command, env=sent, cwd=os.getcwd(),
                               grace=remote.grace, rank=slot.rank, host=slot.hostname,
                               job_id=env["HORA_JOB_ID"],
                               cpu_share=where if binding.wanted(mode, affinity) else None)
    # ssh itself runs with the launcher's own environment (agent socket, PATH), never the
    # secret; HORA_JOB_ID is there because the supervisor reads the job id (for its /dev/shm
    # cleanup) from the first rank's environment, which may be this one.
    ssh_env = {**os.environ, "HORA_JOB_ID": env["HORA_JOB_ID"]}
    argv = ssh.rank_argv(slot.hostname, slot.rank, remote.python, remote.options,
                         connected_marker=gate.marker(slot.rank))
    return RankLaunch(slot, ssh_env, argv=argv, stdin=request,
                      before_start=functools.partial(gate.wait_turn, slot.hostname, slot.rank))


def launch(spec: LaunchSpec, *, environ: Mapping[str, str] | None = None,
           console: Console = CONSOLE) -> int:
    """Start the job described by ``spec`` and wait for it.

    Args:
        spec: the job.
        environ: the environment ranks inherit (default ``os.environ``).
        console: where output and launcher messages go.

    Returns:
        The job's exit status: 0 if every rank exited 0; the first failing rank's exit code
        (128 + N for signal N; a remote rank killed by signal N also gives 128 + N); 128 + N if
        the launcher got signal N (130 for Ctrl-C).

    Raises:
        ConfigError: the spec cannot run (bad -np, no command, too few slots, an unknown
            network interface, no ssh client, an unknown or malformed ``HORA_*`` variable),
            before anything is started.
        HostCheckError: a remote host cannot run ranks (unreachable over ssh, no Python, cannot
            connect back, no such interface); every such host is named.
        RendezvousError: the rendezvous store could not be started.
    """
    inherited = os.environ if environ is None else environ
    own = launcher_variables(spec, inherited)
    base = {**forwardable_environment(inherited), **own}
    config = validate(spec, base)
    slots = compute_topology(assign_hosts(spec.np, spec.hosts))
    remote = Remote(
        hosts=tuple(dict.fromkeys(s.hostname for s in slots if not is_local_host(s.hostname))),
        options=ssh.SshOptions(spec.ssh_port, spec.ssh_identity_file,
                               connect_timeout=min(10.0, config.start_timeout)),
        python=sys.executable, grace=max(0.5, processes.GRACE_PERIOD_S - 1.0))
    if remote.hosts:
        ssh.ssh_program()  # no ssh client: a clear error before anything starts
        key = spec.ssh_identity_file
        if key is not None and not os.path.isfile(key):
            raise ConfigError(f"-i/--ssh-identity-file {key!r}: no such file")
    where = store_address(remote, config)
    if spec.output_filename is not None:
        try:
            Path(spec.output_filename).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--output-filename {spec.output_filename!r}: cannot create the "
                              f"directory: {exc.strerror or exc}") from None
    if config.data_plane == "mpi":  # one MPI job: mpirun starts the ranks (mpi_launch)
        asked = next((f"{v}=mpi" for v in ("HORA_CPU_OPERATIONS", "HOROVOD_CPU_OPERATIONS")
                      if base.get(v) == "mpi"), None)
        if asked is not None and "HORA_DATA_PLANE" not in base:
            console.say(f"{asked}: the ranks start under mpirun and their tensors move over MPI "
                        "(the mpi data plane, as with --mpi).")
        hosts = ",".join(f"{h.host}:{h.slots}" for h in spec.hosts) or None
        return launch_mpi(spec.np, spec.command, base, where.address, hosts=hosts,
                          mpi_args=spec.mpi_args, binding_args=spec.binding_args,
                          ssh_port=spec.ssh_port, ssh_identity_file=spec.ssh_identity_file,
                          output_dir=spec.output_filename, prefix_timestamp=spec.prefix_timestamp,
                          verbose=spec.verbose, console=console)
    secret = secrets.token_hex(32)
    server = KVStoreServer(bytes.fromhex(secret), where.address, 0).start()
    try:
        rendezvous = {"HORA_RENDEZVOUS_ADDR": server.host, "HORA_RENDEZVOUS_PORT": str(server.port),
                      "HOROVOD_GLOO_RENDEZVOUS_ADDR": server.host,
                      "HOROVOD_GLOO_RENDEZVOUS_PORT": str(server.port),
                      "HORA_JOB_ID": secrets.token_hex(8)}
        if spec.verbose:
            _describe(spec, slots, {**own, **rendezvous}, where, remote, console)
        if remote.hosts:
            _check_remote_hosts(remote, where.address, config, console, spec.verbose)
        with ssh.StartGate(timeout=remote.options.connect_timeout + 5.0) as gate:
            ranks = [rank_launch(slot, {**base, **rendezvous, **identity_environment(slot),
                                         SECRET_VAR: secret}, spec, remote, gate,
                                 config)
                     for slot in slots]
            return run_local(spec.command, ranks, output_dir=spec.output_filename,
                             prefix_timestamp=spec.prefix_timestamp, console=console)
    finally:
        server.close()


def _describe(spec: LaunchSpec, slots: Sequence[Slot], env: Mapping[str, str],
              where: network.StoreAddress, remote: Remote, console: Console) -> None:
    """--verbose: what is started, with which variables. The secret is never shown."""
    nic = f" on {where.interface}" if where.interface else ""
    store = (f"rendezvous store: {env['HORA_RENDEZVOUS_ADDR']}:{env['HORA_RENDEZVOUS_PORT']}"
             f"{nic}: {where.reason} (authenticated with a per-job secret passed to ranks in "
             f"${SECRET_VAR})")
    lines = [store,
             f"command: {shlex.join(spec.command)}",
             "variables set for every rank: " + " ".join(
                 f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k != SECRET_VAR)]
    if remote.hosts:
        lines.append(f"remote hosts (over ssh): {', '.join(remote.hosts)}; their ranks get the "
                     f"variables over ssh's stdin and run {remote.python} in {os.getcwd()}")
    for slot in slots:
        ident = identity_environment(slot)
        how = (" via " + shlex.join(ssh.rank_argv(slot.hostname, slot.rank, remote.python,
                                                  remote.options))
               if slot.hostname in remote.hosts else "")
        lines.append(f"rank {slot.rank}: " + " ".join(
            f"{k}={shlex.quote(v)}" for k, v in ident.items() if k.startswith("HOROVOD_")) + how)
    if spec.output_filename is not None:
        lines.append(f"copying output to {spec.output_filename}/rank.<r>/{{stdout,stderr}}")
    console.say("\n".join(lines))


__all__ = [
    "IDENTITY_VARS",
    "HostSlots",
    "LaunchSpec",
    "assign_hosts",
    "forwardable_environment",
    "identity_environment",
    "is_local_host",
    "launch",
    "launcher_variables",
    "parse_hostfile",
    "parse_hosts",
]
