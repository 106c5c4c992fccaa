"""One process of a job: start it in its own process group, relay its output, stop it.

Runner layer, under :mod:`hora.runner.local` (the fixed-size job's supervisor) and
:mod:`hora.runner.elastic.driver` (the elastic one): :func:`spawn` starts a process described by
a :class:`RankLaunch` and reports its exit on a queue; :func:`stop_workers` stops processes with
SIGTERM to their groups (or by closing stdin for a rank started over ssh), then SIGKILL after
:data:`GRACE_PERIOD_S`.
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
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from hora.rendezvous.topology import Slot
from hora.runner import binding
from hora.runner.failures import WorkerFailure
from hora.runner.output import Console, _Relay, rank_output_dir
from hora.runner.rank_errors import HeldErrors

GRACE_PERIOD_S = 5.0
"""Seconds between SIGTERM and SIGKILL when the launcher stops ranks (Horovod's value)."""

STDERR_TAIL_LINES = 10
"""Lines of a failed rank's stderr repeated in the root-cause message."""

_POLL_S = 0.05


@dataclass(frozen=True)
class RankLaunch:
    """One process to start: where it sits in the job and its complete environment.

    ``argv`` replaces the job's command for this rank (e.g. the ``ssh`` that starts a remote
    rank); ``stdin``, when given, is written to the process's stdin, which then stays open
    until the launcher stops the rank by closing it; ``before_start`` is called just before the
    process starts (e.g. to pace ssh connections to one host); ``cpus``: the cores the process
    is bound to (:mod:`hora.runner.binding`), None: not bound.
    """

    slot: Slot
    env: Mapping[str, str]
    argv: Sequence[str] | None = None
    stdin: bytes | None = field(default=None, repr=False)
    before_start: Callable[[], None] | None = None
    cpus: tuple[int, ...] | None = None


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
    label: int = -1  # the number its output lines are prefixed with (the rank; elastic: worker id)

    @property
    def rank(self) -> int:
        return self.slot.rank if self.label < 0 else self.label

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


# ---- one process -------------------------------------------------------------------------------

class StartError(Exception):
    """A rank's process could not be started; ``failure`` describes it for the summary."""

    def __init__(self, message: str, failure: WorkerFailure) -> None:
        super().__init__(message)
        self.message = message
        self.failure = failure


def spawn(command: Sequence[str], launch: RankLaunch, label: int, *, size: int,
          exits: queue.Queue[tuple[int, int]], console: Console,
          output_dir: str | None = None, prefix_timestamp: bool = False,
          preexec: Callable[[], None] | None = None, held: HeldErrors | None = None) -> _Worker:
    """Start one process of a job in its own process group, relay its output prefixed with
    ``label``, and put ``(label, exit code)`` on ``exits`` when it ends. An error its stderr
    ends with goes to ``held`` when given (else it is written out like any other line).

    Raises:
        StartError: the program could not be started (exit status 127 when not found, else
            126), or its output copy could not be opened (1).
    """
    try:
        copies = _open_copies(output_dir, label, size)
    except OSError as exc:
        message = f"cannot write the output of rank {label} to {exc.filename}: " \
                  f"{exc.strerror or exc}"
        raise StartError(message, WorkerFailure(rank=label, size=size,
                                                hostname=launch.slot.hostname, returncode=1,
                                                start_error=message)) from None
    argv = list(command) if launch.argv is None else list(launch.argv)
    if preexec is None:
        preexec = _parent_death_signal()
    preexec = binding.with_binding(launch.cpus, preexec)
    if launch.before_start is not None:
        launch.before_start()
    try:
        proc = subprocess.Popen(
            argv, env=dict(launch.env),
            stdin=subprocess.DEVNULL if launch.stdin is None else subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            # preexec only calls sched_setaffinity / prctl / getppid / kill: it takes no lock,
            # so the fork-with-threads hazard does not apply.
            preexec_fn=preexec, close_fds=True)  # noqa: PLW1509
    except OSError as exc:
        for copy in copies.values():
            if copy is not None:
                copy.close()
        message = f"cannot start rank {label}: {argv[0]!r}: {exc.strerror or exc}"
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        raise StartError(message, WorkerFailure(
            rank=label, size=size, hostname=launch.slot.hostname, returncode=code,
            start_error=message, command=tuple(argv))) from None
    worker = _Worker(slot=launch.slot, proc=proc, label=label,
                     program="" if launch.argv is not None else _resolve(argv[0], launch.env))
    assert proc.stdout is not None and proc.stderr is not None
    for name, pipe, tail in (("stdout", proc.stdout, None), ("stderr", proc.stderr, worker.tail)):
        relay = _Relay(pipe, label, name, console, copies[name], tail, prefix_timestamp,
                       held=held)
        relay.start()
        worker.relays.append(relay)
    if launch.stdin is not None:
        worker.release = threading.Event()
        threading.Thread(target=_feed, args=(worker, launch.stdin), daemon=True,
                         name=f"hora-stdin-{label}").start()

    def reap() -> None:
        code = proc.wait()
        if worker.release is not None:
            worker.release.set()
        exits.put((label, code))

    threading.Thread(target=reap, daemon=True, name=f"hora-wait-{label}").start()
    return worker


def _open_copies(output_dir: str | None, rank: int, size: int) -> dict[str, BinaryIO | None]:
    """The files that get a raw copy of the rank's stdout / stderr (--output-filename)."""
    if output_dir is None:
        return {"stdout": None, "stderr": None}
    rank_dir = rank_output_dir(output_dir, rank, size)
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


def stop_workers(workers: Sequence[_Worker], console: Console, *, quiet: bool = False,
                 kill_now: Callable[[], bool] = lambda: False) -> None:
    """Ask ``workers`` to stop (SIGTERM each process group, or close its stdin), SIGKILL what
    is left after :data:`GRACE_PERIOD_S` (at once when ``kill_now()`` turns true)."""
    groups = [w.proc.pid for w in workers]
    if not groups or (quiet and not _live_groups(groups)):
        return
    for worker in workers:
        worker.ask_to_stop()
    deadline = time.monotonic() + GRACE_PERIOD_S
    while time.monotonic() < deadline and not kill_now():
        if not _live_groups(groups):
            return
        time.sleep(_POLL_S)
    for pgid in groups:
        _killpg(pgid, signal.SIGKILL)
    for worker in workers:
        try:
            worker.proc.wait(timeout=GRACE_PERIOD_S)
        except subprocess.TimeoutExpired:
            console.say(f"rank {worker.rank} (pid {worker.proc.pid}) did not die after SIGKILL.")



__all__ = ["GRACE_PERIOD_S", "RankLaunch", "StartError", "spawn", "stop_workers"]
