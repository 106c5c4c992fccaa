"""Configuration: the knob table (:mod:`hora.knobs`) read from the environment into a typed
:class:`Config`.

Bottom layer: imports only :mod:`hora.errors` and :mod:`hora.knobs`. The CLI parser
(``hora run``), env parsing (:func:`load`) and the docs table (``docs/config.md``, by
``scripts/gen_config_docs.py``) are all generated from :data:`KNOBS`. Flow is always
CLI -> env -> :class:`Config` -> API, never back.

Each knob is read from ``HORA_<NAME>`` first, then its Horovod alias ``HOROVOD_<NAME>``.
Unknown ``HORA_*`` variables and malformed values raise :class:`~hora.errors.ConfigError`
naming the knob.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hora.errors import ConfigError
from hora.knobs import KNOBS, KNOBS_BY_NAME, Knob, MiB

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}

# HORA_* variables that are not knobs but are legitimately set (identity, rendezvous, secrets).
NON_KNOB_HORA_VARS: frozenset[str] = frozenset({
    "HORA_RANK", "HORA_SIZE", "HORA_LOCAL_RANK", "HORA_LOCAL_SIZE", "HORA_CROSS_RANK",
    "HORA_CROSS_SIZE", "HORA_RENDEZVOUS_ADDR", "HORA_RENDEZVOUS_PORT", "HORA_SECRET_KEY",
    "HORA_JOB_ID", "HORA_LAUNCHER", "HORA_LAUNCHER_PID", "HORA_ELASTIC_WORKER_ID",
    "HORA_TEST_WORKER", "HORA_DEBUG", "HORA_BOUND_CPUS",
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
        ConfigError: naming the knob, the source and the accepted form; or, for a value that
            asks for an effect hora does not have, saying so (:func:`check_supported`).
    """
    try:
        value = _convert(knob, raw.strip())
    except ValueError as exc:
        allowed = (f"; allowed: {allowed_text(knob)} (set by {setting_names(knob)})"
                   if knob.type in (int, float) else "")
        raise ConfigError(f"{source}={raw!r} is not a valid value for knob '{knob.name}' "
                          f"({knob.type.__name__}): {exc}{allowed}. {knob.doc}") from None
    if knob.type in (int, float):
        bound = _violated_bound(knob, value)
        if bound:
            hint = f"; {knob.range_hint}" if knob.range_hint else ""
            raise ConfigError(
                f"{source}={raw!r}: knob '{knob.name}' must be {bound}; allowed: "
                f"{allowed_text(knob)}{hint} (set by {setting_names(knob)}). {knob.doc}")
    check_supported(knob, value, source, raw)
    return value


def _violated_bound(knob: Knob, value: float) -> str:
    """The bound ``value`` breaks ("> 0", "<= 1.0", "a finite number"), or "" when in range."""
    if isinstance(value, float) and not math.isfinite(value):
        return "a finite number, not " + ("NaN" if math.isnan(value) else "infinity")
    low, high = knob.minimum, knob.maximum
    if low is not None and (value < low or (knob.minimum_excluded and value == low)):
        return f"{'>' if knob.minimum_excluded else '>='} {low}"
    if high is not None and value > high:
        return f"<= {high}"
    return ""


def allowed_text(knob: Knob) -> str:
    """The values a knob accepts, for errors and docs: "a number > 0 and <= 1000000",
    "a number >= 0 and <= 1000000 (0: disabled)", "one of auto, ring", "1 or 0"."""
    if knob.type is bool:
        return "1 or 0"
    if knob.choices is not None:
        return "one of " + ", ".join(knob.choices)
    if knob.type not in (int, float):
        return "text"
    kind = "a whole number" if knob.type is int else "a number"
    low, high = knob.minimum, knob.maximum
    parts = []
    if low is not None:
        parts.append(f"{'>' if knob.minimum_excluded else '>='} {low}")
    if high is not None:
        parts.append(f"<= {high}")
    text = f"{kind} {' and '.join(parts)}".strip()
    zero = knob.zero_means and not _violated_bound(knob, 0)
    return f"{text} (0: {knob.zero_means})" if zero else text


def setting_names(knob: Knob) -> str:
    """Where a knob is set: "HORA_X, HOROVOD_X or hora run --x"."""
    names = [n for n in (knob.env, knob.alias) if n]
    if knob.cli:
        names.append(f"hora run {knob.cli}")
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


def _convert(knob: Knob, text: str) -> Any:
    if knob.type is bool:
        if text.lower() not in _TRUE | _FALSE:
            raise ValueError("expected one of 1/0, true/false, yes/no, on/off")
        return text.lower() in _TRUE
    if knob.type is int:
        try:
            return int(text)
        except ValueError:
            number = float(text)  # "1e6", "64.0" (YAML writes whole floats so)
            if not number.is_integer():  # also NaN and infinity
                raise ValueError("expected a whole number") from None
            return int(number)
    if knob.type is float:
        return float(text)
    value = text.lower() if knob.choices is not None else text
    if knob.choices is not None and value not in knob.choices:
        raise ValueError(f"expected one of {', '.join(knob.choices)}")
    problem = knob.check(value) if knob.check is not None else ""
    if problem:
        raise ValueError(problem)
    return value


def check_supported(knob: Knob, value: Any, source: str, raw: str | None = None) -> None:
    """Refuse ``value`` (from ``source``: a variable, a ``hora run`` flag or a config file
    entry; ``raw``: the text given) if it asks for an effect hora does not have.

    Raises:
        ConfigError: that hora does not support it, why, what to use instead, how to go on.
    """
    if not knob.unsupported or value == knob.default or value in knob.also_accepted:
        return
    keep = f" or set it to {_show(knob.default)}" if _show(knob.default) else ""
    fix = (f"Drop {source}." if source.startswith("-") else f"To go on, unset {source}{keep}."
           if source.startswith(("HORA_", "HOROVOD_")) else
           f"To go on, remove it from the config file{keep}.")
    given = source if raw is None else f"{source}={raw!r}"
    raise ConfigError(f"{given}: {knob.unsupported} {fix}")


def accepted_text(knob: Knob) -> str:
    """What an unsupported knob accepts, for docs and help: "unset or 0"."""
    shown = [_show(knob.default)] if _show(knob.default) else []
    return " or ".join(["unset", *shown, *knob.also_accepted])


def _show(value: Any) -> str:
    return str(int(value)) if isinstance(value, bool) else "" if value in ("", None) else str(value)


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
    data_plane: str = "builtin"
    small_allreduce_bytes: int = 64 * 1024
    eager_cache: bool = True
    torch_overlap: str = "auto"
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
    elastic_replace_limit: int = 5
    elastic_replace_backoff: float = 1.0
    autotune: bool = False
    autotune_log: str = ""
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10
    autotune_bayes_opt_max_samples: int = 20
    autotune_gaussian_process_noise: float = 0.8
    thread_affinity: str = ""
    cpu_binding: str = "auto"
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
    if values.get("cpu_operations") == "mpi":  # Horovod's MPI operations: the mpi data plane
        plane = values.setdefault("data_plane", "mpi")
        if plane != "mpi":
            raise ConfigError(
                f"HOROVOD_CPU_OPERATIONS=mpi asks for the mpi data plane, but HORA_DATA_PLANE="
                f"{plane} asks for another: set only one of them.")
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
        return str(value * knob.cli_scale if isinstance(value, int)
                   else int(float(value) * knob.cli_scale))
    return str(value)


__all__ = [
    "KNOBS",
    "KNOBS_BY_NAME",
    "Config",
    "Knob",
    "accepted_text",
    "allowed_text",
    "check_supported",
    "cli_value_to_env",
    "load",
    "parse_value",
    "setting_names",
]
