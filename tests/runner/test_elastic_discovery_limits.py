"""Host discovery that misbehaves: endless output, a script that hangs until the job stops, a
source that raises anything, an error repeated with a changing text. Real scripts through
/bin/sh; the poller is driven one run at a time with a fake clock."""

from __future__ import annotations

import resource
import shlex
import sys
import threading
import time
from pathlib import Path

import pytest

from hora.errors import DiscoveryError
from hora.runner.elastic.discovery import MAX_OUTPUT_BYTES, HostDiscoveryScript
from hora.runner.elastic.poller import REPEAT_EVERY_S, DiscoveryPoller

from .helpers import wait_dead
from .test_elastic_discovery import script

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="runs /bin/sh scripts and reads /proc")


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def pid_files(tmp_path: Path) -> str:
    """Script lines that start a child in the background and record both pids."""
    return (f"sleep 1000 &\necho $! > {shlex.quote(str(tmp_path / 'child.pid'))}\n"
            f"echo $$ > {shlex.quote(str(tmp_path / 'script.pid'))}\n")


def read_pids(tmp_path: Path, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    paths = [tmp_path / "child.pid", tmp_path / "script.pid"]
    while not all(p.exists() and p.read_text().strip() for p in paths):
        assert time.monotonic() < deadline, "the script did not write its pids"
        time.sleep(0.02)
    return [int(p.read_text()) for p in paths]


def test_endless_output_is_an_error_naming_the_script_and_it_is_killed(tmp_path: Path) -> None:
    # printed endlessly, this grew the launcher to 1.8 GB in 2 s before the limit
    body = pid_files(tmp_path) + "yes localhost:1\n"
    disc = HostDiscoveryScript(script(tmp_path, body), None, timeout=30.0)
    before, started = max_rss_mib(), time.monotonic()
    with pytest.raises(DiscoveryError, match=r"discover\.sh.* printed more than 1048576 bytes "
                       r"\(1 MiB\) on stdout; it was killed with its process group"):
        disc.find_available_hosts_and_slots()
    assert time.monotonic() - started < 5.0
    assert max_rss_mib() - before < 50, "the output was read without a limit"
    assert not wait_dead(read_pids(tmp_path), timeout=5.0)


def test_output_just_under_the_limit_is_read(tmp_path: Path) -> None:
    line = "localhost:1\n"
    repeats = (MAX_OUTPUT_BYTES - 1) // len(line)
    disc = HostDiscoveryScript(script(tmp_path, f"yes localhost:1 | head -n {repeats}\n"), None)
    assert disc.find_available_hosts_and_slots() == {"localhost": 1}


def test_endless_stderr_keeps_only_its_tail(tmp_path: Path) -> None:
    disc = HostDiscoveryScript(script(tmp_path, "yes 'some noise' >&2\n"), None, timeout=2.0)
    before = max_rss_mib()
    with pytest.raises(DiscoveryError, match=r"did not finish within its timeout of 2 s"):
        disc.find_available_hosts_and_slots()
    assert max_rss_mib() - before < 50


def test_close_kills_a_hung_script_with_its_group_at_once(tmp_path: Path) -> None:
    disc = HostDiscoveryScript(script(tmp_path, pid_files(tmp_path) + "wait\n"), None,
                               timeout=600.0)
    errors: list[BaseException] = []

    def poll() -> None:
        try:
            disc.find_available_hosts_and_slots()
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            errors.append(exc)

    runner = threading.Thread(target=poll)
    runner.start()
    pids = read_pids(tmp_path)
    closed = time.monotonic()
    disc.close()
    runner.join(5.0)
    assert not runner.is_alive() and time.monotonic() - closed < 2.0
    assert len(errors) == 1 and isinstance(errors[0], DiscoveryError)
    assert "was stopped (the job is ending); it was killed with its process group" in str(
        errors[0])
    assert not wait_dead(pids, timeout=5.0)
    with pytest.raises(DiscoveryError, match="was not run: discovery has stopped"):
        disc.find_available_hosts_and_slots()


class Flaky:
    """A discovery source that answers from a list: hosts, or an exception to raise."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.closed = False

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        assert isinstance(answer, dict)
        return answer

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_any_exception_is_reported_and_discovery_goes_on() -> None:
    source = Flaky(MemoryError(), ValueError("a bug in the source"), {"b": 2})
    poller = DiscoveryPoller(source, {"a": 1})
    poller.poll_once()
    assert poller.error == "host discovery raised MemoryError: " and poller.hosts == {"a": 1}
    [(first, verbose_only)] = poller.messages()
    assert not verbose_only
    assert first.startswith("host discovery failed; keeping the last hosts it listed (a:1) and "
                            "retrying every second: host discovery raised MemoryError")
    poller.poll_once()
    assert poller.error == "host discovery raised ValueError: a bug in the source"
    poller.poll_once()
    assert poller.hosts == {"b": 2} and poller.error is None and poller.failures == 0
    assert poller.messages() == [("host discovery works again after 2 failed run(s); hosts now: "
                                  "b:2", True)]


def test_a_repeated_error_with_a_changing_text_is_printed_once_a_minute() -> None:
    clock = Clock()
    answers = [DiscoveryError(f"failed at {i}") for i in range(200)]
    poller = DiscoveryPoller(Flaky(*answers), {"a": 1}, clock=clock)
    printed = []
    for _ in range(150):  # one run a second for 150 s
        poller.poll_once()
        printed += [text for text, _ in poller.messages()]
        clock.now += 1.0
    assert len(printed) == 1 + int(149 // REPEAT_EVERY_S), printed
    assert printed[0].endswith("retrying every second: failed at 0")
    assert printed[1] == ("host discovery still fails (61 failed runs in a row; the same error is "
                          "not repeated, another at most every 60 s): failed at 60")


def test_the_same_error_again_is_never_repeated() -> None:
    clock = Clock()
    poller = DiscoveryPoller(Flaky(*[DiscoveryError("same")] * 100), {"a": 1}, clock=clock)
    printed = []
    for _ in range(100):
        poller.poll_once()
        printed += poller.messages()
        clock.now += 5.0
    assert len(printed) == 1


def test_stop_closes_the_source_and_ends_the_thread() -> None:
    source = Flaky()
    poller = DiscoveryPoller(source, {"a": 1})
    poller.start()
    poller.stop()
    assert source.closed and not poller.is_alive()

