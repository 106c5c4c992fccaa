"""The far end of a rank started over ssh: runs on the other host, standard library only.

:mod:`hora.runner.ssh` runs ``<python> -c '<loader>' hora-rank=<r>`` on the remote host. The
loader reads the *sources* of :mod:`hora.runner.binding` and this module from the first line of
stdin (JSON) and runs them in one namespace, so the remote host needs Python but not hora.
:func:`main` then reads the second line, a JSON object, and either checks the host
(``{"check": {...}}``, see :func:`check`) or runs a rank::

    {"argv": [...], "env": {...}, "cwd": "...", "grace": 4.0, "rank": 3, "host": "b",
     "cpu_share": [1, 2], "segment_prefix": "hora-<job>-", "live_prefix": "hora-<job>.live."}

Running a rank:

1. ``chdir(cwd)`` (horovodrun does ``cd <cwd> > /dev/null 2>&1``; a failure is reported here
   and the rank runs in the login directory, as there);
2. start ``argv`` bound to its share of this host's cores when ``cpu_share`` (local rank, local
   size) is given (:mod:`hora.runner.binding`), with the login environment updated by ``env``
   (identity, rendezvous, the job secret, forwarded variables), stdin from /dev/null, stdout /
   stderr straight into ssh's (no copy), in a new session (its own process group) that gets
   SIGTERM if this process dies;
3. wait. When stdin reaches EOF -- the launcher closed it to stop the rank, or ssh died, or the
   connection broke -- or this process gets SIGTERM / SIGHUP / SIGINT, the rank's process group
   gets SIGTERM, then SIGKILL after ``grace`` seconds;
4. after the rank exits, stop anything it left in its process group, remove the job's
   ``/dev/shm/<segment_prefix>*`` segments if this was the job's last rank on this host (the
   names are the launcher's, from :mod:`hora._util.shm_names`: this side knows no rule), and exit
   with the rank's status (128 + N after signal N, with a line on stderr saying which signal).

The job secret arrives inside ``env`` over stdin: it never appears on a command line on either
host. Exit codes of a check: 0 fine, 3 cannot connect back to the launcher, 4 the network
interface is missing; 127 / 126 come from the remote shell when Python is missing.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

if "with_binding" not in globals():  # imported here; over ssh the loader ran binding's source
    from hora.runner.binding import bound_environment, cores_for, with_binding  # in these globals

EXIT_NO_CONNECT_BACK = 3
EXIT_NO_INTERFACE = 4
_POLL_S = 0.05
_SHM_DIR = "/dev/shm"


def _say(message: str) -> None:
    try:
        sys.stderr.write(f"[hora] {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


# ---- host check --------------------------------------------------------------------------------

def _interface_names() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def check(spec: dict[str, Any]) -> int:
    """Probe this host for the launcher: the network interface exists, the launcher's address
    accepts a TCP connection. Returns the exit code (0 when fine)."""
    iface = spec.get("iface") or ""
    if iface and iface not in _interface_names():
        _say(f"network interface {iface!r} does not exist on {socket.gethostname()}; it has: "
             f"{', '.join(_interface_names())}")
        return EXIT_NO_INTERFACE
    target = spec.get("connect")
    if target:
        host, port = str(target[0]), int(target[1])
        try:
            socket.create_connection((host, port), timeout=float(spec.get("timeout", 5))).close()
        except OSError as exc:
            _say(f"{socket.gethostname()} cannot connect back to the launcher at {host}:{port}: "
                 f"{exc}")
            return EXIT_NO_CONNECT_BACK
    return 0


# ---- running a rank ----------------------------------------------------------------------------

def _death_signal() -> Any:
    """A ``preexec_fn`` asking Linux to SIGTERM the rank if this process dies, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _kill_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class _Rank:
    """One rank process and the ways it can be asked to stop."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.rank = int(spec.get("rank", -1))
        self.host = str(spec.get("host") or socket.gethostname())
        self.grace = float(spec.get("grace", 4.0))
        self.stop = threading.Event()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> int | None:
        """Start the rank; an exit code if that failed."""
        cwd = self.spec.get("cwd")
        if cwd:
            try:
                os.chdir(cwd)
            except OSError as exc:
                _say(f"rank {self.rank} on {self.host}: cannot change to {cwd!r} "
                     f"({exc.strerror}); running in {os.getcwd()}")
        env = dict(os.environ)
        env.update(self.spec["env"])
        env["PWD"] = os.getcwd()
        argv = list(self.spec["argv"])
        share = self.spec.get("cpu_share")
        cpus = cores_for("auto", "", int(share[0]), int(share[1])) if share else None
        env.update(bound_environment(cpus))
        try:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                         start_new_session=True,
                                         preexec_fn=with_binding(cpus, _death_signal()),
                                         close_fds=True)
        except OSError as exc:
            _say(f"cannot start rank {self.rank} on {self.host}: {argv[0]!r}: "
                 f"{exc.strerror or exc}")
            return 127 if isinstance(exc, FileNotFoundError) else 126
        return None

    def watch_stdin(self) -> None:
        """Set :attr:`stop` when stdin reaches EOF (the launcher, ssh or the link went away)."""
        try:  # the raw fd: a daemon thread blocked in sys.stdin would break interpreter exit
            while os.read(0, 65536):
                pass
        except (OSError, ValueError):
            pass
        self.stop.set()

    def terminate(self, pgid: int) -> None:
        """SIGTERM the group, SIGKILL after the grace period."""
        _kill_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is None or _group_alive(pgid):
                time.sleep(_POLL_S)
            else:
                return
        _kill_group(pgid, signal.SIGKILL)

    def wait(self) -> int:
        """Wait for the rank (stopping it when asked); its ``Popen`` return code."""
        assert self.proc is not None
        proc = self.proc
        while proc.poll() is None:
            if self.stop.wait(_POLL_S):
                self.terminate(proc.pid)
                return proc.wait()
        if _group_alive(proc.pid):
            _say(f"rank {self.rank} on {self.host} exited but left processes running in its "
                 "process group; stopping them.")
            self.terminate(proc.pid)
        return proc.returncode


def _last_on_host(live_prefix: str, rank: int, arrive: bool) -> bool:
    """Mark this rank live on this host (``arrive``: ``/dev/shm/<live_prefix><rank>``) or gone;
    on leaving, whether it was the job's last rank here."""
    if not live_prefix or "/" in live_prefix or not os.path.isdir(_SHM_DIR):
        return False
    marker = os.path.join(_SHM_DIR, f"{live_prefix}{rank}")
    try:
        if arrive:
            with open(marker, "w"):
                pass
            return False
        os.unlink(marker)
        return not any(n.startswith(live_prefix) for n in os.listdir(_SHM_DIR))
    except OSError:
        return False


def _remove_segments(prefix: str) -> None:
    if not prefix or "/" in prefix:
        return
    try:
        for name in os.listdir(_SHM_DIR):
            if name.startswith(prefix):
                try:
                    os.unlink(os.path.join(_SHM_DIR, name))
                except OSError:
                    pass
    except OSError:
        pass


def run_rank(spec: dict[str, Any]) -> int:
    """Run one rank as described in the module docstring; returns the exit status."""
    rank = _Rank(spec)
    live_prefix = str(spec.get("live_prefix") or "")
    segment_prefix = str(spec.get("segment_prefix") or "")
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, lambda _s, _f: rank.stop.set())
    _last_on_host(live_prefix, rank.rank, arrive=True)
    try:
        failed = rank.start()
        if failed is not None:
            return failed
        threading.Thread(target=rank.watch_stdin, daemon=True, name="hora-stdin").start()
        code = rank.wait()
    finally:
        if _last_on_host(live_prefix, rank.rank, arrive=False):
            _remove_segments(segment_prefix)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if not rank.stop.is_set():
            _say(f"rank {rank.rank} on {rank.host} was killed by {name} ({-code}); "
                 f"exit status {128 - code}")
        return 128 - code
    return code


def main() -> int:
    """Read the request (second line of stdin) and serve it."""
    line = sys.stdin.buffer.readline()
    try:
        spec = json.loads(line)
    except ValueError:
        _say("the launcher sent no valid request on stdin")
        return 2
    if "check" in spec:
        return check(spec["check"])
    return run_rank(spec)


if __name__ == "__main__":
    sys.exit(main())
