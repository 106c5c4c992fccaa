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
timeout, more than :data:`MAX_OUTPUT_BYTES` on stdout, malformed or non-UTF-8 output) raises
:class:`hora.errors.DiscoveryError` whose message names the script and says what to fix. The
script runs in its own process group; on a timeout, too much output, or
:meth:`HostDiscoveryScript.close` (the job ends, Ctrl-C) the whole group is killed, so a script
that started helpers leaves none behind. Host names use the same characters as ``-H``
(``[\\w.-]+``; IPv6 literals are not accepted).
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from hora._util.log import get_logger
from hora.errors import ConfigError, DiscoveryError
from hora.runner.hosts import HostSlots

log = get_logger(__name__)

STDERR_TAIL_LINES = 5
"""How many of the last stderr lines of a failed script its error shows."""

MAX_OUTPUT_BYTES = 1 << 20
"""The most a script may print on stdout in one run (1 MiB: some 50,000 hosts); more is an
error naming the script, and it is killed. Of its stderr only the last 64 KiB are kept."""

_STDERR_KEPT = 64 * 1024
_CHUNK = 64 * 1024
_CHECK_EVERY_S = 0.1  # how often a run in progress checks for close()

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
        self._proc: subprocess.Popen[bytes] | None = None  # the run in progress
        self._closed = False

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

    def close(self) -> None:
        """Run no more: kill the script running now with its process group (the job ends, or
        the launcher got Ctrl-C). Safe from another thread and from a signal handler."""
        self._closed = True
        proc = self._proc
        if proc is not None:
            _signal_group(proc)

    def _run(self) -> bytes:
        """The script's stdout, once it exited with status 0."""
        if self._closed:
            raise DiscoveryError(f"{self._what} was not run: discovery has stopped")
        try:
            proc = subprocess.Popen(["/bin/sh", "-c", self.script], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, close_fds=True)
        except OSError as exc:
            raise DiscoveryError(f"Failed to execute {self._what}: cannot start /bin/sh: "
                                 f"{exc.strerror or exc}") from None
        self._proc = proc
        try:
            if self._closed:  # close() ran while the script was being started
                _signal_group(proc)
            out, err = self._read(proc)
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            self._proc = None
            _close_pipes(proc)
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

    def _read(self, proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
        """Read the script's stdout (at most :data:`MAX_OUTPUT_BYTES`) and the tail of its
        stderr until both close, then wait for it to exit, all within ``timeout``.

        Raises:
            DiscoveryError: too much output, the timeout, or :meth:`close` (the script is
                killed with its process group first).
        """
        assert proc.stdout is not None and proc.stderr is not None
        deadline = time.monotonic() + self.timeout
        out, err = bytearray(), bytearray()
        streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
        with selectors.DefaultSelector() as sel:
            for fd in streams:
                sel.register(fd, selectors.EVENT_READ)
            while streams and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for key, _ in sel.select(min(left, _CHECK_EVERY_S)):
                    chunk = os.read(key.fd, _CHUNK)
                    if not chunk:
                        sel.unregister(key.fd)
                        del streams[key.fd]
                        continue
                    buf = streams[key.fd]
                    buf += chunk
                    if buf is err and len(err) > _STDERR_KEPT:
                        del err[:len(err) - _STDERR_KEPT]
                    elif buf is out and len(out) > MAX_OUTPUT_BYTES:
                        _kill_group(proc)
                        raise DiscoveryError(
                            f"{self._what} printed more than {MAX_OUTPUT_BYTES} bytes (1 MiB) "
                            "on stdout; it was killed with its process group. It must print "
                            f"only the usable hosts, one {_LINE_FORMAT} per line (send logs to "
                            "stderr, and end the script after printing)")
        while not self._closed and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(min(_CHECK_EVERY_S, max(0.0, deadline - time.monotonic())))
        if self._closed:
            _kill_group(proc)
            raise DiscoveryError(f"{self._what} was stopped (the job is ending); it was killed "
                                 "with its process group")
        if proc.poll() is None or streams:
            _kill_group(proc)
            raise DiscoveryError(
                f"{self._what} did not finish within its timeout of {self.timeout:g} s (it, or a "
                "process it started, kept its output open); it was killed with its process "
                "group. It runs about every second: make it print the hosts and exit "
                "quickly")
        return bytes(out), bytes(err)

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


def _signal_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the script's process group (the group is proc.pid's until proc is reaped)."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the script's process group, close its pipes (a process that left the group and
    still writes gets SIGPIPE), then reap the script (bounded: never hangs)."""
    _signal_group(proc)
    _close_pipes(proc)
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        log.warning("the host discovery script (pid %d) did not end 5 s after SIGKILL", proc.pid)


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


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

__all__ = ["MAX_OUTPUT_BYTES", "FixedHosts", "HostDiscovery", "HostDiscoveryScript", "describe"]
