"""One report per failure under ``--data-plane mpi``: the ranks' error blocks from mpirun's
stream, held and sorted as :mod:`hora.runner.local` sorts them for its own ranks.

Runner layer, beside :mod:`hora.runner.mpi_launch`. mpirun merges every rank's stderr into one
tagged stream and reports only its own exit status, so the blocks (a traceback, or an error line
logged by hora: :func:`hora.runner.rank_errors.starts_block`) are held per rank as they arrive; a
block is written out when its rank goes on writing :data:`~hora.runner.rank_errors.HOLD_S`
after it began (the rank ran on). When mpirun's stream ends, a failed job's blocks are reported
as ``hora run`` reports its own: the root cause (the first block that is not an error hora
raised because of another rank) in full, the other ranks' consequences (or the very same error)
in one line, then the summary repeating the error; a job that succeeded gets its blocks as they
were.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from hora.runner.rank_errors import HOLD_S, ErrorBlock, consequences_line, starts_block


class MpiErrors:
    """The held error blocks of an mpirun job's ranks (thread-safe: each stream's relay calls
    :meth:`line`; the launcher calls :meth:`report` once both relays ended).

    Args:
        write: writes text to the launcher's stream (``stream``, ``text``).
        say: writes one ``[hora]`` message.
    """

    def __init__(self, write: Callable[[str, str], bool], say: Callable[[str], None]) -> None:
        self._write, self._say = write, say
        self._lock = threading.Lock()
        self._open: dict[int, tuple[ErrorBlock, float]] = {}  # rank -> its block, held until
        self._held: list[ErrorBlock] = []  # every block not written out, in arrival order

    def line(self, rank: int, stream: str, relayed: str, text: str) -> bool:
        """A complete stderr line of ``rank`` (``relayed``: as the console shows it, ``text``:
        without the prefix). True if it was held; False: write it out now (after the block it
        ends, which this writes)."""
        if stream != "stderr":
            return False
        with self._lock:
            held = self._open.get(rank)
            if held is not None and time.monotonic() >= held[1]:  # the rank ran on
                del self._open[rank]
                self._held = [b for b in self._held if b is not held[0]]
                self._write(stream, held[0].text())
                held = None
            if held is None:
                if not starts_block(text):
                    return False
                held = (ErrorBlock(rank, stream), time.monotonic() + HOLD_S)
                self._open[rank] = held
                self._held.append(held[0])  # (the order blocks began in: the first failure)
            held[0].add(relayed, text)
            return True

    def report(self, status: int) -> None:
        """mpirun's stream ended with exit ``status``: write the held blocks (a failure: one
        report, see the module docstring)."""
        with self._lock:
            blocks, self._held = self._held, []
            self._open.clear()
        if not status:
            for block in blocks:
                self._write(block.stream, block.text())
            return
        last = {b.rank: b for b in blocks}  # a rank's last block is its error
        order = [b for b in blocks if last[b.rank] is b]
        cause = next((b for b in order if not b.is_consequence()), order[0] if order else None)
        if cause is None:
            self._say(f"mpirun exited with status {status}; no rank printed an error (see "
                      "mpirun's message above)")
            return
        self._write(cause.stream, cause.text(drop_echoes=True))
        said = cause.exception()
        followers = []
        for other in sorted((b for b in order if b is not cause), key=lambda b: b.rank):
            if other.is_consequence() or (said and other.exception() == said):
                followers.append(other)
            else:  # an error of its own: shown as it is
                self._write(other.stream, other.text())
        if followers:
            self._say(consequences_line(followers, cause, cause.rank))
        summary = [f"job failed: mpirun exited with status {status}; the root cause: "
                   f"rank {cause.rank}'s error (its traceback is above):"]
        summary += [f"  {line}" for line in said or cause.raw[-1:]]
        self._say("\n".join(summary))


__all__ = ["MpiErrors"]
