"""Which hosts an elastic job may use right now: host discovery.

Runner layer. The elastic driver polls a :class:`HostDiscovery` (about once a second) and gets
``{hostname: slots}`` in discovery order (a ``dict`` keeps insertion order). Two kinds:

* :class:`HostDiscoveryScript` (``--host-discovery-script``) runs a user command through
  ``/bin/sh -c`` as horovodrun does, so both a path (``./discover.sh``) and a command with
  arguments (``"python3 discover.py --zone a"``) work. It prints one host a line,
  ``<hostname>:<slots>`` or ``<hostname>`` (then ``--slots-per-host`` applies). Blank lines and
  surrounding whitespace are ignored; no output at all means "no hosts yet" (``{}``). A line
  repeated (the same host with the same slots) counts once, as in Horovod; unlike Horovod, the
  order of first appearance is kept and anything malformed is an error, never a guess.
* :class:`FixedHosts` (``-H`` / ``--hostfile`` with ``--min-np``) always answers the same hosts.

Every failure of a script (non-zero exit, death by signal, not found or not executable,
timeout, malformed or non-UTF-8 output) raises :class:`hora.errors.DiscoveryError` whose message
names the script and says what to fix. The script runs in its own process group; on timeout the
whole group is killed, so a script that started helpers leaves none behind. Host names use the
same characters as ``-H`` (``[\\w.-]+``; IPv6 literals are not accepted).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from typing import Protocol

from hora._util.log import get_logger
from hora.errors import ConfigError, DiscoveryError
from hora.runner.hosts import HostSlots

log = get_logger(__name__)

POLL_EVERY_S = 1.0
"""How often the driver runs discovery (Horovod's period)."""

STDERR_TAIL_LINES = 5
"""How many of the last stderr lines of a failed script its error shows."""

_LINE = re.compile(r"(?P<host>[\w.-]+)(?::(?P<slots>-?[0-9]+))?")
_LINE_FORMAT = "<hostname>[:<slots>]"


class HostDiscovery(Protocol):
    """Anything the elastic driver can ask which hosts are available (Horovod's interface)."""

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """The hosts available now, in discovery order, each with its slot count (>= 1).

        An empty dict means "no hosts yet". Raises :class:`~hora.errors.DiscoveryError` when
        the answer cannot be had; the caller decides whether to retry.
        """
        ...


class HostDiscoveryScript:
    """Discovery by running a user's script or command (``--host-discovery-script``).

    Args:
        script: a path or a shell command line, run with ``/bin/sh -c``.
        default_slots: the slots of a line without ``:<slots>`` (``--slots-per-host``); None
            makes such a line an error.
        timeout: seconds one run may take (until its output is closed) before it is killed.

    Raises:
        ConfigError: ``script`` is blank or ``default_slots`` < 1.
        ValueError: ``timeout`` is not > 0.
    """

    def __init__(self, script: str, default_slots: int | None, timeout: float = 30.0) -> None:
        if not script.strip():
            raise ConfigError("--host-discovery-script is empty; give an executable (or a command) "
                              f"that prints one {_LINE_FORMAT} per line")
        if default_slots is not None and default_slots < 1:
            raise ConfigError(f"--slots-per-host {default_slots}: must be a whole number >= 1")
        if not timeout > 0:
            raise ValueError(f"discovery timeout must be > 0 seconds, not {timeout!r}")
        self.script = script
        self.default_slots = default_slots
        self.timeout = timeout
        self._what = f"host discovery script {script!r}"

    def __repr__(self) -> str:
        return f"HostDiscoveryScript({self.script!r}, default_slots={self.default_slots})"

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """Run the script once and parse what it printed.

        Raises:
            DiscoveryError: the script failed, timed out, or printed something that is not
                UTF-8 lines of ``<hostname>[:<slots>]``.
        """
        hosts = self._parse(self._run())
        log.debug("%s found %s", self._what, describe(hosts))
        return hosts

    def _run(self) -> bytes:
        """The script's stdout, once it exited with status 0."""
        try:
            proc = subprocess.Popen(["/bin/sh", "-c", self.script], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, close_fds=True)
        except OSError as exc:
            raise DiscoveryError(f"Failed to execute {self._what}: cannot start /bin/sh: "
                                 f"{exc.strerror or exc}") from None
        try:
            out, err = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise DiscoveryError(
                f"{self._what} did not finish within its timeout of {self.timeout:g} s (it, or a "
                "process it started, kept its output open); it was killed with its process "
                "group. It runs about every second: make it print the hosts and exit "
                "quickly") from None
        except BaseException:
            _kill_group(proc)
            raise
        code = proc.returncode
        if code == 0:
            return out
        tail = _stderr_tail(err)
        if code < 0:
            raise DiscoveryError(f"{self._what} was killed by signal {_signal_name(-code)}"
                                 f"{tail}")
        hint = ""
        if code == 127:
            hint = (" (/bin/sh: command not found: check the path, or that the command is on "
                    "PATH)")
        elif code == 126:
            hint = (" (/bin/sh: found but cannot be executed: chmod +x it, or put its "
                    f"interpreter first, e.g. --host-discovery-script 'python3 {self.script}')")
        elif code > 128 and code - 128 < signal.NSIG:
            hint = f" (a command it ran was killed by signal {_signal_name(code - 128)})"
        raise DiscoveryError(f"{self._what} failed with exit code {code}{hint}{tail}")

    def _parse(self, out: bytes) -> dict[str, int]:
        try:
            text = out.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DiscoveryError(
                f"{self._what} printed output that is not UTF-8 ({exc.reason} at byte "
                f"{exc.start}); print one {_LINE_FORMAT} per line") from None
        hosts: dict[str, int] = {}
        first_line: dict[str, tuple[int, str]] = {}
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line:
                continue
            where = f"{self._what}: line {number}: {_shorten(line)!r}"
            match = _LINE.fullmatch(line)
            if match is None:
                raise DiscoveryError(f"{where} is not {_LINE_FORMAT} (e.g. 'node1:4', or "
                                     "'node1' with --slots-per-host)")
            host, slots_text = match["host"], match["slots"]
            if slots_text is None:
                if self.default_slots is None:
                    raise DiscoveryError(f"{where} gives no slots; print <hostname>:<slots> or "
                                         "pass --slots-per-host N")
                slots = self.default_slots
            else:
                slots = int(slots_text)
                if slots < 1:
                    raise DiscoveryError(f"{where}: slots must be a whole number >= 1")
            if host in hosts:
                if hosts[host] != slots:
                    then, before = first_line[host]
                    raise DiscoveryError(
                        f"{self._what} lists host {host!r} twice with different slots: line "
                        f"{then} {_shorten(before)!r} and line {number} {_shorten(line)!r}"
                        "; print each host once")
                continue
            hosts[host] = slots
            first_line[host] = (number, line)
        return hosts


class FixedHosts:
    """The same hosts every time: ``-H`` / ``--hostfile`` in elastic mode (``--min-np``).

    A host listed more than once gets the sum of its entries' slots, as a static launch would
    place ranks on every entry.
    """

    def __init__(self, hosts: Sequence[HostSlots]) -> None:
        self._hosts: dict[str, int] = {}
        for entry in hosts:
            self._hosts[entry.host] = self._hosts.get(entry.host, 0) + entry.slots

    def __repr__(self) -> str:
        return f"FixedHosts({describe(self._hosts)!r})"

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """The given hosts in their given order (a fresh dict the caller may change)."""
        return dict(self._hosts)


def describe(hosts: Mapping[str, int]) -> str:
    """``"a:2, b:1"`` for log messages and errors; ``"no hosts"`` when empty."""
    return ", ".join(f"{host}:{slots}" for host, slots in hosts.items()) or "no hosts"


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the script's process group, then reap the script (bounded: never hangs)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group is proc.pid's until proc is reaped
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.communicate(timeout=5.0)
    except subprocess.TimeoutExpired:  # a process that left the group holds the pipes open
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait()


def _stderr_tail(err: bytes) -> str:
    lines = [line.rstrip() for line in err.decode("utf-8", "replace").splitlines()
             if line.strip()][-STDERR_TAIL_LINES:]
    if not lines:
        return "; it wrote nothing to stderr"
    return "; its stderr ends with:\n" + "\n".join(f"    {line}" for line in lines)


def _shorten(line: str, limit: int = 120) -> str:
    return line if len(line) <= limit else line[:limit] + "..."


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)





class DiscoveryPoller(threading.Thread):
    """Runs ``source`` every :data:`POLL_EVERY_S` seconds in the background (Horovod's rule);
    the driver reads the latest good result in ``hosts`` and the latest failure (None after a
    success) in ``error``: failures after the first poll are reported and retried, the last
    good host list stays in use."""

    def __init__(self, source: HostDiscovery, first: dict[str, int]) -> None:
        super().__init__(daemon=True, name="hora-discovery")
        self._source = source
        self.hosts = first
        self.error: str | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(POLL_EVERY_S):
            try:
                self.hosts = self._source.find_available_hosts_and_slots()
                self.error = None
            except DiscoveryError as exc:
                self.error = str(exc)

    def stop(self) -> None:
        self._stop_event.set()


__all__ = [
    "DiscoveryPoller", "FixedHosts", "HostDiscovery", "HostDiscoveryScript", "describe"]
