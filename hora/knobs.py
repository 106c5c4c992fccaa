"""The knob table itself: every tunable of hora with its env vars, CLI flag, default and doc.

Bottom layer, imports nothing of hora. :mod:`hora.config` parses the environment against this
table into a :class:`~hora.config.Config`; ``hora run`` builds its flags from it and
``scripts/gen_config_docs.py`` renders it as ``docs/config.md``. A new knob is one row here and
one field of :class:`~hora.config.Config`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MiB = 1024 * 1024

MAX_SECONDS = 1_000_000
"""Upper bound of every knob in seconds (11.6 days): a longer wait is "never" in practice, and
it keeps every deadline derived from it valid for the OS (``socket.settimeout`` refuses 1e10 s,
a ``poll`` timeout in ms must fit 32 bits). Knobs where 0 means "never" say so."""
_POSITIVE_SECONDS: dict[str, Any] = {"minimum_excluded": True, "maximum": MAX_SECONDS}


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
        minimum: smallest allowed value for numbers (NaN and infinity are never allowed).
        maximum: largest allowed value for numbers, or None.
        minimum_excluded: the value must be above ``minimum``, not equal to it (a timeout of
            0 would fail everything at once).
        zero_means: what 0 does, for a number whose range includes it ("disabled", "never").
        range_hint: added to the error for a value out of range (how to get what 0 would mean).
        hora_only: True for knobs Horovod does not have.
        unsupported: for a Horovod knob whose effect hora does not have: why, and what to use
            instead; any value but ``default`` (and ``also_accepted``) is refused
            (:func:`check_supported`).
        also_accepted: values of an ``unsupported`` knob that hora does honour besides the
            default (``HOROVOD_CPU_OPERATIONS=mpi``: the mpi data plane).
        check: extra validation of a parsed value: returns what is wrong, or "".
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
    minimum_excluded: bool = False
    zero_means: str = ""
    range_hint: str = ""
    hora_only: bool = False
    unsupported: str = ""
    also_accepted: tuple[str, ...] = ()
    check: Callable[[Any], str] | None = None


def _k(name: str, typ: type, default: Any, cli: str | None, doc: str, *, alias: bool = True,
       **kw: Any) -> Knob:
    upper = name.upper()
    return Knob(name=name, type=typ, default=default, env=f"HORA_{upper}",
                alias=f"HOROVOD_{upper}" if alias else None, cli=cli, doc=doc,
                hora_only=not alias, **kw)


# Why hora refuses a Horovod knob's "on" values, and what to use instead (Knob.unsupported).
_NO_TORUS = (
    "hora does not support the torus allreduce: Horovod's is a 2-D allreduce of GPU tensors "
    "over NCCL, and hora has no NCCL (its collectives run on the CPU: shared memory within a "
    "host, TCP across hosts). hora's two-level allreduce is hierarchical allreduce (within each "
    "host, then across hosts): HOROVOD_HIERARCHICAL_ALLREDUCE=1 or hora run "
    "--hierarchical-allreduce (automatic when a process set spans hosts with several ranks on "
    "a host).")
_NO_NCCL_STREAMS = (
    "hora does not support NCCL streams: it has no NCCL (its collectives run on the CPU; CUDA "
    "tensors are copied to host memory for them). Where GPU bandwidth matters, use NCCL "
    "through torch.distributed.")
_NO_MPI_CONTROLLER = (
    "hora does not support the MPI controller: its own engine negotiates over TCP with rank 0 "
    "as the coordinator, the part Horovod's gloo controller plays (hora run sets "
    "HOROVOD_CONTROLLER=gloo, as horovodrun does). Ranks started by mpirun need no MPI "
    "controller: init() reads Open MPI's environment.")
_NO_CPU_OPERATIONS = (
    "hora does not support oneCCL CPU operations: its own CPU collectives (ring and "
    "recursive doubling over TCP, shared memory within a host) play the part of Horovod's gloo "
    "operations (hora run sets HOROVOD_CPU_OPERATIONS=gloo, as horovodrun does), and "
    "HOROVOD_CPU_OPERATIONS=mpi moves the data over MPI (the mpi data plane, HORA_DATA_PLANE=mpi)."
    " Pick the allreduce algorithm with HORA_ALLREDUCE_ALGORITHM (--allreduce-algorithm), or "
    "the engine that moves the bytes with HORA_DATA_PLANE (--data-plane).")


def _core_list_problem(text: Any) -> str:
    """What is wrong with a ``thread_affinity`` value ("" when it is fine or empty)."""
    bad = [i.strip() for i in str(text).split(",") if not i.strip().isdigit()]
    return (f"expected a comma list of CPU core numbers, one per local rank (e.g. '0,1'), and "
            f"{bad[0]!r} is not a core number") if bad and str(text).strip() else ""


KNOBS: tuple[Knob, ...] = (
    # --- engine ---
    _k("fusion_threshold", int, 128 * MiB, "--fusion-threshold-mb",
       "Fusion buffer size in bytes (CLI in MB); small tensors are packed together up to it. "
       "0 disables fusion.", cli_scale=MiB, zero_means="no fusion"),
    _k("cycle_time", float, 0.0, "--cycle-time-ms",
       "Milliseconds the coordinator waits after a tensor becomes ready so that more can be fused "
       "with it. hora's engine is event-driven, so 0 (the default) means 'respond at once'; "
       "Horovod polls every 1 ms.", maximum=1000, zero_means="respond at once"),
    _k("cache_capacity", int, 1024, "--cache-capacity",
       "Response cache entries per process set: allreduces and allgathers (grouped and sparse "
       "ones included) negotiated once run again without rank 0's round trip (the "
       "shared-memory fast lane, ranks on one host). 0 negotiates every op.",
       zero_means="no cache"),
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
    _k("dynamic_process_sets", bool, False, None,
       "Allow add_process_set / remove_process_set after init."),
    _k("disable_group_fusion", bool, False, None,
       "Fuse an allreduce only with the other members of its grouped_allreduce call. As in "
       "Horovod, where every op then forms a group of its own, a plain allreduce (each "
       "gradient of a DistributedOptimizer without groups) is then not fused at all."),
    _k("allreduce_algorithm", str, "auto", "--allreduce-algorithm",
       "hora-only: 'auto' (ring, or recursive doubling for small tensors), 'ring', 'small' "
       "(recursive doubling), or 'star' (parameter-server style: everyone sends to rank 0).",
       alias=False, choices=("auto", "ring", "small", "star")),
    _k("data_plane", str, "builtin", "--data-plane",
       "hora-only: the engine that moves the bytes of the data collectives: 'builtin' (hora's "
       "own: shared memory within a host, TCP across hosts; the default: on one host the "
       "fastest measured for small and for very large allreduces), 'torch' (a "
       "torch.distributed gloo process group built from "
       "hora's rendezvous), or 'mpi' (mpi4py over the system MPI; ranks started by mpirun or "
       "`hora run --data-plane mpi`). Negotiation, fusion, checks and failure detection stay "
       "hora's; see docs/data-planes.md.", alias=False, choices=("builtin", "torch", "mpi")),
    _k("small_allreduce_bytes", int, 64 * 1024, None,
       "hora-only: allreduces up to this many bytes use the latency-optimal algorithm "
       "(recursive doubling) when the algorithm is 'auto'.", alias=False,
       zero_means="the ring for every size"),
    _k("eager_cache", bool, True, None,
       "hora-only: in a job of at most 16 ranks, one per host, a cached allreduce of at most "
       "small_allreduce_bytes agrees inside its own exchange (every rank sends its data to rank "
       "0, which reduces them in rank order and sends the result back; no separate decision "
       "round); 0: rank 0 decides every cached op first (docs/multihost.md).", alias=False),
    _k("torch_overlap", str, "auto", None,
       "hora-only: whether hora.torch.DistributedOptimizer starts a CPU gradient's allreduce "
       "from its hook during backward ('on') or all of them in synchronize()/step() ('off'); "
       "'auto': on when this host has a core per rank beyond torch's compute threads "
       "(docs/torch.md). GPU gradients always start during backward.", alias=False,
       choices=("auto", "on", "off")),
    # --- timeouts and faults ---
    _k("timeout_seconds", float, 30.0, "--timeout-seconds",
       "hora-only: deadline for connect, rendezvous and for a peer to make progress inside a "
       "collective (alias HOROVOD_GLOO_TIMEOUT_SECONDS).", alias=False, **_POSITIVE_SECONDS),
    _k("gloo_timeout_seconds", float, 30.0, "--gloo-timeout-seconds",
       "Horovod's name for the connect/op deadline; used when HORA_TIMEOUT_SECONDS is unset.",
       **_POSITIVE_SECONDS),
    _k("stall_check_disable", bool, False, None,
       "Turn off the stall inspector (CLI: --no-stall-check)."),
    _k("stall_check_time_seconds", float, 60.0, "--stall-check-warning-time-seconds",
       "Warn, naming the missing ranks, when a tensor waits this long for some ranks.",
       range_hint="to turn the stall check off, set HOROVOD_STALL_CHECK_DISABLE=1 (hora run "
       "--no-stall-check)", **_POSITIVE_SECONDS),
    _k("stall_shutdown_time_seconds", float, 600.0, "--stall-check-shutdown-time-seconds",
       "Fail a stalled op on every rank after this many seconds (0 = never, Horovod's default; "
       "hora's is 600: see docs/faults.md).", maximum=MAX_SECONDS, zero_means="never"),
    _k("deadlock_time_seconds", float, 1.0, "--deadlock-time-seconds",
       "hora-only: when every rank has been blocked in a wait (synchronize, barrier, join, a "
       "sync op) for this long and none of their ops can complete, fail those ops on every "
       "rank with a message naming each rank's op. 0 disables (the stall check remains).",
       alias=False, maximum=MAX_SECONDS, zero_means="disabled"),
    _k("heartbeat_timeout_seconds", float, 30.0, "--heartbeat-timeout-seconds",
       "hora-only: a rank that sends nothing (not even its heartbeat, every quarter of this) "
       "for this long is declared lost: hung, stopped or unreachable. 0 disables.",
       alias=False, maximum=MAX_SECONDS, zero_means="disabled"),
    _k("start_timeout", float, 30.0, "--start-timeout",
       "Seconds start-up may go without progress: it fails, naming the missing ranks, when no "
       "new rank reached init() for this long (a slow but steady start of many ranks "
       "succeeds).", **_POSITIVE_SECONDS),
    _k("start_timeout_cap", float, 600.0, "--start-timeout-cap",
       "hora-only: seconds allowed for the whole start-up however steady (at least "
       "start_timeout).", alias=False, **_POSITIVE_SECONDS),
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
       "rejoin after a reset is waited for.", **_POSITIVE_SECONDS),
    _k("elastic", bool, False, None,
       "Set by an elastic launcher for its ranks: DistributedOptimizer registers its hooks even "
       "while the job has one rank (it may grow)."),
    _k("elastic_replace_limit", int, 5, "--elastic-replace-limit",
       "Elastic mode: a host that still has training workers and that the job cannot go on "
       "without is not blacklisted; failed workers replaced there once its failures reach the "
       "blacklisting threshold (2). Past this, the host takes no new worker (its running "
       "workers go on).", alias=False, maximum=1000,
       zero_means="no replacement"),
    _k("elastic_replace_backoff", float, 1.0, "--elastic-replace-backoff",
       "Elastic mode: seconds before the first such replacement on a host, doubling with each "
       "one (at most 60).", alias=False, maximum=60.0, zero_means="at once"),
    _k("thread_affinity", str, "", "--thread-affinity",
       "Comma list of CPU cores, one per local rank (Linux): local rank i pins hora's "
       "background threads (the engine thread and the fast-lane threads it starts) to core i "
       "of the list, as Horovod pins its background thread. Unset: no pinning.",
       check=_core_list_problem),
    _k("cpu_binding", str, "auto", "--cpu-binding",
       "hora-only: 'auto': hora run binds each rank it starts (here and over ssh) to "
       "its own share of the cores its host lets it use (contiguous, as even as possible), "
       "when every local rank gets a whole core and no thread affinity is set, so that the "
       "frameworks size their thread pools to that share and ranks do not take each other's "
       "cores (as mpirun binds by default); 'none': ranks run on every core the launcher "
       "may use. An elastic worker is bound to its slot's share of its host's cores (the "
       "host's slot count as discovery gave it when the host's first bound worker started); "
       "mpirun's ranks are not bound by hora.",
       alias=False, choices=("auto", "none")),
    _k("mpi_threads_disable", bool, False, "--mpi-threads-disable",
       "Horovod: ask MPI for MPI_THREAD_SINGLE. hora never initialises MPI, so neither thread "
       "level is requested, as in Horovod's gloo mode: 0 and 1 are both accepted."),
    # --- Horovod knobs whose effect hora does not have: any value but the default is refused
    _k("torus_allreduce", bool, False, "--torus-allreduce",
       "Horovod's 2-D torus allreduce of GPU tensors over NCCL.", unsupported=_NO_TORUS),
    _k("autotune", bool, False, "--autotune",
       "Tune the fusion threshold and cycle time (and, for jobs across hosts, hierarchical "
       "allreduce and allgather) while training: rank 0 scores each setting by the bytes "
       "reduced per second and picks the next by Bayesian optimisation, then keeps the best "
       "(docs/autotune.md). Tunables set explicitly stay fixed."),
    _k("autotune_log", str, "", "--autotune-log-file",
       "Autotune: CSV file written by rank 0 in Horovod's columns, one row per sample, the "
       "best setting last."),
    _k("autotune_warmup_samples", int, 3, "--autotune-warmup-samples",
       "Autotune: samples discarded at the start.", zero_means="none discarded"),
    _k("autotune_steps_per_sample", int, 10, "--autotune-steps-per-sample",
       "Autotune: a window closes when some tensor was reduced this many times; a sample is 3 "
       "windows of the setting tried, each followed by one of the starting setting.",
       minimum=1),
    _k("autotune_bayes_opt_max_samples", int, 20, "--autotune-bayes-opt-max-samples",
       "Autotune: settings of fusion threshold and cycle time measured (the starting one and 4 "
       "probes first, then points proposed by Bayesian optimisation).", minimum=1),
    _k("autotune_gaussian_process_noise", float, 0.8, "--autotune-gaussian-process-noise",
       "Autotune: the Gaussian process's noise level, in [0, 1], relative to the spread of the "
       "scores (0: every measurement is exact).", maximum=1.0,
       zero_means="every measurement is exact"),
    _k("num_nccl_streams", int, 1, "--num-nccl-streams", "Horovod: NCCL streams per GPU.",
       minimum=1, unsupported=_NO_NCCL_STREAMS),
    _k("controller", str, "gloo", None,
       "Horovod's controller; hora run sets 'gloo' for every rank, as horovodrun does.",
       choices=("gloo", "mpi"), unsupported=_NO_MPI_CONTROLLER),
    _k("cpu_operations", str, "gloo", None,
       "Horovod's library of CPU collectives; hora run sets 'gloo' for every rank, as "
       "horovodrun does. 'mpi' selects the mpi data plane (HORA_DATA_PLANE=mpi).",
       choices=("gloo", "mpi", "ccl"), unsupported=_NO_CPU_OPERATIONS, also_accepted=("mpi",)),
)

KNOBS_BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}

__all__ = ["KNOBS", "KNOBS_BY_NAME", "MAX_SECONDS", "MiB", "Knob"]
