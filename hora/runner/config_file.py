"""``hora run --config-file``: horovodrun's YAML config file as knob values.

Runner layer. The sections and keys are horovodrun's; each key maps to a knob of the one table
(:mod:`hora.config`), whose parser validates the value.
"""

from __future__ import annotations

from typing import Any

from hora.config import KNOBS_BY_NAME, parse_value
from hora.errors import ConfigError

# --config-file: section -> key -> (knob, invert) ; None: accepted, no knob (no effect yet).
_CONFIG_FILE: dict[str, dict[str, tuple[str, bool] | None]] = {
    "params": {"fusion_threshold_mb": ("fusion_threshold", False),
               "cycle_time_ms": ("cycle_time", False),
               "cache_capacity": ("cache_capacity", False),
               "hierarchical_allreduce": ("hierarchical_allreduce", False),
               "hierarchical_allgather": ("hierarchical_allgather", False),
               "torus_allreduce": ("torus_allreduce", False)},
    "autotune": {"enabled": ("autotune", False), "log_file": ("autotune_log", False),
                 "warmup_samples": ("autotune_warmup_samples", False),
                 "steps_per_sample": ("autotune_steps_per_sample", False),
                 "bayes_opt_max_samples": ("autotune_bayes_opt_max_samples", False),
                 "gaussian_process_noise": ("autotune_gaussian_process_noise", False)},
    "timeline": {"filename": ("timeline", False),
                 "mark_cycles": ("timeline_mark_cycles", False)},
    "stall_check": {"enabled": ("stall_check_disable", True),
                    "warning_time_seconds": ("stall_check_time_seconds", False),
                    "shutdown_time_seconds": ("stall_shutdown_time_seconds", False)},
    "library_options": {"mpi_threads_disable": ("mpi_threads_disable", False),
                        "num_nccl_streams": ("num_nccl_streams", False),
                        "thread_affinity": ("thread_affinity", False),
                        "gloo_timeout_seconds": ("gloo_timeout_seconds", False)},
    "logging": {"level": ("log_level", False), "with_timestamp": ("log_hide_time", True)},
}


def read_config_file(path: str) -> tuple[dict[str, Any], str | None]:
    """Knob values and controller from a horovodrun YAML config file.

    Returns:
        ``(values by knob name, controller or None)``.

    Raises:
        ConfigError: PyYAML is missing, the file cannot be read or parsed, or it has an unknown
            section, key or a malformed value.
    """
    try:
        import yaml
    except ImportError:
        raise ConfigError(f"--config-file {path!r} needs PyYAML to read it: "
                          "pip install pyyaml") from None
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"--config-file {path!r}: cannot read it: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config-file {path!r} is not valid YAML: {exc}") from None
    return config_values(data or {}, path)


def config_values(data: Any, source: str) -> tuple[dict[str, Any], str | None]:
    """Translate parsed config-file ``data`` (horovodrun's sections) into knob values."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level")
    values: dict[str, Any] = {}
    controller = None
    for section, body in data.items():
        if section == "controller":
            controller = str(body).lower()
            if controller not in ("gloo", "mpi"):
                raise ConfigError(f"{source}: controller must be gloo or mpi, not {body!r}")
            continue
        keys = _CONFIG_FILE.get(section)
        if keys is None:
            raise ConfigError(f"{source}: unknown section {section!r}; known: controller, "
                              f"{', '.join(_CONFIG_FILE)}")
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: section {section!r} must be a mapping")
        for key, raw in body.items():
            if key not in keys:
                raise ConfigError(f"{source}: unknown key {section}.{key}; known: "
                                  f"{', '.join(keys)}")
            target = keys[key]
            if target is None or raw is None:
                continue
            name, invert = target
            knob = KNOBS_BY_NAME[name]
            text = ("1" if raw else "0") if isinstance(raw, bool) else str(raw)
            value = parse_value(knob, text, f"{source}: {section}.{key}")
            values[name] = (not value) if invert else value
    return values, controller
