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

:func:`hora.runner.local.run_local` then runs the processes. Hosts other than this machine are
refused for now (issue "Launch across hosts").
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from hora._util.net import is_loopback, local_hostname
from hora.config import KNOBS_BY_NAME, cli_value_to_env, load
from hora.errors import ConfigError
from hora.rendezvous.kvstore import KVStoreServer
from hora.rendezvous.topology import Slot, compute_topology
from hora.runner.local import CONSOLE, Console, RankLaunch, run_local

RENDEZVOUS_HOST = "127.0.0.1"
"""Where the launcher serves the rendezvous store for single-host jobs (Horovod: the interface
owning 127.0.0.1)."""

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

# Set for every rank as horovodrun does; ``LaunchSpec.env`` (e.g. ``-x``) may override them.
LAUNCHER_DEFAULTS: Mapping[str, str] = {
    "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "PYTHONUNBUFFERED": "1"}

# Never forwarded to ranks (Horovod's list, §5.4). CUDA_VISIBLE_DEVICES is in Horovod's list
# for *remote* hosts only; local ranks keep it, as they do under horovodrun.
_NOT_FORWARDED = re.compile(r"^(BASH_FUNC_.*|OLDPWD|_HOROVOD_SECRET_KEY)$")

_HOST_ENTRY = re.compile(r"^[\w.-]+(:\d+)?$")


@dataclass(frozen=True)
class HostSlots:
    """A host and how many ranks may run on it."""

    host: str
    slots: int


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
    """

    np: int
    command: tuple[str, ...]
    hosts: tuple[HostSlots, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    output_filename: str | None = None
    verbose: bool = False
    start_timeout: float | None = None
    prefix_timestamp: bool = False

    def __post_init__(self) -> None:
        # Accept any sequence for convenience; store immutable tuples.
        object.__setattr__(self, "command", tuple(self.command))
        object.__setattr__(self, "hosts", tuple(self.hosts))
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))


# ---- hosts -------------------------------------------------------------------------------------

def parse_hosts(text: str) -> tuple[HostSlots, ...]:
    """Parse ``-H``: ``"h1:2,h2:4"``; a host without ``:slots`` has one slot.

    Raises:
        ConfigError: an entry is not ``<hostname>[:<slots>]`` or has 0 slots.
    """
    hosts = []
    for entry in text.split(","):
        entry = entry.strip()
        if not _HOST_ENTRY.match(entry):
            raise ConfigError(
                f"-H/--hosts {text!r}: {entry!r} is not <hostname>:<slots>; expected e.g. "
                "-H localhost:4 or -H host1:2,host2:2")
        host, _, slots = entry.partition(":")
        hosts.append(HostSlots(host, _slot_count(slots or "1", f"-H/--hosts {text!r}")))
    return tuple(hosts)


def parse_hostfile(path: str | os.PathLike[str]) -> tuple[HostSlots, ...]:
    """Parse a host file: lines ``<hostname> slots=<n>`` (``slots`` optional, default 1).

    Blank lines and ``#`` comments are ignored.

    Raises:
        ConfigError: the file cannot be read, a line is malformed, or it lists no host.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"--hostfile {str(path)!r}: cannot read it: {exc.strerror}") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--hostfile {str(path)!r} line {number}"
        slots = "1"
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if not sep or key not in ("slots", "max_slots"):
                raise ConfigError(f"{where}: {line.strip()!r} is not '<hostname> slots=<n>'")
            if key == "slots":
                slots = value
        if not _HOST_ENTRY.match(words[0]) or ":" in words[0]:
            raise ConfigError(f"{where}: {words[0]!r} is not a host name")
        hosts.append(HostSlots(words[0], _slot_count(slots, where)))
    if not hosts:
        raise ConfigError(f"--hostfile {str(path)!r} lists no hosts")
    return tuple(hosts)


def _slot_count(text: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{where}: slots must be a whole number >= 1, not {text!r}")
    return int(text)


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine: ``localhost``, a loopback address, this host's
    name, or a name or address that resolves to one of this host's addresses."""
    name = host.lower()
    if is_loopback(name) or name in ("localhost.localdomain", "ip6-localhost"):
        return True
    me = local_hostname().lower()
    if name in (me, me.split(".")[0]):
        return True
    try:
        theirs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    mine = {"0.0.0.0"}
    try:
        mine.update(socket.gethostbyname_ex(local_hostname())[2])
    except OSError:
        pass
    return any(is_loopback(str(addr)) or addr in mine for addr in theirs)


def assign_hosts(np: int, hosts: Sequence[HostSlots]) -> list[str]:
    """Host of each rank ``0..np-1``: hosts in the given order, each filled to its slots.

    Unlike Horovod's static gloo launcher (which runs a rank on *every* listed slot), exactly
    ``np`` ranks are started.

    Raises:
        ConfigError: fewer slots than ``np``, or a host that is not this machine.
    """
    if not hosts:
        hosts = (HostSlots("localhost", np),)
    total = sum(h.slots for h in hosts)
    if total < np:
        listed = ",".join(f"{h.host}:{h.slots}" for h in hosts)
        raise ConfigError(f"too few slots: -np {np} but the hosts ({listed}) provide only "
                          f"{total}; add slots or lower -np")
    remote = sorted({h.host for h in hosts if not is_local_host(h.host)})
    if remote:
        raise ConfigError(
            f"multi-host launch is not available yet in `hora run` (issue \"Launch across "
            f"hosts\"): {', '.join(remote)} {'is' if len(remote) == 1 else 'are'} not this "
            f"machine ({local_hostname()}). Use localhost / 127.0.0.1 / {local_hostname()} "
            "here; meanwhile ranks on several hosts can be started by mpirun or srun "
            "(e.g. `mpirun -np 8 -H a:4,b:4 -x HORA_RENDEZVOUS_ADDR=a python train.py`).")
    names: list[str] = []
    for host in hosts:
        names += [host.host] * min(host.slots, np - len(names))
    return names


# ---- environment -------------------------------------------------------------------------------

def forwardable_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's variables that ranks inherit: all but Horovod's never-forwarded ones and
    the identity variables the launcher sets itself."""
    return {k: v for k, v in environ.items()
            if not _NOT_FORWARDED.match(k) and k not in IDENTITY_VARS}


def identity_environment(slot: Slot) -> dict[str, str]:
    """``HOROVOD_RANK`` ... ``HOROVOD_HOSTNAME`` exactly as horovodrun's gloo mode, and the
    same values as ``HORA_*``."""
    values = {"RANK": slot.rank, "SIZE": slot.size, "LOCAL_RANK": slot.local_rank,
              "LOCAL_SIZE": slot.local_size, "CROSS_RANK": slot.cross_rank,
              "CROSS_SIZE": slot.cross_size, "HOSTNAME": slot.hostname}
    return {f"{prefix}_{name}": str(value) for prefix in ("HOROVOD", "HORA")
            for name, value in values.items()}


def launcher_variables(spec: LaunchSpec) -> dict[str, str]:
    """Variables the launcher sets for every rank, before identity, rendezvous and secret."""
    env = dict(LAUNCHER_DEFAULTS)
    env.update(spec.env)
    if spec.start_timeout is not None:
        env["HORA_START_TIMEOUT"] = cli_value_to_env(
            KNOBS_BY_NAME["start_timeout"], spec.start_timeout)
    env.update({"HORA_LAUNCHER": "hora run", "HORA_LAUNCHER_PID": str(os.getpid())})
    return env


def _validate(spec: LaunchSpec, env: Mapping[str, str]) -> None:
    if spec.np < 1:
        raise ConfigError(f"-np must be >= 1, not {spec.np}")
    if not spec.command:
        raise ConfigError("no command given; usage: hora run -np N <command> [args...]")
    overridden = sorted(k for k in spec.env if k in IDENTITY_VARS)
    if overridden:
        raise ConfigError(f"{', '.join(overridden)} cannot be set for the ranks: `hora run` "
                          "sets it for each rank itself")
    # One clear error here instead of the same ConfigError from every rank.
    load(env, strict=True)


# ---- launch ------------------------------------------------------------------------------------

def launch(spec: LaunchSpec, *, environ: Mapping[str, str] | None = None,
           console: Console = CONSOLE) -> int:
    """Start the job described by ``spec`` on this host and wait for it.

    Args:
        spec: the job.
        environ: the environment ranks inherit (default ``os.environ``).
        console: where output and launcher messages go.

    Returns:
        The job's exit status: 0 if every rank exited 0; the first failing rank's exit code
        (128 + N for signal N); 128 + N if the launcher got signal N (130 for Ctrl-C).

    Raises:
        ConfigError: the spec cannot run (bad -np, no command, too few slots, a remote host, an
            unknown or malformed ``HORA_*`` variable), before anything is started.
        RendezvousError: the rendezvous store could not be started.
    """
    own = launcher_variables(spec)
    base = {**forwardable_environment(os.environ if environ is None else environ), **own}
    _validate(spec, base)
    slots = compute_topology(assign_hosts(spec.np, spec.hosts))
    if spec.output_filename is not None:
        try:
            Path(spec.output_filename).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--output-filename {spec.output_filename!r}: cannot create the "
                              f"directory: {exc.strerror or exc}") from None
    secret = secrets.token_hex(32)
    server = KVStoreServer(bytes.fromhex(secret), RENDEZVOUS_HOST, 0).start()
    try:
        rendezvous = {"HORA_RENDEZVOUS_ADDR": server.host, "HORA_RENDEZVOUS_PORT": str(server.port),
                      "HOROVOD_GLOO_RENDEZVOUS_ADDR": server.host,
                      "HOROVOD_GLOO_RENDEZVOUS_PORT": str(server.port),
                      "HORA_JOB_ID": secrets.token_hex(8)}
        if spec.verbose:
            _describe(spec, slots, {**own, **rendezvous}, console)
        ranks = [RankLaunch(slot, {**base, **rendezvous, **identity_environment(slot),
                                   SECRET_VAR: secret})
                 for slot in slots]
        return run_local(spec.command, ranks, output_dir=spec.output_filename,
                         prefix_timestamp=spec.prefix_timestamp, console=console)
    finally:
        server.close()


def _describe(spec: LaunchSpec, slots: Sequence[Slot], env: Mapping[str, str],
              console: Console) -> None:
    """--verbose: what is started, with which variables. The secret is never shown."""
    store = (f"rendezvous store: {env['HORA_RENDEZVOUS_ADDR']}:{env['HORA_RENDEZVOUS_PORT']} "
             f"(authenticated with a per-job secret passed to ranks in ${SECRET_VAR})")
    lines = [store,
             f"command: {shlex.join(spec.command)}",
             "variables set for every rank: " + " ".join(
                 f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k != SECRET_VAR)]
    for slot in slots:
        ident = identity_environment(slot)
        lines.append(f"rank {slot.rank}: " + " ".join(
            f"{k}={shlex.quote(v)}" for k, v in ident.items() if k.startswith("HOROVOD_")))
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
