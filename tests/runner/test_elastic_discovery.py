"""Host discovery for elastic mode: real scripts run through /bin/sh, their output parsed."""

from __future__ import annotations

import re
import shlex
import sys
import time
from pathlib import Path

import pytest

from hora.errors import ConfigError, DiscoveryError
from hora.runner.elastic.discovery import FixedHosts, HostDiscovery, HostDiscoveryScript, describe
from hora.runner.hosts import HostSlots

from .helpers import alive, wait_dead

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="runs /bin/sh scripts and reads /proc")


def script(tmp_path: Path, body: str, name: str = "discover.sh", executable: bool = True) -> str:
    """Write a shell script into ``tmp_path``; return the command that runs it."""
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    if executable:
        path.chmod(0o755)
    return shlex.quote(str(path))


def printing(tmp_path: Path, output: str, default_slots: int | None = None) -> dict[str, int]:
    body = f"cat <<'EOF'\n{output}\nEOF\n"
    disc = HostDiscoveryScript(script(tmp_path, body), default_slots)
    return disc.find_available_hosts_and_slots()


def test_hosts_with_slots_keep_their_order(tmp_path: Path) -> None:
    hosts = printing(tmp_path, "node-3.example.com:4\nnode_1:2\n10.0.0.7:1")
    assert hosts == {"node-3.example.com": 4, "node_1": 2, "10.0.0.7": 1}
    assert list(hosts) == ["node-3.example.com", "node_1", "10.0.0.7"]


def test_hosts_without_slots_get_the_default(tmp_path: Path) -> None:
    assert printing(tmp_path, "a\nb:3\nc", default_slots=2) == {"a": 2, "b": 3, "c": 2}


def test_blank_lines_and_whitespace_are_ignored(tmp_path: Path) -> None:
    assert printing(tmp_path, "\n  a:2  \n\n\tb:1\r\n\n") == {"a": 2, "b": 1}


def test_no_output_means_no_hosts_yet(tmp_path: Path) -> None:
    disc = HostDiscoveryScript(script(tmp_path, "exit 0\n"), None)
    assert disc.find_available_hosts_and_slots() == {}
    assert printing(tmp_path, "\n   \n") == {}


def test_a_repeated_line_counts_once(tmp_path: Path) -> None:
    assert printing(tmp_path, "a:2\nb:1\na:2\nb:1") == {"a": 2, "b": 1}
    # the same host and slots, once implicitly through the default
    assert printing(tmp_path, "a:2\na", default_slots=2) == {"a": 2}


def test_a_host_with_two_slot_counts_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryError, match=r"discover\.sh.* lists host 'a' twice with "
                       r"different slots: line 1 'a:2' and line 3 'a:4'; print each host once"):
        printing(tmp_path, "a:2\nb:1\na:4")


@pytest.mark.parametrize("line", ["foo bar", "a:2:3", "a:x", "a:", ":2", "a b:2", "#comment"])
def test_a_malformed_line_is_named(tmp_path: Path, line: str) -> None:
    expected = f"line 2: {line!r} is not <hostname>[:<slots>]"
    with pytest.raises(DiscoveryError, match=r"discover\.sh.*: " + re.escape(expected)):
        printing(tmp_path, f"ok:1\n{line}", default_slots=1)


@pytest.mark.parametrize("slots", ["0", "-1"])
def test_slots_below_one_are_an_error(tmp_path: Path, slots: str) -> None:
    with pytest.raises(DiscoveryError, match=rf"discover\.sh.*: line 1: 'a:{slots}': slots "
                       r"must be a whole number >= 1"):
        printing(tmp_path, f"a:{slots}")


def test_a_host_without_slots_needs_slots_per_host(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryError, match=r"discover\.sh.*: line 2: 'b' gives no slots; "
                       r"print <hostname>:<slots> or pass --slots-per-host N"):
        printing(tmp_path, "a:1\nb")


def test_a_failing_script_shows_its_exit_code_and_stderr(tmp_path: Path) -> None:
    body = "echo 'a:1'\n" + "".join(f"echo 'noise {i}' >&2\n" for i in range(10))
    body += "echo 'cannot reach the cloud API' >&2\nexit 3\n"
    with pytest.raises(DiscoveryError) as info:
        HostDiscoveryScript(script(tmp_path, body), 1).find_available_hosts_and_slots()
    message = str(info.value)
    assert "host discovery script" in message and "discover.sh" in message
    assert "failed with exit code 3" in message
    assert "cannot reach the cloud API" in message and "noise 9" in message
    assert "noise 0" not in message  # only the last lines


def test_a_script_killed_by_a_signal(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryError, match=r"discover\.sh.* was killed by signal SIGKILL"):
        HostDiscoveryScript(script(tmp_path, "kill -9 $$\n"), 1).find_available_hosts_and_slots()


def test_a_script_that_is_not_executable(tmp_path: Path) -> None:
    command = script(tmp_path, "echo a:1\n", executable=False)
    with pytest.raises(DiscoveryError, match=r"discover\.sh.* failed with exit code 126 "
                       r"\(/bin/sh: found but cannot be executed: chmod \+x it, or put its "
                       r"interpreter first"):
        HostDiscoveryScript(command, 1).find_available_hosts_and_slots()


def test_a_missing_script(tmp_path: Path) -> None:
    command = shlex.quote(str(tmp_path / "nowhere.sh"))
    with pytest.raises(DiscoveryError, match=r"nowhere\.sh.* failed with exit code 127 "
                       r"\(/bin/sh: command not found"):
        HostDiscoveryScript(command, 1).find_available_hosts_and_slots()


def test_output_that_is_not_utf8(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryError, match=r"discover\.sh.* printed output that is not UTF-8"):
        HostDiscoveryScript(script(tmp_path, "printf 'a:1\\n\\377\\n'\n"),
                            1).find_available_hosts_and_slots()


def test_a_slow_script_is_killed_with_its_children(tmp_path: Path) -> None:
    body = (f"sleep 60 &\necho $! > {shlex.quote(str(tmp_path / 'child.pid'))}\n"
            f"echo $$ > {shlex.quote(str(tmp_path / 'script.pid'))}\nwait\n")
    disc = HostDiscoveryScript(script(tmp_path, body), 1, timeout=1.0)
    started = time.monotonic()
    with pytest.raises(DiscoveryError, match=r"discover\.sh.* did not finish within its timeout "
                       r"of 1 s .* killed with its process group"):
        disc.find_available_hosts_and_slots()
    assert time.monotonic() - started < 5.0
    pids = [int((tmp_path / name).read_text()) for name in ("child.pid", "script.pid")]
    assert not wait_dead(pids, timeout=5.0), "the script or its child outlived the timeout"
    assert not any(alive(pid) for pid in pids)


def test_a_command_with_arguments(tmp_path: Path) -> None:
    program = tmp_path / "discover.py"
    program.write_text("import sys\n"
                       "for i, name in enumerate(sys.argv[1:], 1):\n"
                       "    print(f'{name}:{i}')\n")
    command = " ".join(shlex.quote(word) for word in (sys.executable, str(program), "x", "y"))
    disc = HostDiscoveryScript(command, None)
    assert disc.find_available_hosts_and_slots() == {"x": 1, "y": 2}
    assert disc.find_available_hosts_and_slots() == {"x": 1, "y": 2}  # runs again each call


def test_stdin_is_not_inherited(tmp_path: Path) -> None:
    # a script that reads stdin must not hang on the driver's terminal
    assert printing(tmp_path, "a:1") == {"a": 1}
    disc = HostDiscoveryScript(script(tmp_path, "cat\necho b:2\n", name="reads.sh"), None,
                               timeout=5.0)
    assert disc.find_available_hosts_and_slots() == {"b": 2}


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ConfigError, match="--host-discovery-script is empty"):
        HostDiscoveryScript("  ", 1)
    with pytest.raises(ConfigError, match="--slots-per-host 0: must be a whole number >= 1"):
        HostDiscoveryScript("true", 0)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        HostDiscoveryScript("true", 1, timeout=0)


def test_fixed_hosts() -> None:
    fixed = FixedHosts([HostSlots("b", 2), HostSlots("a", 1), HostSlots("b", 1)])
    hosts = fixed.find_available_hosts_and_slots()
    assert hosts == {"b": 3, "a": 1} and list(hosts) == ["b", "a"]
    hosts["c"] = 5  # the caller's copy
    assert fixed.find_available_hosts_and_slots() == {"b": 3, "a": 1}
    assert FixedHosts([]).find_available_hosts_and_slots() == {}


def test_both_kinds_are_host_discoveries(tmp_path: Path) -> None:
    kinds: list[HostDiscovery] = [FixedHosts([HostSlots("a", 1)]),
                                  HostDiscoveryScript("echo a:1", None)]
    assert [k.find_available_hosts_and_slots() for k in kinds] == [{"a": 1}, {"a": 1}]


def test_describe() -> None:
    assert describe({"a": 2, "b": 1}) == "a:2, b:1"
    assert describe({}) == "no hosts"
