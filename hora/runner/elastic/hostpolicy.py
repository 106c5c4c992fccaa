"""What a failed worker means for its host, and which hosts may take a new worker.

Runner layer; the elastic driver's rules about hosts, on top of :mod:`.health`'s bookkeeping:

* a host is blacklisted on its second failed worker (Horovod's cooldown formula, when given), but
  not when it still has healthy workers (members of the running generation) and the job cannot
  go on without it: the other usable hosts have fewer than ``--min-np`` slots (a host that takes
  no new worker counts with its running workers only). A host whose every worker fails (a
  script that crashes at start) is blacklisted as before, so such a job still ends;
* otherwise the host is *kept*: each failure there past the threshold delays the next worker
  started on it (a doubling backoff, ``--elastic-replace-backoff``), and past
  ``--elastic-replace-limit`` such failures it takes no new worker (its running workers go on);
* a job short of ``--min-np`` on a fixed host list where every host takes no new worker cannot
  grow again: it ends at once instead of waiting ``--elastic-timeout``.
"""

from __future__ import annotations

from collections.abc import Mapping

from hora.runner.elastic.health import HostHealth, Replacements


class HostPolicy:
    """One job's host rules.

    Args:
        min_np: the fewest workers the job trains with.
        cooldown_range: ``--blacklist-cooldown-range`` (None: a blacklisted host never returns).
        names: the settings' names in messages (``min_np``, ``cooldown_range``, and
            ``replace_limit`` when the caller has one).
    """

    def __init__(self, min_np: int, cooldown_range: tuple[float, float] | None,
                 names: Mapping[str, str]) -> None:
        self.min_np = min_np
        self.cooldown_range = cooldown_range
        self.names = names
        self.health = HostHealth(cooldown_range)
        self.replace = Replacements(1.0, 5)

    def configure(self, backoff: float, limit: int) -> None:
        """The replacement knobs (``elastic_replace_backoff`` / ``_limit``), once loaded."""
        self.replace = Replacements(backoff, limit)

    def usable(self, discovered: Mapping[str, int]) -> dict[str, int]:
        """``discovered`` without the blacklisted hosts."""
        return self.health.filter(discovered)

    def may_start(self, host: str) -> bool:
        """Whether a new worker may start on ``host`` now (not in a backoff, not closed)."""
        return self.replace.may_start(host)

    def failed(self, host: str, usable: Mapping[str, int], live: Mapping[str, int],
               healthy: Mapping[str, int]) -> tuple[bool, str]:
        """A worker on ``host`` failed: ``(blacklisted, what to add to the message)``.

        Args:
            usable: the usable hosts now, with their slots.
            live: running workers per host (those not told to leave).
            healthy: per host, the live members of the running generation.
        """
        if self.health.is_blacklisted(host):
            return False, ""  # its other workers, being stopped: already counted
        closed = self.replace.closed()
        others = sum(live.get(h, 0) if h in closed else slots
                     for h, slots in usable.items() if h != host)
        spare = others >= self.min_np or not healthy.get(host, 0)
        if self.health.record_failure(host, can_spare=spare):
            return True, (f"; {host} is blacklisted after repeated failures"
                          + (f" ({self.names['cooldown_range']} lets it return)"
                             if self.cooldown_range is None else " until its cooldown ends"))
        kept = self.health.kept(host)
        if not kept:
            return False, ""
        delay = self.replace.failed(host, kept)
        why = (f"{host} is not blacklisted: the job cannot go on without it (the other hosts "
               f"have fewer than {self.names['min_np']} {self.min_np} slots) and "
               f"{healthy[host]} worker(s) still train there")
        if delay is not None:
            return False, (f"; {why}; a new worker may start there in {delay:g} s (replacement "
                           f"{kept} of {self._limit()})")
        return False, (f"; {why}, and the replacements allowed there ({self._limit()}) are "
                       "used up: it takes no new worker (its running workers go on)")

    def stuck(self, usable: Mapping[str, int], fixed: bool) -> str:
        """Why no worker can ever be added ("": one may): a fixed host list (``fixed``) whose
        every usable host takes no new worker, and no host that may return from a cooldown."""
        closed = self.replace.closed()
        if (not fixed or not closed or any(h not in closed for h in usable)
                or (self.cooldown_range is not None and self.health.blacklisted())):
            return ""
        return "; ".join(f"{h} takes no new worker (the replacements allowed there, "
                         f"{self._limit()}, are used up)" for h in closed)

    def _limit(self) -> str:
        name = self.names.get("replace_limit", "HORA_ELASTIC_REPLACE_LIMIT")
        return f"{name} {self.replace.limit}"


__all__ = ["HostPolicy"]
