"""Host health for elastic mode: failure threshold, blacklist, cooldown and resurrection.

Time and jitter are driven by a fake clock and a fixed random value, so every cooldown is exact.
"""

from __future__ import annotations

import math
import threading

import pytest

from hora.errors import ConfigError
from hora.runner.elastic.health import BACKOFF_CAP_S, HostHealth, Replacements
from hora.runner.elastic.hostpolicy import HostPolicy


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def health(cooldown: tuple[float, float] | None = None, failures: int = 2,
           jitter: float = 0.0) -> tuple[HostHealth, Clock]:
    clock = Clock()
    return HostHealth(cooldown, failures, clock=clock, rng=lambda: jitter), clock


def blacklist(h: HostHealth, host: str) -> None:
    while not h.record_failure(host):
        assert h.failures(host) < h.failures_to_blacklist


def test_one_failure_does_not_blacklist_two_do() -> None:
    h, _ = health()
    assert h.record_failure("a") is False
    assert not h.is_blacklisted("a") and h.failures("a") == 1
    assert h.record_failure("b") is False  # counted per host
    assert h.record_failure("a") is True
    assert h.is_blacklisted("a") and not h.is_blacklisted("b")
    assert h.blacklisted() == ["a"]


def test_horovods_rule_with_a_threshold_of_one() -> None:
    h, _ = health(failures=1)
    assert h.record_failure("a") is True
    assert h.blacklisted() == ["a"]


def test_failures_on_a_blacklisted_host_are_ignored() -> None:
    h, clock = health(cooldown=(10, 1000))
    blacklist(h, "a")
    assert h.record_failure("a") is False  # its other workers being stopped
    assert h.record_failure("a") is False
    clock.advance(19.999)  # the first cooldown is 2 * lo = 20 s, not lengthened by the above
    assert h.is_blacklisted("a")
    clock.advance(0.001)
    assert not h.is_blacklisted("a")


def test_without_a_cooldown_range_a_host_never_returns() -> None:
    h, clock = health()
    blacklist(h, "a")
    clock.advance(1e9)
    assert h.is_blacklisted("a") and h.take_resurrected() == []


def test_unknown_hosts_are_healthy() -> None:
    h, _ = health()
    assert not h.is_blacklisted("nowhere") and h.failures("nowhere") == 0
    assert h.blacklisted() == [] and h.take_resurrected() == []


@pytest.mark.parametrize("jitter", [0.0, 0.5, 0.999])
def test_cooldowns_follow_horovods_formula(jitter: float) -> None:
    lo, hi = 2.0, 3600.0
    h, clock = health(cooldown=(lo, hi), jitter=jitter)
    for count in range(1, 6):
        blacklist(h, "a")
        expected = lo * 2 ** count + jitter * lo  # count is incremented before use
        clock.advance(expected - 1e-6)
        assert h.is_blacklisted("a"), f"blacklisting {count} ended early"
        clock.advance(2e-6)
        assert not h.is_blacklisted("a"), f"blacklisting {count} did not last {expected} s"
        assert h.take_resurrected() == ["a"]


def test_cooldowns_are_clamped_to_the_range() -> None:
    h, clock = health(cooldown=(5, 30), jitter=0.9)
    waits = []
    for _ in range(4):
        blacklist(h, "a")
        start = clock.now
        while h.is_blacklisted("a"):
            clock.advance(0.5)
        waits.append(clock.now - start)
    # 5*2 + 4.5 = 14.5, 5*4 + 4.5 = 24.5, then 44.5 and 84.5 clamped to 30
    assert waits == [14.5, 24.5, 30.0, 30.0]


def test_a_range_of_one_value_gives_that_cooldown() -> None:
    h, clock = health(cooldown=(7, 7), jitter=0.5)
    for _ in range(3):
        blacklist(h, "a")
        clock.advance(6.99)
        assert h.is_blacklisted("a")
        clock.advance(0.01)
        assert not h.is_blacklisted("a")


def test_resurrection_resets_the_failure_count_and_is_reported_once() -> None:
    h, clock = health(cooldown=(1, 60))
    blacklist(h, "a")
    h.record_failure("b")
    clock.advance(2.0)
    assert h.take_resurrected() == ["a"]
    assert h.take_resurrected() == []
    assert not h.is_blacklisted("a") and h.failures("a") == 0
    assert h.failures("b") == 1  # a host that was never blacklisted keeps its count
    assert h.record_failure("a") is False  # a fresh start: one failure is not enough
    assert h.record_failure("a") is True
    clock.advance(4.0)  # the second cooldown is 4 s
    assert h.filter({"a": 2}) == {"a": 2}
    assert h.take_resurrected() == ["a"]


def test_resurrections_are_reported_in_the_order_they_happen() -> None:
    h, clock = health(cooldown=(1, 60))  # a first cooldown of 2 s
    blacklist(h, "late")
    clock.advance(1.0)
    blacklist(h, "early")
    assert h.record_failure("early") is False  # ignored: already out
    clock.advance(0.5)
    assert h.blacklisted() == ["late", "early"]
    clock.advance(0.5)
    assert h.blacklisted() == ["early"]
    clock.advance(1.0)
    assert h.blacklisted() == []
    assert h.take_resurrected() == ["late", "early"]


def test_filter_drops_blacklisted_hosts_and_keeps_the_order() -> None:
    h, clock = health(cooldown=(1, 60), failures=1)
    h.record_failure("b")
    h.record_failure("d")
    hosts = {"d": 1, "a": 4, "b": 2, "c": 3}
    assert h.filter(hosts) == {"a": 4, "c": 3}
    assert list(h.filter(hosts)) == ["a", "c"]
    assert hosts == {"d": 1, "a": 4, "b": 2, "c": 3}  # not changed
    clock.advance(2.0)
    assert list(h.filter(hosts)) == ["d", "a", "b", "c"]
    assert h.take_resurrected() == ["b", "d"]


@pytest.mark.parametrize(("lo", "hi", "problem"), [
    (0.5, 10, r"lower bound must be >= 1 s"),
    (0, 10, r"lower bound must be >= 1 s"),
    (1, 3601, r"upper bound must be <= 3600 s"),
    (30, 10, r"lower bound must not exceed the upper bound"),
    (math.nan, 10, r"lower bound must be >= 1 s"),
])
def test_cooldown_range_is_validated(lo: float, hi: float, problem: str) -> None:
    with pytest.raises(ConfigError, match=rf"--blacklist-cooldown-range {lo:g} {hi:g}: the "
                       + problem):
        HostHealth((lo, hi))


def test_the_cooldown_range_limits_are_allowed() -> None:
    HostHealth((1, 3600))
    HostHealth((1, 1))


@pytest.mark.parametrize("failures", [0, -1])
def test_failures_to_blacklist_must_be_positive(failures: int) -> None:
    with pytest.raises(ValueError, match=f"failures_to_blacklist must be >= 1, not {failures}"):
        HostHealth(None, failures)


def test_real_clock_and_threads() -> None:
    h = HostHealth(None, 50)  # time.monotonic and random.random
    results: list[bool] = []

    def fail() -> None:
        for _ in range(25):
            results.append(h.record_failure("a"))

    threads = [threading.Thread(target=fail) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert results.count(True) == 1  # exactly the 50th failure blacklisted it
    assert h.blacklisted() == ["a"]


# ---- hosts the job cannot go on without ---------------------------------------------------------

def test_a_host_the_job_cannot_spare_is_never_blacklisted_and_its_failures_are_kept() -> None:
    h, _ = health()
    assert h.kept("a") == 0
    assert h.record_failure("a", can_spare=False) is False and h.kept("a") == 0  # below
    assert h.record_failure("a", can_spare=False) is False and h.kept("a") == 1  # threshold
    assert h.record_failure("a", can_spare=False) is False and h.kept("a") == 2
    assert not h.is_blacklisted("a") and h.failures("a") == 3
    assert h.record_failure("a") is True  # once the job can go on without it


def test_replacements_back_off_double_and_stop_past_the_limit() -> None:
    clock = Clock()
    r = Replacements(0.5, 3, clock=clock)
    assert r.may_start("a")
    assert [r.failed("a", n) for n in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert not r.may_start("a") and r.may_start("b")
    clock.advance(1.99)
    assert not r.may_start("a")
    clock.advance(0.01)
    assert r.may_start("a") and r.closed() == {}
    assert r.failed("a", 4) is None  # past the limit: closed for good
    clock.advance(1e6)
    assert not r.may_start("a") and r.closed() == {"a": 4}


def test_the_replacement_backoff_is_capped() -> None:
    r = Replacements(10.0, 100, clock=Clock())
    assert r.failed("a", 20) == BACKOFF_CAP_S


def test_a_replace_limit_of_zero_closes_the_host_at_its_threshold() -> None:
    r = Replacements(1.0, 0, clock=Clock())
    assert r.failed("a", 1) is None and not r.may_start("a")


NAMES = {"min_np": "--min-np", "cooldown_range": "--blacklist-cooldown-range",
         "replace_limit": "--elastic-replace-limit"}


def test_host_policy_blacklists_only_what_the_job_can_spare() -> None:
    policy = HostPolicy(2, None, NAMES)
    policy.configure(1.0, 5)
    usable = {"a": 2, "b": 1}
    live = {"a": 2, "b": 1}
    assert policy.failed("b", usable, live, live) == (False, "")
    blacklisted, note = policy.failed("b", usable, live, live)  # a's 2 slots meet --min-np 2
    assert blacklisted and note.startswith("; b is blacklisted after repeated failures")
    usable = policy.usable(usable)
    assert usable == {"a": 2}
    live = {"a": 1}
    assert policy.failed("a", usable, live, live) == (False, "")
    blacklisted, note = policy.failed("a", usable, live, live)  # nothing else: kept
    assert not blacklisted
    assert note == ("; a is not blacklisted: the job cannot go on without it (the other hosts "
                    "have fewer than --min-np 2 slots) and 1 worker(s) still train there; a new "
                    "worker may start there in 1 s (replacement 1 of --elastic-replace-limit 5)")
    assert not policy.may_start("a") and policy.stuck(usable, fixed=True) == ""


def test_host_policy_says_when_no_worker_can_be_added() -> None:
    policy = HostPolicy(2, None, {k: v for k, v in NAMES.items() if k != "replace_limit"})
    policy.configure(0.0, 0)
    usable = {"a": 3}
    policy.failed("a", usable, {"a": 2}, {"a": 2})
    _, note = policy.failed("a", usable, {"a": 1}, {"a": 1})
    assert note.endswith("the replacements allowed there (HORA_ELASTIC_REPLACE_LIMIT 0) are "
                         "used up: it takes no new worker (its running workers go on)")
    assert policy.stuck(usable, fixed=False) == ""  # discovery may list another host
    assert policy.stuck(usable, fixed=True) == (
        "a takes no new worker (the replacements allowed there, HORA_ELASTIC_REPLACE_LIMIT 0, "
        "are used up)")


def test_a_host_without_healthy_workers_is_blacklisted_even_if_it_is_the_last() -> None:
    # every worker fails (a script that crashes at start): the job must end, not loop
    policy = HostPolicy(2, None, NAMES)
    usable = {"a": 2}
    assert policy.failed("a", usable, {"a": 1}, {}) == (False, "")
    blacklisted, _ = policy.failed("a", usable, {"a": 1}, {})
    assert blacklisted and policy.usable(usable) == {}
