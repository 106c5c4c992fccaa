"""The ``hora`` command line: ``hora run``, ``hora check``, ``hora timeline``, ``hora clean``,
``hora --version``.

Runner layer (imports only base layers, rendezvous and the runner). ``hora run`` accepts every
``horovodrun`` flag with the same meaning; the tunable flags are generated from the knob table
(:data:`hora.config.KNOBS`) by :mod:`hora.runner.run_flags`, which builds the parser. Here a
given knob flag is exported to the ranks as the knob's ``HORA_*`` variable, and a
``--config-file`` (YAML, horovodrun's sections) fills in knobs the command line did not give.

The flow is flags -> :class:`~hora.runner.launch.LaunchSpec` -> :func:`~hora.runner.launch.launch`.
Usage errors exit 2 with a message; otherwise the exit status is the job's.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from hora._util.net import interface_names, local_hostname
from hora.config import KNOBS, KNOBS_BY_NAME, cli_value_to_env
from hora.errors import ConfigError, HoraError
from hora.runner import check
from hora.runner.config_file import read_config_file
from hora.runner.elastic.driver import run_elastic
from hora.runner.elastic.options import ElasticOptions, elastic_options
from hora.runner.launch import (
    IDENTITY_VARS,
    HostSlots,
    LaunchSpec,
    launch,
    parse_hostfile,
    parse_hosts,
)
from hora.runner.local import say
from hora.runner.run_flags import PROG, build_run_parser

_ELASTIC_ONLY: tuple[tuple[str, str], ...] = (
    ("max_np", "--max-np"), ("slots_per_host", "--slots-per-host"),
    ("reset_limit", "--reset-limit"), ("blacklist_cooldown_range", "--blacklist-cooldown-range"),
)


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_JSRUN_HINT = ("hora has no jsrun launcher mode. Start the ranks with `hora run -np N ...` on "
               "one host, or with mpirun / srun directly (no hora run needed).")

_TOP_HELP = f"""\
usage: {PROG} <command> [options]

Distributed data-parallel training with Horovod's API, in pure Python.

commands:
  run      launch a job:               {PROG} run -np 4 python train.py
                                       {PROG} run -np 8 -H a:4,b:4 python train.py
  check    show frameworks, transports and launchers (also: {PROG} run --check-build)
  timeline summarize a timeline file:  {PROG} timeline timeline.json
  clean    remove shared memory that exited jobs left in /dev/shm on this host

options:
  -h, --help     show this help and exit
  -v, --version  print hora's version and exit

`{PROG} -np 4 python train.py` (horovodrun's spelling, without `run`) works too.
Run `{PROG} run --help` for the most used options, `{PROG} run --help-all` for every one.
"""


# ---- args -> LaunchSpec ------------------------------------------------------------------------

def _refuse_unsupported(ns: argparse.Namespace, controller: str | None) -> None:
    if not is_elastic(ns):
        given = [flag for dest, flag in _ELASTIC_ONLY if getattr(ns, dest) is not None]
        if given and given != ["--max-np"]:  # horovodrun ignores --max-np alone
            raise ConfigError(f"{', '.join(given)} only apply to elastic mode: add --min-np N "
                              "or --host-discovery-script SCRIPT")
    if ns.jsrun:
        raise ConfigError(_JSRUN_HINT)


def _knob_values(ns: argparse.Namespace) -> dict[str, Any]:
    values = {k.name: getattr(ns, f"knob_{k.name}", None) for k in KNOBS}
    if ns.deprecated_log_hide is not None:
        say("--log-hide-timestamp / --no-log-hide-timestamp are deprecated; use "
            "--log-without-timestamp / --log-with-timestamp.")
        if values["log_hide_time"] is None:
            values["log_hide_time"] = ns.deprecated_log_hide
    return {name: value for name, value in values.items() if value is not None}


def _interfaces(ns: argparse.Namespace) -> list[str]:
    names: list[str] = []
    for item in [ns.network_interfaces or ""] + (ns.network_interface or []):
        names += [n.strip() for n in item.split(",") if n.strip()]
    known = interface_names()
    for name in names:
        if name not in known:
            raise ConfigError(f"network interface {name!r} does not exist on "
                              f"{local_hostname()}; available: {', '.join(known)}")
    return list(dict.fromkeys(names))


def _forwarded(items: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not _ENV_NAME.match(name):
            raise ConfigError(f"-x {item!r}: {name!r} is not an environment variable name")
        if name in IDENTITY_VARS:
            raise ConfigError(f"-x {item!r}: hora run sets {name} for each rank itself")
        if sep:
            env[name] = value
        elif name in os.environ:
            env[name] = os.environ[name]
        else:
            say(f"warning: -x {name}: {name} is not set here, so there is nothing to forward.")
    return env


def spec_from_args(ns: argparse.Namespace) -> LaunchSpec:
    """Turn parsed ``hora run`` arguments into a :class:`LaunchSpec`.

    Raises:
        ConfigError: a usage error (missing -np or command, unsupported mode, bad host list,
            bad config file, unknown network interface, bad -x).
    """
    knobs = _knob_values(ns)
    controller = None
    if ns.config_file is not None:
        from_file, controller = read_config_file(ns.config_file)
        knobs = {**from_file, **knobs}  # the command line wins (horovodrun semantics)
    _refuse_unsupported(ns, controller)
    if ns.np is None and is_elastic(ns):
        ns.np = ns.min_np or 1
    if ns.np is None:
        raise ConfigError("-np/--num-proc N is required")
    command = list(ns.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("no command given: hora run -np N <command> [args ...]")

    env = _forwarded(ns.env_vars or [])
    if ns.mpi or (controller == "mpi" and not ns.gloo):  # horovodrun --mpi: run under MPI
        plane = knobs.setdefault("data_plane", "mpi")
        if plane != "mpi":
            raise ConfigError(f"--mpi runs the job under mpirun with the mpi data plane, but "
                              f"--data-plane {plane} asks for another: give only one of them")
    if ns.tcp:
        env["NCCL_IB_DISABLE"] = "1"
    interfaces = _interfaces(ns)
    if interfaces:
        env["HORA_GLOO_IFACE"] = interfaces[0]
        env["NCCL_SOCKET_IFNAME"] = ",".join(interfaces)
    start_timeout = knobs.pop("start_timeout", None)
    for name, value in knobs.items():
        knob = KNOBS_BY_NAME[name]
        env[knob.env] = cli_value_to_env(knob, value)

    hosts: tuple[HostSlots, ...] = ()
    if ns.hosts is not None:
        hosts = parse_hosts(ns.hosts)
    elif ns.hostfile is not None:
        hosts = parse_hostfile(ns.hostfile)
    if knobs.get("data_plane") != "mpi" and os.environ.get("HORA_DATA_PLANE") != "mpi":
        for flag, value in (("--mpi-args", ns.mpi_args), ("--binding-args", ns.binding_args)):
            if value is not None:
                say(f"note: {flag} is ignored: hora run starts the ranks itself; mpirun starts "
                    "them only with the mpi data plane (--data-plane mpi).")
    return LaunchSpec(np=ns.np, command=tuple(command), hosts=hosts, env=env,
                      output_filename=ns.output_filename, verbose=ns.verbose,
                      start_timeout=start_timeout, prefix_timestamp=ns.prefix_timestamp,
                      ssh_port=ns.ssh_port, ssh_identity_file=ns.ssh_identity_file,
                      mpi_args=ns.mpi_args, binding_args=ns.binding_args)


def is_elastic(ns: argparse.Namespace) -> bool:
    """Elastic mode is selected by --min-np or --host-discovery-script (horovodrun's rule)."""
    return ns.min_np is not None or ns.host_discovery_script is not None


def elastic_from_args(ns: argparse.Namespace, spec: LaunchSpec) -> ElasticOptions:
    """The elastic part of ``hora run``'s arguments (checked by :func:`elastic_options`)."""
    cooldown = tuple(ns.blacklist_cooldown_range) if ns.blacklist_cooldown_range else None
    return elastic_options(spec.np, min_np=ns.min_np, max_np=ns.max_np, hosts=spec.hosts,
                           discovery_script=ns.host_discovery_script,
                           slots_per_host=ns.slots_per_host, reset_limit=ns.reset_limit,
                           cooldown_range=cooldown)


# ---- entry points ------------------------------------------------------------------------------

def version_text() -> str:
    """``hora <version>``."""
    return f"{PROG} {check.hora_version()}"


def run_main(argv: Sequence[str]) -> int:
    """``hora run ...``: parse, build the spec, launch; usage errors exit 2."""
    parser = build_run_parser()
    ns = parser.parse_args(list(argv))
    if ns.version:
        print(version_text())
        return 0
    if ns.check_build:
        return check.main([], checklist_first=True)
    try:
        spec = spec_from_args(ns)
        elastic = elastic_from_args(ns, spec) if is_elastic(ns) else None
    except ConfigError as exc:
        parser.error(str(exc))
    try:
        if elastic is not None and "mpi" in (spec.env.get("HORA_DATA_PLANE"),
                                             os.environ.get("HORA_DATA_PLANE")):
            raise ConfigError("the mpi data plane cannot follow an elastic job's changing "
                              "membership (MPI's world is fixed when mpirun starts it); use "
                              "--data-plane builtin or torch with --min-np")
        if elastic is not None:
            return run_elastic(spec, elastic)
        return launch(spec)
    except ConfigError as exc:
        parser.error(str(exc))
    except HoraError as exc:
        say(f"error: {exc}")
        return 1


def timeline_main(argv: Sequence[str]) -> int:
    """``hora timeline FILE ...``: summarize a timeline (see :mod:`hora.timeline.summary`)."""
    from hora.timeline.summary_report import main as summary_main

    return summary_main(argv)


def main(argv: list[str] | None = None) -> int:
    """The ``hora`` console script. Returns the exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        if not args:
            sys.stderr.write(_TOP_HELP)
            return 2
        first = args[0]
        if first in ("-h", "--help", "help"):
            sys.stdout.write(_TOP_HELP)
            return 0
        if first in ("-v", "--version", "version"):
            print(version_text())
            return 0
        if first == "run":
            return run_main(args[1:])
        if first == "check":
            return check.main(args[1:])
        if first == "timeline":
            return timeline_main(args[1:])
        if first == "clean":
            from hora.runner import clean

            return clean.main(args[1:])
        if first in ("-cb", "--check-build"):
            return check.main([], checklist_first=True)
        if first.startswith("-"):  # horovodrun's spelling: hora -np 4 python train.py
            return run_main(args)
        sys.stderr.write(f"{_TOP_HELP}\n{PROG}: error: unknown command {first!r}; to launch "
                         f"it, use: {PROG} run -np N {' '.join(args)}\n")
        return 2
    except SystemExit as exc:  # argparse's --help and usage errors
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        sys.stderr.write(f"{exc.code}\n")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
