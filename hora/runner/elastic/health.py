"""Which hosts may run elastic workers: failure counting, blacklisting and cooldown.

Runner layer; used by the elastic driver. One :class:`HostHealth` per job, thread-safe.

The rule (hora's, stricter about evidence than Horovod's):

* :meth:`HostHealth.record_failure` is called once per worker that failed on a host. A host is
  blacklisted when its failures since it was last (re)admitted reach ``failures_to_blacklist``
  (default 2): one worker dying on a healthy machine does not take the machine out, repeated
  failures do. ``failures_to_blacklist=1`` is Horovod's rule (first failure blacklists).
  Failures reported while a host is blacklisted (its other workers being stopped) are ignored.
* A host is blacklisted only when the job can go on without it (the caller says so:
  ``record_failure(host, can_spare=False)``): blacklisting the last slots a job needs would turn
  one bad process into a lost job. Such a host's failures keep counting; each one past the
  threshold is a *kept* failure (:meth:`HostHealth.kept`), and :class:`Replacements` decides
  when its failed worker is replaced (a doubling backoff) and when the host takes no new worker
  (past ``--elastic-replace-limit``).
* Without a cooldown range a blacklisted host never returns (Horovod's default).
* With ``cooldown_range=(lo, hi)`` (``--blacklist-cooldown-range``) each blacklisting of a host
  increments its counter ``c`` (so the first blacklisting has ``c = 1``) and keeps it out for
  ``clamp(lo * 2**c + U(0,1) * lo, lo, hi)`` seconds, Horovod's formula: the first cooldown is
  at least ``2 * lo``, each later one about twice as long, never more than ``hi``. The counter
  survives resurrection, so a host that keeps failing stays out longer each time.
* When a cooldown has expired the host is *resurrected*: the first query after the expiry
  (:meth:`~HostHealth.is_blacklisted`, :meth:`~HostHealth.blacklisted`,
  :meth:`~HostHealth.filter`, :meth:`~HostHealth.record_failure`) readmits it with a failure
  count of 0 and queues it for :meth:`~HostHealth.take_resurrected`. The driver counts a
  resurrected host that discovery still lists as an *added* host (Horovod's rule).

Typical driver use, once per discovery poll::

    usable = health.filter(discovered)          # drops blacklisted hosts, keeps the order
    returning = set(health.take_resurrected())  # came back from cooldown since the last poll
    added = [h for h in usable if h not in previous or h in returning]

Times come from ``clock`` (``time.monotonic``) and the jitter from ``rng`` (``random.random``);
both are injectable so tests can drive them.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hora._util.log import get_logger
from hora.errors import ConfigError

log = get_logger(__name__)

COOLDOWN_MIN_S = 1.0
"""The smallest lower bound ``--blacklist-cooldown-range`` accepts (Horovod's)."""
COOLDOWN_MAX_S = 3600.0
"""The largest upper bound ``--blacklist-cooldown-range`` accepts (Horovod's)."""


@dataclass
class _Host:
    failures: int = 0  # failed workers since the host was last (re)admitted
    times_blacklisted: int = 0  # Horovod's per-host counter c
    out_until: float | None = None  # None: admitted; inf: blacklisted for good


class HostHealth:
    """Failure counts, blacklist and cooldowns of a job's hosts.

    Args:
        cooldown_range: ``(lo, hi)`` seconds, or None for a permanent blacklist.
        failures_to_blacklist: failed workers on one host that blacklist it (>= 1).
        clock: monotonic seconds.
        rng: uniform floats in ``[0, 1)``.

    Raises:
        ConfigError: ``cooldown_range`` is not ``1 <= lo <= hi <= 3600``.
        ValueError: ``failures_to_blacklist`` < 1.
    """

    def __init__(self, cooldown_range: tuple[float, float] | None = None,
                 failures_to_blacklist: int = 2, *,
                 clock: Callable[[], float] = time.monotonic,
                 rng: Callable[[], float] = random.random) -> None:
        if cooldown_range is not None:
            _check_cooldown_range(cooldown_range)
        if failures_to_blacklist < 1:
            raise ValueError(f"failures_to_blacklist must be >= 1, not {failures_to_blacklist}")
        self.cooldown_range = cooldown_range
        self.failures_to_blacklist = failures_to_blacklist
        self._clock = clock
        self._rng = rng
        self._hosts: dict[str, _Host] = {}
        self._resurrected: list[str] = []
        self._lock = threading.Lock()

    def record_failure(self, host: str, *, can_spare: bool = True) -> bool:
        """Count one failed worker on ``host``; True when this failure blacklisted it.

        A failure on a host that is already blacklisted is ignored (returns False): it neither
        counts towards a later blacklisting nor lengthens the cooldown. With ``can_spare=False``
        (the job cannot go on without the host) the failure is counted but never blacklists.
        """
        with self._lock:
            now = self._clock()
            self._expire(now)
            state = self._hosts.setdefault(host, _Host())
            if state.out_until is not None:
                return False
            state.failures += 1
            if state.failures < self.failures_to_blacklist:
                log.info("a worker on host %s failed (%d of %d failures that blacklist it)",
                         host, state.failures, self.failures_to_blacklist)
                return False
            if not can_spare:
                log.info("a worker on host %s failed (%d failures); not blacklisting it: the job "
                         "cannot go on without it", host, state.failures)
                return False
            state.times_blacklisted += 1
            cooldown = self._cooldown(state.times_blacklisted)
            state.out_until = now + cooldown
            if math.isinf(cooldown):
                log.info("blacklisting host %s after %d failed workers; it will not be used "
                         "again in this job (a cooldown range lets it return: hora run's "
                         "--blacklist-cooldown-range, or cooldown_range= in "
                         "ElasticRayExecutor.create_settings)", host, state.failures)
            else:
                log.info("blacklisting host %s after %d failed workers, for %.1f s "
                         "(blacklisting number %d)", host, state.failures, cooldown,
                         state.times_blacklisted)
            return True

    def is_blacklisted(self, host: str) -> bool:
        """Whether ``host`` may not run workers now (resurrects it if its cooldown expired)."""
        with self._lock:
            self._expire(self._clock())
            state = self._hosts.get(host)
            return state is not None and state.out_until is not None

    def blacklisted(self) -> list[str]:
        """The hosts blacklisted now, in the order they were first seen."""
        with self._lock:
            self._expire(self._clock())
            return [host for host, state in self._hosts.items() if state.out_until is not None]

    def filter(self, hosts: Mapping[str, int]) -> dict[str, int]:
        """``hosts`` without the blacklisted ones, in the same order."""
        with self._lock:
            self._expire(self._clock())
            return {host: slots for host, slots in hosts.items()
                    if (state := self._hosts.get(host)) is None or state.out_until is None}

    def take_resurrected(self) -> list[str]:
        """The hosts whose cooldown expired since the last call, in the order they came back;
        each resurrection is reported once."""
        with self._lock:
            self._expire(self._clock())
            taken, self._resurrected = self._resurrected, []
            return taken

    def failures(self, host: str) -> int:
        """Failed workers on ``host`` since it was last (re)admitted."""
        with self._lock:
            self._expire(self._clock())
            state = self._hosts.get(host)
            return 0 if state is None else state.failures

    def kept(self, host: str) -> int:
        """Failures of ``host`` at or past the blacklisting threshold that did not blacklist it
        (0: none; 1: the failure that would have blacklisted it, ...)."""
        return max(0, self.failures(host) - self.failures_to_blacklist + 1)

    def _cooldown(self, count: int) -> float:
        """Seconds out for a host's ``count``-th blacklisting (Horovod's formula)."""
        if self.cooldown_range is None:
            return math.inf
        lo, hi = self.cooldown_range
        return max(lo, min(hi, lo * 2.0 ** count + self._rng() * lo))

    def _expire(self, now: float) -> None:
        """Readmit every host whose cooldown ended by ``now`` (caller holds the lock)."""
        for host, state in self._hosts.items():
            if state.out_until is not None and state.out_until <= now:
                state.out_until = None
                state.failures = 0
                self._resurrected.append(host)
                log.info("host %s is back from its blacklist cooldown", host)


BACKOFF_CAP_S = 60.0
"""The longest wait before a replacement on a kept host, however many failed before."""


class Replacements:
    """When a kept host (one the job cannot go on without) gets a new worker.

    Its ``n``-th kept failure (:meth:`HostHealth.kept`) delays the next worker started there by
    ``min(backoff * 2**(n-1), 60)`` seconds; past ``limit`` kept failures the host is *closed*:
    its running workers go on, it takes no new one for the rest of the job.

    Args:
        backoff: seconds before the first replacement (``--elastic-replace-backoff``), >= 0.
        limit: kept failures replaced on a host (``--elastic-replace-limit``), >= 0.
        clock: monotonic seconds.
    """

    def __init__(self, backoff: float, limit: int, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backoff, self.limit = backoff, limit
        self._clock = clock
        self._not_before: dict[str, float] = {}
        self._closed: dict[str, int] = {}

    def failed(self, host: str, kept: int) -> float | None:
        """``host``'s ``kept``-th kept failure (>= 1): the seconds before its next worker may
        start, or None when ``kept`` passed the limit and the host is closed now."""
        if kept > self.limit:
            self._closed[host] = kept
            return None
        delay = min(BACKOFF_CAP_S, self.backoff * 2.0 ** (kept - 1))
        self._not_before[host] = self._clock() + delay
        return delay

    def may_start(self, host: str) -> bool:
        """Whether a new worker may start on ``host`` now."""
        return host not in self._closed and self._clock() >= self._not_before.get(host, -math.inf)

    def closed(self) -> dict[str, int]:
        """The closed hosts, each with the kept failures that closed it."""
        return dict(self._closed)


def _check_cooldown_range(cooldown_range: tuple[float, float]) -> None:
    lo, hi = cooldown_range
    given = f"--blacklist-cooldown-range {lo:g} {hi:g}"
    if not lo >= COOLDOWN_MIN_S:
        raise ConfigError(f"{given}: the lower bound must be >= {COOLDOWN_MIN_S:g} s")
    if not hi <= COOLDOWN_MAX_S:
        raise ConfigError(f"{given}: the upper bound must be <= {COOLDOWN_MAX_S:g} s (one hour)")
    if not lo <= hi:
        raise ConfigError(f"{given}: the lower bound must not exceed the upper bound; give "
                          "MIN MAX")


__all__ = ["BACKOFF_CAP_S", "COOLDOWN_MAX_S", "COOLDOWN_MIN_S", "HostHealth", "Replacements"]
