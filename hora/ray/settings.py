"""Settings of a :class:`~hora.ray.RayExecutor`: Horovod's ``MiniSettings``.

Launcher side: standard library only. ``RayExecutor.create_settings(...)`` builds one; any
object with the same attributes (e.g. a Horovod ``Settings``) is accepted by the executor, which
reads them with :func:`getattr` and these defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


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


__all__ = ["MiniSettings", "create_settings"]
