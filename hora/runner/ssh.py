"""Ranks on other hosts over the system ``ssh`` client: check the hosts, start, stop.

Runner layer. For every host of a job that is not this machine:

1. **Check** (:func:`check_hosts`, before any rank starts): all remote hosts in parallel, within
   the start timeout, run the rank bootstrap (:mod:`hora.runner.remote`) in check mode. ssh must
   log in without a password (``BatchMode``), the launcher's Python must exist there, the network
   interface (if one was chosen) must exist there, and the host must open a TCP connection back
   to the launcher's rendezvous address. Every failure is reported at once, with ssh's exit code
   and the last lines of its stderr.
2. **Start** (:func:`rank_argv`, :func:`rank_request`): each remote rank is one local ``ssh``
   process running ``<python> -c '<loader>' hora-rank=<r>``. The loader reads the source of
   :mod:`hora.runner.remote` and then the rank's request (command, environment including the
   job secret, working directory) from ssh's stdin. The secret is never on a command line:
   ``ps`` on either host shows only the loader.
   At most :data:`CONNECTING_PER_HOST` ssh connections to one host are being set up at once
   (:class:`StartGate`): sshd drops unauthenticated connections beyond ``MaxStartups``
   (default 10), so 16 ranks on one host started at once would fail.
3. **Stop**: the launcher keeps ssh's stdin open while the rank runs. Closing it -- or ssh
   dying, or the connection breaking -- makes the remote side SIGTERM the rank's process group
   and SIGKILL it after a grace period, so no process outlives the job on any host.

ssh runs as ``ssh -o BatchMode=yes -o ConnectTimeout=<s> -o StrictHostKeyChecking=no
-o LogLevel=ERROR -T -x [-p PORT] [-i FILE] HOST COMMAND`` (horovodrun's choices, plus no tty
and no X11). The user's ``~/.ssh/config`` applies as for any ssh: user names, jump hosts,
aliases (:func:`ssh_hostname` asks ssh what an alias stands for).
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hora._util import shm_names
from hora.errors import ConfigError, HostCheckError
from hora.runner import binding, remote

SSH_PROGRAM = "ssh"
"""The ssh client, looked up on ``PATH`` when a job needs it."""

LOADER = ('import sys,json;g=globals();[exec(compile(s,n,"exec"),g) for n,s in '
          'json.loads(sys.stdin.buffer.readline())]')
"""What ``python -c`` runs on the remote host: read the bootstrap's sources from stdin (a JSON
list of ``[name, source]``: :mod:`hora.runner.binding`, then :mod:`hora.runner.remote`), run
them in order in one namespace."""

CONNECTING_PER_HOST = 8
"""ssh connections to one host that may be in setup (before authentication) at once."""

_STDERR_LINES = 5


@dataclass(frozen=True)
class SshOptions:
    """How to reach the remote hosts.

    Attributes:
        port: ``-p/--ssh-port`` for every host (default: ssh's own, usually 22 or ssh_config).
        identity_file: ``-i/--ssh-identity-file``.
        connect_timeout: seconds ssh may take to connect (``-o ConnectTimeout``).
    """

    port: int | None = None
    identity_file: str | None = None
    connect_timeout: float = 10.0

    def flags(self) -> list[str]:
        """The ``-p`` / ``-i`` flags as given, for messages."""
        out = []
        if self.port is not None:
            out += ["-p", str(self.port)]
        if self.identity_file is not None:
            out += ["-i", self.identity_file]
        return out


def ssh_program() -> str:
    """Path of the ssh client.

    Raises:
        ConfigError: no ``ssh`` on ``PATH``.
    """
    found = shutil.which(SSH_PROGRAM)
    if found is None:
        raise ConfigError(f"this job has ranks on other hosts, which hora run starts over ssh, "
                          f"but there is no {SSH_PROGRAM!r} on PATH here. HINT: install the "
                          "OpenSSH client (e.g. apt-get install openssh-client).")
    return found


def ssh_argv(host: str, command: str, options: SshOptions) -> list[str]:
    """The full ``ssh`` command line that runs the shell ``command`` on ``host``."""
    timeout = max(1, round(options.connect_timeout))
    return [ssh_program(), "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout}",
            "-o", "StrictHostKeyChecking=no", "-o", "LogLevel=ERROR", "-T", "-x",
            *options.flags(), "--", host, command]


def ssh_hostname(host: str, options: SshOptions) -> str:
    """What ssh connects to for ``host`` (its ``HostName`` after ``~/.ssh/config``); ``host``
    itself if ssh cannot say. Runs ``ssh -G``, which sends nothing over the network."""
    argv = [ssh_program(), "-G", *options.flags(), "--", host]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return host
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value.strip():
            return value.strip()
    return host


def remote_command(python: str, tag: str) -> str:
    """The shell command ssh runs remotely: the loader under ``python``; ``tag`` (e.g.
    ``hora-rank=3``) only labels the process in ``ps``."""
    return f"exec {shlex.quote(python)} -c {shlex.quote(LOADER)} {shlex.quote(tag)}"


@functools.lru_cache(maxsize=1)
def _remote_source() -> str:
    return json.dumps([[f"<{m.__name__}>", Path(str(m.__file__)).read_text(encoding="utf-8")]
                       for m in (binding, remote)])


def _request(body: Mapping[str, object]) -> bytes:
    text = _remote_source() + "\n" + json.dumps(body) + "\n"
    return text.encode("utf-8", "surrogateescape")


def rank_argv(host: str, rank: int, python: str, options: SshOptions,
              connected_marker: str | None = None) -> list[str]:
    """The local command that starts rank ``rank`` on ``host`` (feed it :func:`rank_request`).

    ``connected_marker``: a file ssh creates once it is connected and authenticated
    (``LocalCommand``), for :class:`StartGate`.
    """
    argv = ssh_argv(host, remote_command(python, f"hora-rank={rank}"), options)
    if connected_marker is not None:
        at = argv.index("--")
        argv[at:at] = ["-o", "PermitLocalCommand=yes", "-o",
                       f"LocalCommand=touch {shlex.quote(connected_marker)}"]
    return argv


def _consume(path: str) -> bool:
    """Whether the marker file ``path`` exists; removes it."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


class StartGate:
    """Lets at most ``limit`` ssh connections per host be in setup at once.

    A connection is in setup from :meth:`wait_turn` until ssh has authenticated (it then creates
    its marker file, see :func:`rank_argv`) or ``timeout`` seconds passed (it failed; its exit
    code reports that). Use as a context manager: the marker directory is removed on exit.
    """

    def __init__(self, limit: int = CONNECTING_PER_HOST, timeout: float = 15.0) -> None:
        self.limit = limit
        self.timeout = timeout
        self._directory: str | None = None
        self._pending: dict[str, list[tuple[str, float]]] = {}

    def marker(self, rank: int) -> str:
        """The file rank ``rank``'s ssh creates once connected (in a private temporary
        directory made on first use)."""
        if self._directory is None:
            self._directory = tempfile.mkdtemp(prefix="hora-ssh-")
        return os.path.join(self._directory, f"connected.{rank}")

    def wait_turn(self, host: str, rank: int) -> None:
        """Block until fewer than ``limit`` connections to ``host`` are in setup; then count
        rank ``rank``'s as one."""
        while True:
            now = time.monotonic()
            pending = [(m, d) for m, d in self._pending.get(host, [])
                       if d > now and not _consume(m)]
            self._pending[host] = pending
            if len(pending) < self.limit:
                pending.append((self.marker(rank), now + self.timeout))
                return
            time.sleep(0.02)

    def __enter__(self) -> StartGate:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)


def rank_request(*, argv: Sequence[str], env: Mapping[str, str], cwd: str, grace: float,
                 rank: int, host: str, job_id: str,
                 cpu_share: tuple[int, int] | None = None) -> bytes:
    """What the launcher writes to a remote rank's ssh stdin (then keeps it open until the rank
    should stop). Holds the job secret: never log it. ``cpu_share``: (local rank, local size)
    when the agent there binds the rank to its share of that host's cores."""
    valid = shm_names.valid_job_id(job_id)  # the names come from the one rule: the far end
    return _request({"argv": list(argv), "env": dict(env), "cwd": cwd, "grace": grace,
                     "rank": rank, "host": host,
                     "cpu_share": list(cpu_share) if cpu_share is not None else None,
                     "segment_prefix": shm_names.segment_prefix(job_id) if valid else "",
                     "live_prefix": shm_names.live_marker_prefix(job_id) if valid else ""})


# ---- the check ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class HostCheck:
    """The outcome of checking one host: ``returncode`` None means it timed out."""

    host: str
    returncode: int | None
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        """True when the host can run ranks."""
        return self.returncode == 0

    def describe(self, python: str, timeout: float) -> str:
        """Why the host failed, in one or a few lines."""
        lines = [line.removeprefix("[hora] ") for line in self.stderr.strip().splitlines()
                 if line.strip()]
        detail = "; ".join(lines[-_STDERR_LINES:]) or "(no message)"
        code = self.returncode
        if code is None:
            return f"no answer within {timeout:g} s (ssh still running; host down or slow?)"
        if code == 255:
            return f"ssh failed (exit code 255): {detail}"
        if code in (126, 127):
            return (f"cannot run the launcher's Python {python} there (exit code {code}: "
                    f"{detail}); hora run starts remote ranks with the same Python path as the "
                    "launcher, so install hora the same way on every host")
        if code == remote.EXIT_NO_CONNECT_BACK:
            return (f"{detail} (exit code {code}). HINT: the launcher's address is not "
                    "reachable from there; choose the network with --network-interface")
        if code == remote.EXIT_NO_INTERFACE:
            return f"{detail} (exit code {code})"
        return f"the check exited with code {code}: {detail}"


def _check_one(host: str, options: SshOptions, python: str, body: Mapping[str, object],
               timeout: float) -> HostCheck:
    started = time.monotonic()
    argv = ssh_argv(host, remote_command(python, "hora-check"), options)
    try:
        done = subprocess.run(argv, input=_request({"check": dict(body)}), capture_output=True,
                              timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode("utf-8", "replace") if exc.stderr else ""
        return HostCheck(host, None, stderr, time.monotonic() - started)
    except OSError as exc:
        return HostCheck(host, 255, f"cannot run ssh: {exc}", time.monotonic() - started)
    return HostCheck(host, done.returncode, done.stderr.decode("utf-8", "replace"),
                     time.monotonic() - started)


def check_hosts(hosts: Sequence[str], options: SshOptions, *, python: str,
                connect_back: tuple[str, int] | None, iface: str = "",
                timeout: float = 30.0) -> list[HostCheck]:
    """Check every host in parallel (see the module docstring); all must pass.

    Args:
        hosts: remote hosts, as given to ssh.
        options: ssh port / identity / connect timeout.
        python: the interpreter path the ranks will use on every host.
        connect_back: ``(address, port)`` on the launcher each host must reach, or None.
        iface: a network interface that must exist on every host ("" for none).
        timeout: seconds for each host's whole check.

    Returns:
        One :class:`HostCheck` per host, in order (all passed).

    Raises:
        HostCheckError: naming every host that failed and why.
    """
    body: dict[str, object] = {"iface": iface, "timeout": min(5.0, timeout)}
    if connect_back is not None:
        body["connect"] = list(connect_back)
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(hosts)))) as pool:
        results = list(pool.map(lambda h: _check_one(h, options, python, body, timeout), hosts))
    failed = [r for r in results if not r.ok]
    if failed:
        flags = " ".join(shlex.quote(f) for f in options.flags())
        example = f"ssh -o BatchMode=yes {flags + ' ' if flags else ''}{failed[0].host} true"
        lines = [f"{len(failed)} of {len(hosts)} remote host(s) cannot run ranks:"]
        lines += [f"  {r.host}: {r.describe(python, timeout)}" for r in failed]
        lines.append(f"HINT: every host needs passwordless ssh from here (`{example}` must "
                     "work), the same Python path, and a route back to this machine.")
        raise HostCheckError("\n".join(lines))
    return results


__all__ = ["CONNECTING_PER_HOST", "LOADER", "SSH_PROGRAM", "HostCheck", "HostCheckError",
           "SshOptions", "StartGate", "check_hosts",
           "rank_argv", "rank_request", "remote_command", "ssh_argv", "ssh_hostname",
           "ssh_program"]
