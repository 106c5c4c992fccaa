"""The one knob table: every tunable of hora, its env vars, CLI flag, default and doc.

Bottom layer: imports only :mod:`hora.errors`. The CLI parser (``hora run``), env parsing
(:func:`load`) and the docs table (``docs/config.md``, :func:`markdown_table`) are all generated
from :data:`KNOBS`. Flow is always CLI -> env -> :class:`Config` -> API, never back.

Each knob is read from ``HORA_<NAME>`` first, then its Horovod alias ``HOROVOD_<NAME>``.
Unknown ``HORA_*`` variables and malformed values raise :class:`~hora.errors.ConfigError`
naming the knob.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hora.errors import ConfigError

MiB = 1024 * 1024


@dataclass(frozen=True)
class Knob:
    """One row of the knob table.

    Attributes:
        name: field of :class:`Config`.
        type: ``int``, ``float``, ``bool`` or ``str``.
        default: value when neither env var is set.
        env: hora's variable (``HORA_*``).
        alias: Horovod's variable (``HOROVOD_*``), or None if hora-only.
        cli: ``hora run`` flag, or None. Bool knobs also get ``--no-<flag>``.
        doc: one line for ``--help`` and the docs.
        cli_scale: the CLI value is multiplied by this to get the env value (MB -> bytes).
        choices: allowed values for ``str`` knobs (lower-case), or None.
        minimum: smallest allowed value for numbers.
        maximum: largest allowed value for numbers, or None.
        hora_only: True for knobs Horovod does not have.
        implemented: False for Horovod knobs accepted for compatibility with no effect yet.
    """

    name: str
    type: type
    default: Any
    env: str
    alias: str | None
    cli: str | None
    doc: str
    cli_scale: int = 1
    choices: tuple[str, ...] | None = None
    minimum: float | None = 0
    maximum: float | None = None
    hora_only: bool = False
    implemented: bool = True


def _k(name: str, typ: type, default: Any, cli: str | None, doc: str, *, alias: bool = True,
       **kw: Any) -> Knob:
    upper = name.upper()
    return Knob(name=name, type=typ, default=default, env=f"HORA_{upper}",
                alias=f"HOROVOD_{upper}" if alias else None, cli=cli, doc=doc,
                hora_only=not alias, **kw)


KNOBS: tuple[Knob, ...] = (
    # --- engine ---
    _k("fusion_threshold", int, 128 * MiB, "--fusion-threshold-mb",
       "Fusion buffer size in bytes (CLI in MB); small tensors are packed together up to it. "
       "0 disables fusion.", cli_scale=MiB),
    _k("cycle_time", float, 0.0, "--cycle-time-ms",
       "Milliseconds the coordinator waits after a tensor becomes ready so that more can be fused "
       "with it. hora's engine is event-driven, so 0 (the default) means 'respond at once'; "
       "Horovod polls every 1 ms."),
    _k("cache_capacity", int, 1024, "--cache-capacity",
       "Response cache entries per process set: allreduces negotiated once run again without "
       "rank 0's round trip (the shared-memory fast lane, ranks on one host). 0 negotiates "
       "every op."),
    _k("hierarchical_allreduce", bool, None, "--hierarchical-allreduce",
       "Reduce within each host (shared memory), then across hosts (TCP). Unset: automatic, "
       "on when a process set spans hosts with several ranks on a host; 1/0 force it."),
    _k("shm", bool, True, "--shm",
       "hora-only: ranks on one host exchange tensors through shared memory (/dev/shm) "
       "instead of TCP.", alias=False),
    _k("hierarchical_allgather", bool, False, "--hierarchical-allgather",
       "Allgather in three steps when a process set spans hosts with several ranks on a host: "
       "gather within each host (shared memory), exchange across hosts among one leader per "
       "host (TCP), broadcast within each host. Off by default, as in Horovod."),
    _k("torus_allreduce", bool, False, "--torus-allreduce",
       "2-D torus allreduce (NCCL in Horovod; accepted, no effect).", implemented=False),
    _k("dynamic_process_sets", bool, False, None,
       "Allow add_process_set / remove_process_set after init."),
    _k("disable_group_fusion", bool, False, None,
       "Fuse grouped ops only with members of the same group."),
    _k("allreduce_algorithm", str, "auto", "--allreduce-algorithm",
       "hora-only: 'auto' (ring, or recursive doubling for small tensors), 'ring', 'small' "
       "(recursive doubling), or 'star' (parameter-server style: everyone sends to rank 0).",
       alias=False, choices=("auto", "ring", "small", "star")),
    _k("small_allreduce_bytes", int, 64 * 1024, None,
       "hora-only: allreduces up to this many bytes use the latency-optimal algorithm "
       "(recursive doubling) when the algorithm is 'auto'.", alias=False),
    # --- timeouts and faults ---
    _k("timeout_seconds", float, 30.0, "--timeout-seconds",
       "hora-only: deadline for connect, rendezvous and for a peer to make progress inside a "
       "collective (alias HOROVOD_GLOO_TIMEOUT_SECONDS).", alias=False),
    _k("gloo_timeout_seconds", float, 30.0, "--gloo-timeout-seconds",
       "Horovod's name for the connect/op deadline; used when HORA_TIMEOUT_SECONDS is unset."),
    _k("stall_check_disable", bool, False, None,
       "Turn off the stall inspector (CLI: --no-stall-check)."),
    _k("stall_check_time_seconds", float, 60.0, "--stall-check-warning-time-seconds",
       "Warn, naming the missing ranks, when a tensor waits this long for some ranks."),
    _k("stall_shutdown_time_seconds", float, 600.0, "--stall-check-shutdown-time-seconds",
       "Fail a stalled op on every rank after this many seconds (0 = never, Horovod's default; "
       "hora's is 600: see docs/faults.md)."),
    _k("deadlock_time_seconds", float, 1.0, "--deadlock-time-seconds",
       "hora-only: when every rank has been blocked in a wait (synchronize, barrier, join, a "
       "sync op) for this long and none of their ops can complete, fail those ops on every "
       "rank with a message naming each rank's op. 0 disables (the stall check remains).",
       alias=False),
    _k("heartbeat_timeout_seconds", float, 30.0, "--heartbeat-timeout-seconds",
       "hora-only: a rank that sends nothing (not even its heartbeat, every quarter of this) "
       "for this long is declared lost: hung, stopped or unreachable. 0 disables.",
       alias=False),
    _k("start_timeout", float, 30.0, "--start-timeout",
       "Seconds start-up may go without progress: it fails, naming the missing ranks, when no "
       "new rank reached init() for this long (a slow but steady start of many ranks "
       "succeeds)."),
    _k("start_timeout_cap", float, 600.0, "--start-timeout-cap",
       "hora-only: seconds allowed for the whole start-up however steady (at least "
       "start_timeout).", alias=False),
    # --- observability ---
    _k("timeline", str, "", "--timeline-filename",
       "Write a Chrome-trace timeline to this file ('DYNAMIC': enabled, not started); "
       "`hora timeline FILE` summarises it."),
    _k("timeline_mark_cycles", bool, False, "--timeline-mark-cycles",
       "Mark engine cycles in the timeline."),
    _k("log_level", str, "warning", "--log-level",
       "Logging level of the library.",
       choices=("trace", "debug", "info", "warning", "error", "fatal")),
    _k("log_hide_time", bool, False, "--log-without-timestamp",
       "Omit timestamps from log lines."),
    # --- network ---
    _k("gloo_iface", str, "", "--network-interface",
       "Network interface whose address the ranks use (default: loopback on one host)."),
    _k("hostname", str, "", None,
       "Host identity of this rank (set by the launcher; overrides the real host name)."),
    _k("elastic_timeout", float, 600.0, "--elastic-timeout",
       "Elastic mode: seconds the driver waits for at least --min-np workers (at start and after "
       "a failure) before it ends the job with a message; also how long a worker that does not "
       "rejoin after a reset is waited for."),
    _k("elastic", bool, False, None,
       "Set by an elastic launcher for its ranks: DistributedOptimizer registers its hooks even "
       "while the job has one rank (it may grow)."),
    # --- accepted for compatibility, no effect ---
    _k("autotune", bool, False, "--autotune",
       "Autotune fusion threshold and cycle time (accepted; not implemented yet).",
       implemented=False),
    _k("autotune_log", str, "", "--autotune-log-file", "Autotune CSV log.", implemented=False),
    _k("autotune_warmup_samples", int, 3, "--autotune-warmup-samples",
       "Autotune: samples discarded at the start.", implemented=False),
    _k("autotune_steps_per_sample", int, 10, "--autotune-steps-per-sample",
       "Autotune: steps per sample.", implemented=False),
    _k("autotune_bayes_opt_max_samples", int, 20, "--autotune-bayes-opt-max-samples",
       "Autotune: Bayesian optimisation samples.", implemented=False),
    _k("autotune_gaussian_process_noise", float, 0.8, "--autotune-gaussian-process-noise",
       "Autotune: Gaussian process noise, in [0, 1].", maximum=1.0, implemented=False),
    _k("thread_affinity", str, "", "--thread-affinity",
       "Core list for the background thread (accepted; no effect).", implemented=False),
    _k("num_nccl_streams", int, 1, "--num-nccl-streams", "NCCL streams (accepted; no effect).",
       implemented=False),
    _k("mpi_threads_disable", bool, False, "--mpi-threads-disable",
       "Request MPI_THREAD_SINGLE (accepted; no effect).", implemented=False),
    _k("controller", str, "gloo", None,
       "Controller: hora's own engine answers to 'gloo' and 'mpi'.", choices=("gloo", "mpi"),
       implemented=False),
    _k("cpu_operations", str, "gloo", None,
       "CPU op library: hora's own collectives answer to 'gloo', 'mpi' and 'ccl'.",
       choices=("gloo", "mpi", "ccl"), implemented=False),
)

KNOBS_BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}

# HORA_* variables that are not knobs but are legitimately set (identity, rendezvous, secrets).
NON_KNOB_HORA_VARS: frozenset[str] = frozenset({
    "HORA_RANK", "HORA_SIZE", "HORA_LOCAL_RANK", "HORA_LOCAL_SIZE", "HORA_CROSS_RANK",
    "HORA_CROSS_SIZE", "HORA_RENDEZVOUS_ADDR", "HORA_RENDEZVOUS_PORT", "HORA_SECRET_KEY",
    "HORA_JOB_ID", "HORA_LAUNCHER", "HORA_LAUNCHER_PID", "HORA_ELASTIC_WORKER_ID",
    "HORA_TEST_WORKER", "HORA_DEBUG",
})


# HOROVOD_* variables Horovod defines that are not hora knobs: identity and rendezvous that
# horovodrun sets, and build, GPU-library and tuning settings hora has no use for. Accepted
# silently; any other unknown HOROVOD_* name gets a warning (Horovod itself ignores typos).
HOROVOD_NON_KNOB_VARS: frozenset[str] = frozenset({
    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
    "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_SECRET_KEY",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_GLOO_GLOBAL_PREFIX",
    "HOROVOD_GLOO_LOCAL_PREFIX", "HOROVOD_GLOO_CROSS_PREFIX", "HOROVOD_ELASTIC_TIMEOUT",
    "HOROVOD_SPARK_START_TIMEOUT", "HOROVOD_GPU_OPERATIONS", "HOROVOD_CUDA_HOME",
    "HOROVOD_NCCL_HOME", "HOROVOD_ROCM_HOME", "HOROVOD_CCL_CACHE", "HOROVOD_ADASUM_MPI_CHUNK_SIZE",
    "HOROVOD_BATCH_D2D_MEMCOPIES", "HOROVOD_DISABLE_NVTX_RANGES", "HOROVOD_ENABLE_ASYNC_COMPLETION",
    "HOROVOD_ENABLE_XLA_OPS", "HOROVOD_API_VERSION",
})
_HOROVOD_BUILD_PREFIXES = ("HOROVOD_WITH_", "HOROVOD_WITHOUT_", "HOROVOD_GPU_", "HOROVOD_BUILD_",
                           "HOROVOD_NCCL_", "HOROVOD_CCL_")


def unknown_horovod_vars(env: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``HOROVOD_*`` names in ``env`` that neither hora nor Horovod defines (typos, most
    likely), each with the closest known name (or None)."""
    known = {k.alias for k in KNOBS if k.alias} | HOROVOD_NON_KNOB_VARS
    return [(v, _suggest(v, known)) for v in sorted(env)
            if v.startswith("HOROVOD_") and v not in known
            and not v.startswith(_HOROVOD_BUILD_PREFIXES)]


def parse_value(knob: Knob, raw: str, source: str) -> Any:
    """Parse ``raw`` (from ``source``, e.g. an env var name) into the knob's type.

    Raises:
        ConfigError: naming the knob, the source and the accepted form.
    """
    text = raw.strip()
    try:
        if knob.type is bool:
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError("expected one of 1/0, true/false, yes/no, on/off")
        if knob.type is int:
            value: Any = int(float(text)) if text.lower().endswith(("e", ".0")) else int(text)
        elif knob.type is float:
            value = float(text)
        else:
            value = text
            if knob.choices is not None:
                value = text.lower()
                if value not in knob.choices:
                    raise ValueError(f"expected one of {', '.join(knob.choices)}")
            return value
    except ValueError as exc:
        raise ConfigError(
            f"{source}={raw!r} is not a valid value for knob '{knob.name}' "
            f"({knob.type.__name__}): {exc}. {knob.doc}"
        ) from None
    if knob.minimum is not None and value < knob.minimum:
        raise ConfigError(
            f"{source}={raw!r}: knob '{knob.name}' must be >= {knob.minimum}. {knob.doc}"
        )
    if knob.maximum is not None and value > knob.maximum:
        raise ConfigError(
            f"{source}={raw!r}: knob '{knob.name}' must be <= {knob.maximum}. {knob.doc}"
        )
    return value


@dataclass(frozen=True)
class Config:
    """Frozen, typed view of every knob. Build with :func:`load`."""

    fusion_threshold: int = 128 * MiB
    cycle_time: float = 0.0
    cache_capacity: int = 1024
    hierarchical_allreduce: bool | None = None
    shm: bool = True
    hierarchical_allgather: bool = False
    torus_allreduce: bool = False
    dynamic_process_sets: bool = False
    disable_group_fusion: bool = False
    allreduce_algorithm: str = "auto"
    small_allreduce_bytes: int = 64 * 1024
    timeout_seconds: float = 30.0
    gloo_timeout_seconds: float = 30.0
    stall_check_disable: bool = False
    stall_check_time_seconds: float = 60.0
    stall_shutdown_time_seconds: float = 600.0
    deadlock_time_seconds: float = 1.0
    heartbeat_timeout_seconds: float = 30.0
    start_timeout: float = 30.0
    start_timeout_cap: float = 600.0
    timeline: str = ""
    timeline_mark_cycles: bool = False
    log_level: str = "warning"
    log_hide_time: bool = False
    gloo_iface: str = ""
    hostname: str = ""
    elastic: bool = False
    elastic_timeout: float = 600.0
    autotune: bool = False
    autotune_log: str = ""
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10
    autotune_bayes_opt_max_samples: int = 20
    autotune_gaussian_process_noise: float = 0.8
    thread_affinity: str = ""
    num_nccl_streams: int = 1
    mpi_threads_disable: bool = False
    controller: str = "gloo"
    cpu_operations: str = "gloo"

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (values are not re-validated)."""
        return dataclasses.replace(self, **changes)


def load(env: Mapping[str, str] | None = None, *, strict: bool = True) -> Config:
    """Build a :class:`Config` from ``env`` (default ``os.environ``).

    ``HORA_*`` wins over ``HOROVOD_*``. With ``strict``, an unknown ``HORA_*`` variable is an error
    (a typo would otherwise be silently ignored).

    Raises:
        ConfigError: unknown ``HORA_*`` variable or malformed value, naming the knob.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for knob in KNOBS:
        for var in (knob.env, knob.alias):
            if var is not None and var in env:
                values[knob.name] = parse_value(knob, env[var], var)
                break
    if "timeout_seconds" not in values and "gloo_timeout_seconds" in values:
        values["timeout_seconds"] = values["gloo_timeout_seconds"]
    if strict:
        known = {k.env for k in KNOBS} | NON_KNOB_HORA_VARS
        unknown = sorted(v for v in env if v.startswith("HORA_") and v not in known)
        if unknown:
            close = _suggest(unknown[0], known)
            raise ConfigError(
                f"unknown hora setting {unknown[0]} in the environment"
                + (f" (did you mean {close}?)" if close else "")
                + "; see `hora run --help-all` or docs/config.md for the knob table."
            )
    return Config(**values)


def _suggest(name: str, known: set[str]) -> str | None:
    import difflib

    hits = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.7)
    return hits[0] if hits else None


def cli_value_to_env(knob: Knob, value: Any) -> str:
    """Render a parsed CLI value as the env string workers will read."""
    if knob.type is bool:
        return "1" if value else "0"
    if knob.cli_scale != 1:
        return str(int(float(value) * knob.cli_scale))
    return str(value)


def markdown_table(knobs: tuple[Knob, ...] = KNOBS) -> str:
    """The knob table as Markdown (for docs/config.md)."""
    rows = ["| knob | `HORA_*` env | Horovod alias | `hora run` flag | default | doc |",
            "|---|---|---|---|---|---|"]
    for k in knobs:
        note = "" if k.implemented else " *(accepted; no effect yet)*"
        rows.append(
            f"| {k.name} | `{k.env}` | {f'`{k.alias}`' if k.alias else '(hora-only)'} | "
            f"{f'`{k.cli}`' if k.cli else ''} | `{k.default!r}` | {k.doc}{note} |"
        )
    return "\n".join(rows) + "\n"


__all__ = [
    "KNOBS",
    "KNOBS_BY_NAME",
    "Config",
    "Knob",
    "cli_value_to_env",
    "load",
    "markdown_table",
    "parse_value",
]
