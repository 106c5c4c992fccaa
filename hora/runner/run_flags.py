"""``hora run``'s flags: horovodrun's options plus one generated from each knob of the table.

:func:`build_run_parser` builds the ``hora run`` parser: horovodrun's flags, grouped as horovodrun
groups them, and a flag for every knob of :data:`hora.config.KNOBS` that names one (bool knobs
get ``--flag`` / ``--no-flag``; values are validated with :func:`hora.config.parse_value`). What
the parsed flags mean is :func:`hora.runner.cli.spec_from_args`'s business.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, NoReturn

from hora.config import KNOBS, KNOBS_BY_NAME, Knob, accepted_text, check_supported, parse_value
from hora.errors import ConfigError

PROG = "hora"

_GROUPS: tuple[tuple[str, str], ...] = (
    ("general", "general"),
    ("ssh", "ssh (ranks on hosts other than this machine are started over ssh)"),
    ("tunables", "tunables (exported to the ranks as HORA_* variables)"),
    ("autotune", "autotune (rank 0 tunes the fusion threshold and cycle time while training: "
                 "docs/autotune.md)"),
    ("elastic", "elastic training (enabled by --min-np or --host-discovery-script)"),
    ("timeline", "timeline"),
    ("stall", "stall check"),
    ("library", "library"),
    ("logging", "logging"),
    ("hosts", "hosts"),
    ("controller", "controller"),
    ("env", "environment"),
)

# Group of each knob's generated flag; knobs not listed go to "tunables".
_KNOB_GROUP: dict[str, str] = {
    "start_timeout": "general", "start_timeout_cap": "general",
    "autotune": "autotune", "autotune_log": "autotune",
    "autotune_warmup_samples": "autotune", "autotune_steps_per_sample": "autotune",
    "autotune_bayes_opt_max_samples": "autotune", "autotune_gaussian_process_noise": "autotune",
    "heartbeat_timeout_seconds": "stall",
    "timeline": "timeline", "timeline_mark_cycles": "timeline",
    "stall_check_time_seconds": "stall", "stall_shutdown_time_seconds": "stall",
    "mpi_threads_disable": "library", "num_nccl_streams": "library",
    "thread_affinity": "library", "cpu_binding": "general", "gloo_timeout_seconds": "library",
    "timeout_seconds": "library", "log_level": "logging", "log_hide_time": "logging",
    "data_plane": "controller",
    "elastic_replace_limit": "elastic", "elastic_replace_backoff": "elastic",
}

# Knobs whose flags are written by hand below instead of generated.
_HAND_WRITTEN = frozenset({"gloo_iface", "elastic_timeout"})

_RUN_EPILOG = """\
examples:
  hora run -np 4 python train.py                 4 ranks on this machine
  hora run -np 8 -H a:4,b:4 python train.py      4 ranks on host a, 4 on host b (over ssh)
  hora run -np 8 --hostfile hosts.txt -p 2222 -i ~/.ssh/id_job --network-interface eth1 ...
  hora run -np 2 --fusion-threshold-mb 32 -x OMP_NUM_THREADS=1 python train.py
  hora run -np 4 --output-filename logs python train.py
  hora run -np 2 --data-plane torch python train.py
                                                 bytes over torch.distributed (gloo)
  hora run -np 2 --data-plane mpi python train.py
                                                 ranks under mpirun, bytes over MPI
  hora run -np 3 --min-np 2 --max-np 4 python train.py
                                                 elastic: goes on when a worker dies, grows
                                                 back at a commit (docs/elastic.md)
  mpirun -np 4 python train.py                   works too: no hora run needed

Every rank gets HOROVOD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE/CROSS_RANK/CROSS_SIZE/HOSTNAME (and the
same as HORA_*), the rendezvous address and a per-job secret in its environment. Output lines
are prefixed [<rank>]<stdout>: / [<rank>]<stderr>:. The first rank to fail stops the job (the
others get SIGTERM, then SIGKILL); hora run shows the root cause's traceback once, the others'
errors in one line, and exits with the root cause's status.

Hosts other than this machine are reached with the system ssh (BatchMode: passwordless), checked
in parallel before anything starts; their ranks run the launcher's Python path in the launcher's
working directory, with the launcher's environment (and -x) sent over ssh's stdin -- the job
secret never appears on a command line. Ranks fill the hosts in the order given, and exactly -np
ranks start even when the hosts list more slots. See docs/multihost.md.
"""

class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors say which program failed and exit 2 (argparse's code)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")

_MOST_USED = ("np", "hosts", "hostfile", "command", "verbose", "output_filename", "ssh_port",
              "ssh_identity_file", "knob_start_timeout", "check_build", "help", "help_all")


class _ShortHelp(argparse.Action):
    """``-h``: usage, the most used options and the examples; ``--help-all`` has the rest."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        fmt = parser._get_formatter()  # noqa: SLF001 - argparse's own formatter
        fmt.add_usage(parser.usage, parser._actions, [])  # noqa: SLF001
        fmt.add_text(parser.description)
        fmt.start_section("most used options")
        actions = [a for a in parser._actions if a.dest in _MOST_USED]  # noqa: SLF001
        fmt.add_arguments(sorted(actions, key=lambda a: _MOST_USED.index(a.dest)))
        fmt.end_section()
        rest = sum(1 for a in parser._actions if a.dest not in _MOST_USED)  # noqa: SLF001
        fmt.add_text(f"{PROG} run --help-all shows the other {rest} options: every horovodrun "
                     "flag (ssh, elastic, timeline, stall check, library, logging, controller, "
                     "-x environment) and every tunable, with defaults and HORA_* variables.")
        fmt.add_text(parser.epilog)
        parser._print_message(fmt.format_help(), sys.stdout)  # noqa: SLF001
        parser.exit()


class _FullHelp(_ShortHelp):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.print_help()
        parser.exit()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def _non_negative(kind: type, upper: float | None = None) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if not math.isfinite(value) or value < 0 or (upper is not None and value > upper):
            bound = f"in [0, {upper}]" if upper is not None else "a finite number >= 0"
            raise argparse.ArgumentTypeError(f"must be {bound}, not {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _knob_parser(knob: Knob, flag: str) -> Any:
    def parse(text: str) -> Any:
        try:
            return parse_value(knob, text, flag)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = knob.type.__name__
    return parse


class _KnobSwitch(argparse.BooleanOptionalAction):
    """``--flag`` / ``--no-flag`` of a bool knob; a value hora does not support
    (``--torus-allreduce``) is a usage error with the knob's reason
    (:func:`hora.config.check_supported`)."""

    def __init__(self, option_strings: list[str], dest: str, *, knob: Knob,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.knob = knob

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        try:
            check_supported(self.knob, getattr(namespace, self.dest),
                            option_string or self.knob.cli or self.knob.env)
        except ConfigError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None


def _knob_help(knob: Knob) -> str:
    if knob.type is bool:
        default = "automatic" if knob.default is None else "on" if knob.default else "off"
    elif knob.cli_scale != 1:
        default = f"{knob.default // knob.cli_scale}"
    elif knob.default == "":
        default = "unset"
    else:
        default = str(knob.default)
    note = (f" Not supported in hora: {accepted_text(knob)} accepted, other values refused "
            "(the message and docs/config.md say why)." if knob.unsupported else "")
    doc = knob.doc.replace("%", "%%")
    return f"{doc}{note} [default: {default}; env {knob.env}]"


def _knob_metavar(knob: Knob) -> str:
    if knob.choices:
        return "{" + ",".join(knob.choices) + "}"
    if knob.cli_scale != 1:
        return "MB"
    return {int: "N", float: "X"}.get(knob.type, "VALUE")


def _add_knob_flags(groups: dict[str, argparse._ArgumentGroup]) -> None:
    for knob in KNOBS:
        if knob.cli is None or knob.name in _HAND_WRITTEN:
            continue
        group = groups[_KNOB_GROUP.get(knob.name, "tunables")]
        dest = f"knob_{knob.name}"
        if knob.type is bool:
            group.add_argument(knob.cli, dest=dest, action=_KnobSwitch, knob=knob,
                               default=None, help=_knob_help(knob))
        else:
            group.add_argument(knob.cli, dest=dest, default=None, metavar=_knob_metavar(knob),
                               type=_knob_parser(knob, knob.cli), help=_knob_help(knob))


def build_run_parser() -> argparse.ArgumentParser:
    """The ``hora run`` parser: horovodrun's flags plus the generated knob flags."""
    parser = _Parser(
        prog=f"{PROG} run", usage=f"{PROG} run [options] -np N command [args ...]",
        description="Launch N ranks of a training script on this machine or, over ssh, on "
                    "other hosts (horovodrun's flags).",
        epilog=_RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False)
    parser.add_argument("-h", "--help", action=_ShortHelp,
                        help="show the most used options and exit")
    parser.add_argument("--help-all", action=_FullHelp,
                        help="show every option (all of horovodrun's, and every tunable)")
    groups = {key: parser.add_argument_group(title) for key, title in _GROUPS}
    g = groups["general"]
    g.add_argument("-v", "--version", action="store_true", help="print hora's version and exit")
    g.add_argument("-np", "--num-proc", dest="np", type=_positive_int, metavar="N",
                   help="number of ranks to start (required)")
    g.add_argument("-cb", "--check-build", action="store_true",
                   help="print horovodrun's checklist and hora check's report")
    g.add_argument("--disable-cache", action="store_true",
                   help="accepted for compatibility: hora run caches nothing, the ssh checks "
                        "of remote hosts run for every job")
    g.add_argument("--network-interfaces", metavar="IF[,IF...]",
                   help="comma list of network interfaces the ranks use (HORA_GLOO_IFACE is "
                        "the first; NCCL_SOCKET_IFNAME all of them)")
    g.add_argument("--network-interface", action="append", metavar="IF",
                   help="network interface the rendezvous store and every rank use (their "
                        "address on it; it must exist on every host); repeatable [default: "
                        "loopback on one host, else the route toward the other hosts]")
    g.add_argument("--output-filename", metavar="DIR",
                   help="also write each rank's output to DIR/rank.<r>/stdout and stderr")
    g.add_argument("--verbose", action="store_true",
                   help="print what the launcher starts and the variables it sets")
    g.add_argument("--config-file", metavar="FILE",
                   help="YAML file with horovodrun's sections (params, autotune, timeline, "
                        "stall_check, library_options, logging, controller); flags given on "
                        "the command line win (needs PyYAML)")
    g.add_argument("command", nargs=argparse.REMAINDER,
                   help="the program to run on every rank, and its arguments")

    s = groups["ssh"]
    s.add_argument("-p", "--ssh-port", type=_positive_int, metavar="PORT",
                   help="ssh port of every remote host [default: ssh's own]")
    s.add_argument("-i", "--ssh-identity-file", metavar="FILE",
                   help="ssh private key for the remote hosts")

    e = groups["elastic"]
    e.add_argument("--min-np", "--min-num-proc", dest="min_np", type=_positive_int,
                   metavar="N", help="minimum number of ranks (enables elastic mode)")
    e.add_argument("--max-np", "--max-num-proc", dest="max_np", type=_positive_int,
                   metavar="N", help="maximum number of ranks")
    e.add_argument("--slots-per-host", dest="slots_per_host", type=_positive_int, metavar="N",
                   help="slots of discovered hosts that state none")
    e.add_argument("--elastic-timeout", dest="knob_elastic_timeout",
                   type=_knob_parser(KNOBS_BY_NAME["elastic_timeout"], "--elastic-timeout"),
                   metavar="SECONDS", help="seconds to wait for --min-np workers at start and "
                   "after a failure before the job fails [default: 600; env "
                   "HOROVOD_ELASTIC_TIMEOUT]")
    e.add_argument("--reset-limit", type=_non_negative(int), metavar="N",
                   help="resets allowed before the job fails")
    e.add_argument("--blacklist-cooldown-range", type=_non_negative(float), nargs=2,
                   metavar=("MIN", "MAX"), help="seconds a blacklisted host stays out, growing "
                   "from MIN to MAX with each blacklisting [default: for ever]")

    st = groups["stall"]
    st.add_argument("--no-stall-check", dest="knob_stall_check_disable", action="store_const",
                    const=True, default=None,
                    help="disable the stall inspector [env HORA_STALL_CHECK_DISABLE=1]")
    st.add_argument("--stall-check", dest="knob_stall_check_disable", action="store_const",
                    const=False, help=argparse.SUPPRESS)

    lib = groups["library"]
    lib.add_argument("--mpi-args", metavar="ARGS",
                     help="extra mpirun arguments (with --data-plane mpi, which starts the "
                          "ranks through mpirun; ignored otherwise)")
    lib.add_argument("--tcp", dest="tcp", action="store_true",
                     help="TCP only: NCCL_IB_DISABLE=1 for the ranks")
    lib.add_argument("--binding-args", metavar="ARGS",
                     help="mpirun binding arguments, replacing '--bind-to none --map-by slot' "
                          "(with --data-plane mpi; ignored otherwise)")

    lg = groups["logging"]
    lg.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp",
                    dest="prefix_timestamp", action="store_true",
                    help="put a time stamp before each relayed output line")
    lg.add_argument("--log-with-timestamp", dest="knob_log_hide_time", action="store_false",
                    default=None, help=argparse.SUPPRESS)
    lg.add_argument("--log-hide-timestamp", dest="deprecated_log_hide", action="store_const",
                    const=True, default=None, help=argparse.SUPPRESS)
    lg.add_argument("--no-log-hide-timestamp", dest="deprecated_log_hide", action="store_const",
                    const=False, help=argparse.SUPPRESS)

    hosts = groups["hosts"].add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", metavar="HOST:SLOTS[,...]",
                       help="hosts and slots in rank order, e.g. a:4,b:4; hosts other than this "
                            "machine are started over ssh [default: localhost:<np>]")
    hosts.add_argument("-hostfile", "--hostfile", metavar="FILE",
                       help="file with lines '<hostname> slots=<n>'")
    hosts.add_argument("--host-discovery-script", metavar="SCRIPT",
                       help="elastic mode: an executable printing the usable hosts, one "
                            "'<hostname>[:<slots>]' per line; run every second")

    ctl = groups["controller"].add_mutually_exclusive_group()
    ctl.add_argument("--gloo", action="store_true",
                     help="start the ranks with hora's own launcher (the default)")
    ctl.add_argument("--mpi", action="store_true",
                     help="run under Open MPI's mpirun with the mpi data plane (the same as "
                          "--data-plane mpi; hora's controller still negotiates)")
    ctl.add_argument("--jsrun", action="store_true", help="not available: see the message")

    groups["env"].add_argument(
        "-x", dest="env_vars", action="append", metavar="VAR[=VALUE]",
        help="set VAR=VALUE for every rank, or forward the launcher's VAR; repeatable")

    _add_knob_flags(groups)
    return parser


__all__ = ["PROG", "build_run_parser"]
