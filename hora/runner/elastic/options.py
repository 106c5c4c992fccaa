"""What makes a ``hora run`` job elastic: :class:`ElasticOptions`, checked once for the CLI's
flags and ``hora.run``'s keywords by :func:`elastic_options`."""

from __future__ import annotations

from dataclasses import dataclass

from hora.errors import ConfigError
from hora.runner.elastic.discovery import FixedHosts, HostDiscovery, HostDiscoveryScript
from hora.runner.elastic.health import HostHealth
from hora.runner.hosts import HostSlots

DEFAULT_ELASTIC_TIMEOUT_S = 600.0
"""``--elastic-timeout`` / ``HOROVOD_ELASTIC_TIMEOUT`` default (Horovod's)."""


@dataclass(frozen=True)
class ElasticOptions:
    """What makes a job elastic (``hora run`` flags of the same names)."""

    discovery: HostDiscovery
    min_np: int
    max_np: int | None = None
    reset_limit: int | None = None
    cooldown_range: tuple[float, float] | None = None
    elastic_timeout: float | None = None  # None: the elastic_timeout knob (HOROVOD_ELASTIC_TIMEOUT)


def elastic_options(np: int, *, min_np: int | None, max_np: int | None,
                    hosts: tuple[HostSlots, ...], discovery_script: str | None,
                    slots_per_host: int | None, reset_limit: int | None,
                    cooldown_range: tuple[float, float] | None) -> ElasticOptions:
    """Check and combine the elastic arguments (``hora run`` flags or ``hora.run`` keywords).

    Raises:
        ConfigError: inconsistent np / min_np / max_np, hosts with a discovery script, or a bad
            cooldown range.
    """
    min_np = np if min_np is None else min_np
    if min_np > np:
        raise ConfigError(f"--min-np {min_np} is more than -np {np}: -np is how many workers "
                          "start, --min-np the fewest the job trains with")
    if max_np is not None and max_np < np:
        raise ConfigError(f"--max-np {max_np} is less than -np {np}")
    if cooldown_range is not None:
        HostHealth(cooldown_range)  # validates the range, with the flag's name in the message
    discovery: HostDiscovery
    if discovery_script is not None:
        if hosts:
            raise ConfigError("--host-discovery-script and -H/--hostfile exclude each other: "
                              "the script says which hosts the job may use")
        discovery = HostDiscoveryScript(discovery_script, slots_per_host)
    else:
        discovery = FixedHosts(hosts or (HostSlots("localhost", max_np or np),))
    return ElasticOptions(discovery=discovery, min_np=min_np, max_np=max_np,
                          reset_limit=reset_limit, cooldown_range=cooldown_range)


__all__ = ["DEFAULT_ELASTIC_TIMEOUT_S", "ElasticOptions", "elastic_options"]
