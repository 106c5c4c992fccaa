"""Settings of a :class:`~hora.ray.RayExecutor` (Horovod's ``MiniSettings``) and of an
:class:`~hora.ray.ElasticRayExecutor` (Horovod's ``ElasticSettings``).

Launcher side: standard library only (the cooldown check borrows the elastic runner's).
``RayExecutor.create_settings(...)`` builds one; any object with the same attributes (e.g. a
Horovod ``Settings``) is accepted by the executor, which reads them with :func:`getattr` and
these defaults.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any


@dataclass
class MiniSettings:
    """What a :class:`~hora.ray.RayExecutor` needs to know besides its worker counts.

    Attributes:
        nics: network interface names the ranks use (``{"eth0"}``): the first one (sorted) is
            exported to every worker as ``HORA_GLOO_IFACE``, all of them as
            ``NCCL_SOCKET_IFNAME``, and the driver serves the rendezvous store on its address
            there. None: the ranks pick the route to the driver's store themselves.
        verbose: 0 quiet; 1 (Horovod's default) logs the placement at INFO; 2 also each
            worker's environment (never the secret).
        ssh_port: accepted for Horovod compatibility; unused (Ray starts the workers, not ssh).
        ssh_identity_file: accepted; unused for the same reason.
        timeout_s: seconds the workers have to start and to meet at the rendezvous: the wait
            for the actors to come up in :meth:`~hora.ray.RayExecutor.start`, and every
            worker's ``HORA_START_TIMEOUT``.
        placement_group_timeout_s: seconds :meth:`~hora.ray.RayExecutor.start` waits for the
            placement group (the cluster's free resources) before it raises TimeoutError.
        elastic: False for a :class:`~hora.ray.RayExecutor` (set by the executor).
    """

    nics: set[str] | None = None
    verbose: int = 1
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    timeout_s: float = 30.0
    placement_group_timeout_s: float = 100.0
    elastic: bool = field(default=False)


def create_settings(timeout_s: float = 30, ssh_identity_file: str | None = None,
                    ssh_str: str | None = None, placement_group_timeout_s: float = 100,
                    nics: set[str] | None = None) -> MiniSettings:
    """Horovod's ``RayExecutor.create_settings``.

    Args:
        timeout_s: see :attr:`MiniSettings.timeout_s` (> 0).
        ssh_identity_file: a private key file path (unused by hora; kept for compatibility).
        ssh_str: the private key's contents: written to ``ssh_identity_file`` (mode 0600) when
            that file does not exist yet, as Horovod does.
        placement_group_timeout_s: see :attr:`MiniSettings.placement_group_timeout_s` (> 0).
        nics: see :attr:`MiniSettings.nics`.

    Raises:
        ValueError: a timeout <= 0, or ``ssh_str`` without ``ssh_identity_file``.
    """
    if timeout_s <= 0 or placement_group_timeout_s <= 0:
        raise ValueError(f"timeout_s ({timeout_s}) and placement_group_timeout_s "
                         f"({placement_group_timeout_s}) must be > 0 seconds")
    if ssh_str:
        if not ssh_identity_file:
            raise ValueError("ssh_str needs ssh_identity_file: the path to write the key to")
        if not os.path.exists(ssh_identity_file):
            fd = os.open(ssh_identity_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(ssh_str)
    return MiniSettings(nics=set(nics) if nics else None, ssh_identity_file=ssh_identity_file,
                        timeout_s=float(timeout_s),
                        placement_group_timeout_s=float(placement_group_timeout_s))




@dataclass
class ElasticSettings:
    """What an :class:`~hora.ray.ElasticRayExecutor` needs: Horovod's ``ElasticSettings``
    (the fields it reads), made by :func:`create_elastic_settings`.

    Attributes:
        discovery: the host discovery (``find_available_hosts_and_slots()``); set by the
            executor to a :class:`~hora.ray.discovery.RayHostDiscovery` unless it is given
            ``override_discovery=False``.
        min_num_proc: the fewest workers training goes on with.
        max_num_proc: the most workers (None: as many as the cluster has slots).
        num_proc: workers that must be ready before training starts (default ``min_num_proc``).
        reset_limit: resets after which the job fails (None: no limit).
        elastic_timeout: seconds the job waits for enough workers (at the start, and after a
            failure leaves fewer than ``min_num_proc``) before it fails.
        cooldown_range: ``(lo, hi)`` seconds a blacklisted host stays out (None: for good).
        timeout_s: seconds a worker has to start and to meet the others at the rendezvous.
        nics: interface names, as for :class:`MiniSettings`.
        verbose: 0/1 log the job's membership changes and failures; 2 also every decision and
            every worker's environment (never the secret).
        ssh_identity_file, ssh_port: accepted for Horovod compatibility; unused.
    """

    discovery: Any = None
    min_num_proc: int = 1
    max_num_proc: int | None = None
    num_proc: int = 1
    reset_limit: int | None = None
    elastic_timeout: float = 600.0
    cooldown_range: tuple[float, float] | None = None
    timeout_s: float = 30.0
    nics: set[str] | None = None
    verbose: int = 1
    ssh_identity_file: str | None = None
    ssh_port: int | None = None
    elastic: bool = field(default=True)

    @property
    def min_np(self) -> int:
        """Horovod's older name of :attr:`min_num_proc`."""
        return self.min_num_proc

    @property
    def max_np(self) -> int | None:
        """Horovod's older name of :attr:`max_num_proc`."""
        return self.max_num_proc


_ELASTIC_EXTRAS = ("num_proc", "cooldown_range", "verbose", "ssh_port")


def create_elastic_settings(min_num_proc: int = 1, max_num_proc: int | None = None,
                            reset_limit: int | None = None, elastic_timeout: float = 600,
                            timeout_s: float = 30, ssh_identity_file: str | None = None,
                            nics: set[str] | None = None, min_np: int | None = None,
                            max_np: int | None = None, **kwargs: Any) -> ElasticSettings:
    """Horovod's ``ElasticRayExecutor.create_settings``.

    Args:
        min_num_proc, max_num_proc, reset_limit, elastic_timeout, timeout_s, nics: see
            :class:`ElasticSettings`.
        ssh_identity_file: accepted for compatibility; unused (Ray starts the workers).
        min_np, max_np: Horovod's deprecated names of ``min_num_proc`` / ``max_num_proc``
            (a DeprecationWarning; the new name wins when both are given).
        kwargs: ``num_proc``, ``cooldown_range``, ``verbose``, ``ssh_port`` (Horovod passes its
            keywords on to ``ElasticSettings``).

    Raises:
        ValueError: counts or timeouts out of range (``1 <= min_num_proc <= num_proc <=
            max_num_proc``, timeouts > 0, ``reset_limit >= 0``).
        TypeError: an unknown keyword.
        ConfigError: a bad ``cooldown_range``.
    """
    unknown = sorted(set(kwargs) - set(_ELASTIC_EXTRAS))
    if unknown:
        raise TypeError(f"create_settings() got unexpected keyword(s) {', '.join(unknown)}; "
                        f"besides its own it accepts {', '.join(_ELASTIC_EXTRAS)}")
    if min_np is not None:
        warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning,
                      stacklevel=2)
        min_num_proc = min_np if min_num_proc == 1 else min_num_proc
    if max_np is not None:
        warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning,
                      stacklevel=2)
        max_num_proc = max_np if max_num_proc is None else max_num_proc
    num_proc = kwargs.get("num_proc")
    num_proc = min_num_proc if num_proc is None else num_proc
    for name, value in (("min_num_proc", min_num_proc), ("num_proc", num_proc),
                        ("max_num_proc", max_num_proc), ("reset_limit", reset_limit)):
        low = 0 if name == "reset_limit" else 1
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < low):
            raise ValueError(f"{name} must be an int >= {low}, not {value!r}")
    if num_proc < min_num_proc or (max_num_proc is not None and num_proc > max_num_proc):
        raise ValueError(f"need min_num_proc ({min_num_proc}) <= num_proc ({num_proc}) <= "
                         f"max_num_proc ({max_num_proc})")
    if not (elastic_timeout > 0 and timeout_s > 0):
        raise ValueError(f"elastic_timeout ({elastic_timeout}) and timeout_s ({timeout_s}) "
                         "must be > 0 seconds")
    cooldown = kwargs.get("cooldown_range")
    if cooldown is not None:
        from hora.runner.elastic.health import HostHealth

        cooldown = (float(cooldown[0]), float(cooldown[1]))
        HostHealth(cooldown)  # the range's checks, with their messages
    return ElasticSettings(
        min_num_proc=min_num_proc, max_num_proc=max_num_proc, num_proc=num_proc,
        reset_limit=reset_limit, elastic_timeout=float(elastic_timeout),
        cooldown_range=cooldown, timeout_s=float(timeout_s), nics=set(nics) if nics else None,
        verbose=int(kwargs.get("verbose", 1) or 0), ssh_identity_file=ssh_identity_file,
        ssh_port=kwargs.get("ssh_port"))


__all__ = ["ElasticSettings", "MiniSettings", "create_elastic_settings", "create_settings"]
