"""Start the ranks of a job on this host, relay their output, and stop them together.

Runner layer: the mechanism under :func:`hora.runner.launch.launch`, which decides *what* each
rank gets (command, environment); this module decides *how* processes run here:

* every rank is a subprocess in its own session / process group, so the launcher can stop a
  rank together with everything it started (data-loader workers, shells) and nothing else;
* each line of a rank's stdout / stderr is relayed prefixed ``[<rank>]<stdout>:`` (Horovod's
  format, optionally preceded by ``time.asctime()``), and optionally copied raw to
  ``DIR/rank.<r>/{stdout,stderr}``;
* the first rank to fail (non-zero exit or a signal) decides the launcher's exit status; the
  others get SIGTERM on their process group, then SIGKILL after :data:`GRACE_PERIOD_S`;
* SIGINT / SIGTERM / SIGHUP to the launcher stop every rank the same way (exit 128 + signal);
  a second one skips the grace period. If the launcher itself is killed with SIGKILL, Linux
  delivers SIGTERM to each rank (``PR_SET_PDEATHSIG``);
* a rank with a ``stdin`` request (a rank on another host: the process here is its ``ssh``,
  see :mod:`hora.runner.ssh`) gets the request on its stdin, which then stays open; the
  launcher stops it by closing stdin instead of SIGTERM (the remote side then stops the rank
  within its own, shorter grace period), and SIGKILLs the ssh after the grace period.

Launcher messages go to stderr with a ``[hora]`` prefix through :func:`say`.
"""

from __future__ import annotations

import collections
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from hora._util.shm_names import SHM_DIR, remove_job_segments
from hora.rendezvous.topology import Slot
from hora.runner.failures import WorkerFailure, exit_status, signal_name
from hora.runner.output import (  # re-exported: the launcher's output (__all__)
    CONSOLE,
    Console,
    _Relay,
    rank_output_dir,
    say,
)

GRACE_PERIOD_S = 5.0
"""Seconds between SIGTERM and SIGKILL when the launcher stops ranks (Horovod's value)."""

STDERR_TAIL_LINES = 10
"""Lines of a failed rank's stderr repeated in the root-cause message."""

_RELAY_JOIN_S = 5.0
_POLL_S = 0.05
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class RankLaunch:
    """One process to start: where it sits in the job and its complete environment.

    ``argv`` replaces the job's command for this rank (e.g. the ``ssh`` that starts a remote
    rank); ``stdin``, when given, is written to the process's stdin, which then stays open
    until the launcher stops the rank by closing it; ``before_start`` is called just before the
    process starts (e.g. to pace ssh connections to one host).
    """

    slot: Slot
    env: Mapping[str, str]
    argv: Sequence[str] | None = None
    stdin: bytes | None = field(default=None, repr=False)
    before_start: Callable[[], None] | None = None


def _resolve(program: str, env: Mapping[str, str]) -> str:
    """The file ``program`` names for a process started with ``env`` (PATH lookup)."""
    import shutil

    found = shutil.which(program, path=env.get("PATH", os.defpath))
    return os.path.abspath(found) if found else program


@dataclass
class _Worker:
    slot: Slot
    proc: subprocess.Popen[bytes]
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=STDERR_TAIL_LINES))
    relays: list[_Relay] = field(default_factory=list)
    release: threading.Event | None = None  # set: close stdin (stops a rank with a request)
    program: str = ""  # the executable a local rank ran (resolved on its PATH), for hints

    @property
    def rank(self) -> int:
        return self.slot.rank

    def ask_to_stop(self) -> None:
        """SIGTERM the rank's process group, or close its stdin if it was given a request."""
        if self.release is not None:
            self.release.set()
        else:
            _killpg(self.proc.pid, signal.SIGTERM)


def _parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGTERM the child if the launcher dies, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec() -> None:  # runs in the child between fork and exec: keep it minimal
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _live_groups(pgids: Collection[int]) -> set[int]:
    """Those of ``pgids`` that still have a process in them (zombies do not count)."""
    wanted = {str(g): g for g in pgids}
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: zombies count, which only delays the SIGKILL
        live = set()
        for pgid in pgids:
            try:
                os.killpg(pgid, 0)
                live.add(pgid)
            except (ProcessLookupError, PermissionError):
                pass
        return live
    found: set[int] = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        # fields[0] is the state, fields[2] the process group (proc(5))
        if len(fields) > 2 and fields[2] in wanted and fields[0] not in ("Z", "X"):
            found.add(wanted[fields[2]])
    return found


def _killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _feed(worker: _Worker, data: bytes) -> None:
    """Write a rank's request to its stdin, keep stdin open until ``worker.release`` is set."""
    pipe = worker.proc.stdin
    assert pipe is not None and worker.release is not None
    try:
        pipe.write(data)
        pipe.flush()
    except (OSError, ValueError):
        pass  # the process already exited; its exit code tells why
    worker.release.wait()
    try:
        pipe.close()
    except (OSError, ValueError):
        pass


class _Supervisor:
    """Owns the worker processes of one job from start to the last exit."""

    def __init__(self, command: Sequence[str], ranks: Sequence[RankLaunch],
                 output_dir: str | None, prefix_timestamp: bool, console: Console) -> None:
        self._command = list(command)
        self._ranks = ranks
        self._output_dir = output_dir
        self._timestamp = prefix_timestamp
        self._console = console
        self._workers: list[_Worker] = []
        self._exits: queue.Queue[tuple[int, int]] = queue.Queue()
        self._interrupt: int | None = None
        self._kill_now = False

    # -- signals (called from the signal handler in the main thread: only set flags) --
    def on_signal(self, signum: int) -> None:
        if self._interrupt is None:
            self._interrupt = signum
        else:
            self._kill_now = True

    # -- lifecycle --
    def run(self) -> int:
        try:
            status = self._start_all()
            if status is not None:
                return status
            return self._wait()
        finally:
            self._stop(quiet=True)
            self._join_relays()
            if self._ranks:
                remove_shm_segments(self._ranks[0].env.get("HORA_JOB_ID"))

    def _start_all(self) -> int | None:
        preexec = _parent_death_signal()
        size = len(self._ranks)
        for launch in self._ranks:
            if self._interrupt is not None:
                return self._interrupted()
            try:
                copies = self._open_copies(launch.slot.rank, size)
            except OSError as exc:
                self._console.say(f"cannot write the output of rank {launch.slot.rank} to "
                                  f"{exc.filename}: {exc.strerror or exc}")
                return 1
            argv = self._command if launch.argv is None else list(launch.argv)
            if launch.before_start is not None:
                launch.before_start()
            try:
                proc = subprocess.Popen(
                    argv, env=dict(launch.env),
                    stdin=subprocess.DEVNULL if launch.stdin is None else subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                    # preexec only calls prctl / getppid / kill: it takes no Python-level lock,
                    # so the fork-with-threads hazard does not apply.
                    preexec_fn=preexec, close_fds=True)  # noqa: PLW1509
            except OSError as exc:
                for copy in copies.values():
                    if copy is not None:
                        copy.close()
                message = (f"cannot start rank {launch.slot.rank}: {argv[0]!r}: "
                           f"{exc.strerror or exc}")
                code = 127 if isinstance(exc, FileNotFoundError) else 126
                failure = WorkerFailure(
                    rank=launch.slot.rank, size=len(self._ranks), hostname=launch.slot.hostname,
                    returncode=code, start_error=message, command=tuple(argv))
                self._console.say("\n".join([message, *failure.hints()]))
                self._console.rank_failed(failure)
                return code
            worker = _Worker(slot=launch.slot, proc=proc, program="" if launch.argv is not None
                             else _resolve(argv[0], launch.env))
            self._workers.append(worker)
            self._start_relays(worker, copies)
            if launch.stdin is not None:
                worker.release = threading.Event()
                threading.Thread(target=_feed, args=(worker, launch.stdin), daemon=True,
                                 name=f"hora-stdin-{worker.rank}").start()
            threading.Thread(target=self._reap, args=(worker,), daemon=True,
                             name=f"hora-wait-{worker.rank}").start()
        return None

    def _open_copies(self, rank: int, size: int) -> dict[str, BinaryIO | None]:
        """The files that get a raw copy of the rank's stdout / stderr (--output-filename)."""
        if self._output_dir is None:
            return {"stdout": None, "stderr": None}
        rank_dir = rank_output_dir(self._output_dir, rank, size)
        rank_dir.mkdir(parents=True, exist_ok=True)
        copies: dict[str, BinaryIO | None] = {}
        try:
            for name in ("stdout", "stderr"):
                copies[name] = open(rank_dir / name, "wb")  # noqa: SIM115 (closed by the relay)
        except OSError:
            for copy in copies.values():
                if copy is not None:
                    copy.close()
            raise
        return copies

    def _start_relays(self, worker: _Worker, copies: Mapping[str, BinaryIO | None]) -> None:
        assert worker.proc.stdout is not None and worker.proc.stderr is not None
        for name, pipe, tail in (("stdout", worker.proc.stdout, None),
                                 ("stderr", worker.proc.stderr, worker.tail)):
            relay = _Relay(pipe, worker.rank, name, self._console, copies[name], tail,
                           self._timestamp)
            relay.start()
            worker.relays.append(relay)

    def _reap(self, worker: _Worker) -> None:
        code = worker.proc.wait()
        if worker.release is not None:
            worker.release.set()
        self._exits.put((worker.rank, code))

    def _wait(self) -> int:
        by_rank = {w.rank: w for w in self._workers}
        running = set(by_rank)
        while running:
            if self._interrupt is not None:
                return self._interrupted()
            try:
                rank, code = self._exits.get(timeout=0.1)
            except queue.Empty:
                continue
            running.discard(rank)
            if code != 0:
                return self._failed(by_rank[rank], code, len(running))
        self._stop_leftovers()
        return 0

    def _failed(self, worker: _Worker, code: int, others: int) -> int:
        failure = WorkerFailure(rank=worker.rank, size=len(self._workers),
                                hostname=worker.slot.hostname, returncode=code)
        stopping = f"stopping the other {others} rank(s)" if others else "no other rank is running"
        self._console.say(f"{failure.describe()}; {stopping}.")
        self._console.rank_failed(failure)
        self._stop()
        for relay in worker.relays:
            relay.join(_RELAY_JOIN_S)
        failure = WorkerFailure(rank=failure.rank, size=failure.size, hostname=failure.hostname,
                                returncode=code, stderr_tail=tuple(worker.tail),
                                program=worker.program)
        self._console.say("\n".join(failure.report(stopped=others)))
        return failure.exit_status

    def _interrupted(self) -> int:
        signum = self._interrupt or int(signal.SIGTERM)
        alive = sum(1 for w in self._workers if w.proc.poll() is None)
        self._console.say(f"received {signal_name(signum)}; stopping {alive} rank(s) "
                          f"(send it again to kill them at once).")
        self._console.interrupted(signum)
        self._stop()
        return exit_status(-signum)

    def _stop_leftovers(self) -> None:
        """After every rank exited 0: stop processes the ranks left behind in their groups."""
        live = _live_groups([w.proc.pid for w in self._workers])
        left = [w.rank for w in self._workers if w.proc.pid in live]
        if left:
            self._console.say(f"rank(s) {', '.join(map(str, left))} exited but left processes "
                              "running in their process group; stopping them.")
            self._stop()

    def _stop(self, quiet: bool = False) -> None:
        """Ask every worker to stop (SIGTERM its process group, or close its stdin), SIGKILL
        what is left after the grace period."""
        groups = [w.proc.pid for w in self._workers]
        if not groups or (quiet and not _live_groups(groups)):
            return
        for worker in self._workers:
            worker.ask_to_stop()
        deadline = time.monotonic() + GRACE_PERIOD_S
        while time.monotonic() < deadline and not self._kill_now:
            if not _live_groups(groups):
                return
            time.sleep(_POLL_S)
        for pgid in groups:
            _killpg(pgid, signal.SIGKILL)
        for worker in self._workers:
            try:
                worker.proc.wait(timeout=GRACE_PERIOD_S)
            except subprocess.TimeoutExpired:
                self._console.say(f"rank {worker.rank} (pid {worker.proc.pid}) did not die "
                                  "after SIGKILL.")

    def _join_relays(self) -> None:
        deadline = time.monotonic() + _RELAY_JOIN_S
        for worker in self._workers:
            for relay in worker.relays:
                relay.join(max(0.0, deadline - time.monotonic()))


# ---- shared memory left by killed ranks ---------------------------------------------------------

def remove_shm_segments(job_id: str | None, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink ``<shm_dir>/hora-<job_id>-*`` once every rank has exited; returns the names removed.

    Ranks unlink the shared memory segments they own when they close, but a rank killed with
    SIGKILL cannot. The naming rule (and which ids are valid) is :mod:`hora._util.shm_names`'s.
    """
    return [os.path.basename(p) for p in remove_job_segments(job_id, shm_dir)]


@contextmanager
def _stop_signals(handler: Callable[[int], None]) -> Iterator[None]:
    """Route SIGINT / SIGTERM / SIGHUP to ``handler`` while the job runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for signum in _STOP_SIGNALS:
        previous[signum] = signal.signal(signum, lambda s, _frame: handler(s))
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def run_local(command: Sequence[str], ranks: Sequence[RankLaunch], *,
              output_dir: str | None = None, prefix_timestamp: bool = False,
              console: Console = CONSOLE) -> int:
    """Run ``command`` once per entry of ``ranks`` on this host and wait for all of them.

    Args:
        command: program and arguments, executed directly (no shell).
        ranks: one entry per rank, in rank order, each with its full environment.
        output_dir: also write each rank's raw output to ``output_dir/rank.<r>/{stdout,stderr}``.
        prefix_timestamp: put ``time.asctime()`` before each relayed line's prefix.
        console: where relayed lines and launcher messages go.

    Returns:
        0 if every rank exited 0; else the first failure's exit code (128 + N for signal N);
        128 + N if the launcher received signal N; 127 if the command was not found.
    """
    supervisor = _Supervisor(command, ranks, output_dir, prefix_timestamp, console)
    with _stop_signals(supervisor.on_signal):
        return supervisor.run()


__all__ = [
    "CONSOLE",
    "GRACE_PERIOD_S",
    "Console",
    "RankLaunch",
    "rank_output_dir",
    "remove_shm_segments",
    "run_local",
    "say",
]
