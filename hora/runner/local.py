"""Start the ranks of a job on this host, relay their output, and stop them together.

Runner layer: the mechanism under :func:`hora.runner.launch.launch`, which decides *what* each
rank gets (command, environment); this module decides *how* processes run here:

* every rank is a subprocess in its own session / process group, so the launcher can stop a
  rank together with everything it started (data-loader workers, shells) and nothing else;
* each line of a rank's stdout / stderr is relayed prefixed ``[<rank>]<stdout>:`` (Horovod's
  format, optionally preceded by ``time.asctime()``), and optionally copied raw to
  ``DIR/rank.<r>/{stdout,stderr}``;
* the first rank to fail (non-zero exit or a signal) ends the job: the others get
  :data:`SETTLE_S` to exit by themselves, then SIGTERM on their process group, then SIGKILL
  after :data:`GRACE_PERIOD_S`. The root cause decides the launcher's exit status: the first
  rank whose error is not one that hora raised because of another rank. Its error (traceback)
  is printed once in full, the others' consequential errors as one line naming them
  (:mod:`hora.runner.rank_errors`), then the summary;
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

import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from hora._util.shm_names import SHM_DIR, remove_job_segments
from hora.runner.failures import WorkerFailure, exit_status, signal_name
from hora.runner.output import (  # re-exported: the launcher's output (__all__)
    CONSOLE,
    Console,
    rank_output_dir,
    say,
)
from hora.runner.processes import (  # re-exported: RankLaunch, GRACE_PERIOD_S (__all__)
    GRACE_PERIOD_S,
    RankLaunch,
    StartError,
    _live_groups,
    _parent_death_signal,
    _Worker,
    spawn,
    stop_workers,
)
from hora.runner.rank_errors import ErrorBlock, HeldErrors, consequences_line

_RELAY_JOIN_S = 5.0
SETTLE_S = 1.0
"""After the first failure, how long the other ranks may take to exit by themselves before they
are stopped: their errors show which rank's failure caused the others'."""
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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
        self._held = HeldErrors(self._write_block)

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
            for block in sorted(self._held.take_all().values(), key=lambda b: b.rank):
                self._write_block(block)
            if self._ranks:
                remove_shm_segments(self._ranks[0].env.get("HORA_JOB_ID"))

    def _start_all(self) -> int | None:
        preexec = _parent_death_signal()
        size = len(self._ranks)
        for launch in self._ranks:
            if self._interrupt is not None:
                return self._interrupted()
            try:
                worker = spawn(self._command, launch, launch.slot.rank, size=size,
                               exits=self._exits, console=self._console,
                               output_dir=self._output_dir, prefix_timestamp=self._timestamp,
                               preexec=preexec, held=self._held)
            except StartError as exc:
                self._console.say("\n".join([exc.message, *exc.failure.hints()]))
                self._console.rank_failed(exc.failure)
                return exc.failure.returncode
            self._workers.append(worker)
        return None

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
                return self._failed(by_rank, [(rank, code)], running)
            self._held.release(rank)
        self._stop_leftovers()
        return 0

    def _failed(self, by_rank: dict[int, _Worker], exited: list[tuple[int, int]],
                running: set[int]) -> int:
        """The first failure: let the others settle, stop the rest, report the root cause."""
        self._held.failing.set()
        first = by_rank[exited[0][0]]
        failure = WorkerFailure(rank=first.rank, size=len(self._workers),
                                hostname=first.slot.hostname, returncode=exited[0][1])
        self._console.rank_failed(failure)
        deadline = time.monotonic() + SETTLE_S
        while running and self._interrupt is None and time.monotonic() < deadline:
            try:
                rank, code = self._exits.get(timeout=0.02)
            except queue.Empty:
                continue
            running.discard(rank)
            exited.append((rank, code))
        if running:
            self._console.say(f"{failure.describe()}; stopping the other {len(running)} "
                              "rank(s).")
        self._stop()
        self._join_relays()
        return self._report(by_rank, exited, stopped=len(running))

    def _report(self, by_rank: dict[int, _Worker], exited: list[tuple[int, int]],
                stopped: int) -> int:
        """Print the root cause's error in full, the others' consequences in one line, then
        the summary; the root cause's exit status."""
        blocks = self._held.take_all()
        failed = [(rank, code) for rank, code in exited if code != 0]
        rank, code = next(((r, c) for r, c in failed
                           if r not in blocks or not blocks[r].is_consequence()), failed[0])
        cause = blocks.pop(rank, None)
        if cause is not None:
            self._console.write(cause.stream, cause.text(drop_echoes=True))
        said = cause.exception() if cause is not None else []
        followers: list[ErrorBlock] = []
        for other in sorted(blocks.values(), key=lambda b: b.rank):
            if other.is_consequence() or (said and other.exception() == said):
                followers.append(other)
            else:  # an error of its own: shown as it is
                self._write_block(other)
        if followers:
            self._console.say(consequences_line(followers, cause, rank))
        worker = by_rank[rank]
        failure = WorkerFailure(rank=rank, size=len(self._workers),
                                hostname=worker.slot.hostname, returncode=code,
                                stderr_tail=tuple(worker.tail), program=worker.program)
        self._console.say("\n".join(failure.report(stopped=stopped,
                                                   first=rank == exited[0][0])))
        return failure.exit_status

    def _write_block(self, block: ErrorBlock) -> None:
        self._console.write(block.stream, block.text())

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
        """Ask every worker to stop, SIGKILL what is left after the grace period."""
        stop_workers(self._workers, self._console, quiet=quiet,
                     kill_now=lambda: self._kill_now)

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
