"""The environment each worker actor gets: what ``hora run`` gives a rank, set by the driver in
the actor's own ``os.environ`` before the user's function calls ``hora.init()``.

Launcher side: base, rendezvous and runner modules only (and Ray, for :func:`ensure_driver`).
"""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Mapping
from typing import Any

from hora.errors import ConfigError
from hora.rendezvous.topology import Slot, identity_environment
from hora.runner.launch import IDENTITY_VARS, LAUNCHER_DEFAULTS, SECRET_VAR

log = logging.getLogger(__name__)

LAUNCHER_NAME = "hora.ray"
"""``HORA_LAUNCHER`` of a Ray worker."""

_KNOB_PREFIXES = ("HORA_", "HOROVOD_")


def driver_knobs(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The driver's ``HORA_*`` / ``HOROVOD_*`` settings, forwarded to every worker as ``hora
    run`` forwards its environment (identity, rendezvous and secret variables excepted)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items()
            if k.startswith(_KNOB_PREFIXES) and k not in IDENTITY_VARS
            and k != "_HOROVOD_SECRET_KEY"}


def check_extra(extra_env_vars: Mapping[str, Any] | None) -> dict[str, str]:
    """``extra_env_vars`` as strings.

    Raises:
        ConfigError: it sets an identity, rendezvous or secret variable (the executor sets
            those for each worker itself).
    """
    extra = {str(k): str(v) for k, v in (extra_env_vars or {}).items()}
    clash = sorted(k for k in extra if k in IDENTITY_VARS)
    if clash:
        raise ConfigError(f"extra_env_vars cannot set {', '.join(clash)}: the executor sets it "
                          "for each worker itself")
    return extra


def worker_environment(slot: Slot, *, store: tuple[str, int], secret_hex: str, job_id: str,
                       start_timeout: float, nics: list[str], knobs: Mapping[str, str],
                       extra: Mapping[str, str], devices: str | None) -> dict[str, str]:
    """Rank ``slot.rank``'s variables, in the order they override each other: defaults,
    the driver's knobs, settings, ``extra_env_vars``, then identity, rendezvous and secret."""
    env = dict(LAUNCHER_DEFAULTS)
    env.pop("PYTHONUNBUFFERED", None)  # the actor's output is Ray's business
    env.update(knobs)
    env["HORA_START_TIMEOUT"] = f"{start_timeout:g}"
    if nics:
        env["HORA_GLOO_IFACE"] = nics[0]
        env["NCCL_SOCKET_IFNAME"] = ",".join(nics)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    env.update(extra)
    host, port = store
    env.update({"HORA_RENDEZVOUS_ADDR": host, "HORA_RENDEZVOUS_PORT": str(port),
                "HOROVOD_GLOO_RENDEZVOUS_ADDR": host, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
                "HORA_JOB_ID": job_id, "HORA_LAUNCHER": LAUNCHER_NAME})
    env.update(identity_environment(slot))
    env[SECRET_VAR] = secret_hex
    return env


def stale_variables(env: Mapping[str, str]) -> list[str]:
    """Identity variables a worker must not keep from the environment Ray started it with."""
    return sorted(IDENTITY_VARS - set(env))


def describe(env: Mapping[str, str]) -> str:
    """``K=V ...`` for a log line; the secret is never shown."""
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k != SECRET_VAR)


__all__ = ["LAUNCHER_NAME", "check_extra", "describe", "driver_knobs", "stale_variables",
           "worker_environment"]


def ensure_driver() -> None:
    """Make sure this process is a Ray driver on the cluster: ``ray.init()`` when Ray is not
    initialized yet.

    Raises:
        NotImplementedError: a ``ray://`` client connection (the driver serves the rendezvous
            store the workers connect to, so it must run on the cluster).
    """
    import ray

    if ray.util.client.ray.is_connected():
        raise NotImplementedError(
            "hora.ray: the driver must run on the Ray cluster (it serves the rendezvous "
            "store the workers connect to); a ray:// client connection is not supported. "
            "HINT: submit the driver script with `ray job submit -- python train.py`.")
    if not ray.is_initialized():
        log.info("hora.ray: Ray is not initialized; calling ray.init()")
        ray.init()
