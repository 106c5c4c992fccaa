"""A rank's error, as it reached the launcher: one block of its stderr, held together.

Runner layer, between the relays (:mod:`hora.runner.output`) and the supervisor
(:mod:`hora.runner.local`). A Python traceback, or an error line logged by hora, starts a
*block*: the relay holds it and the lines after it, and writes them out as one piece (so two
ranks' tracebacks never interleave) when the rank goes on writing for :data:`HOLD_S`, or hands
it to :class:`HeldErrors` when the rank's stderr ends. When a job fails, the supervisor takes
the held blocks and prints the root cause's in full and the other ranks' consequences (hora's
"peer lost" / "shut down" errors, or the very same error) as one line naming them.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from hora.runner.failures import _exception_lines

HOLD_S = 3.0
"""How long a block is held while its rank runs on (and the job is not failing)."""

MAX_BLOCK_LINES = 2000
"""A block longer than this is written out at once instead of being held."""

TRACEBACK_HEADER = "Traceback (most recent call last):"

# hora's own error log lines (hora._util.log's format, with or without the time stamp).
HORA_ERROR_LOG = re.compile(r"^\[(?:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: )?(?:ERROR|CRITICAL) "
                            r"rank \S+ hora[\w.]*\] (.*)$")

# Errors hora raises on a rank because of another rank (it died, shut down, cut a connection).
CONSEQUENCES = frozenset({"ShutdownError", "PeerLostError", "HoraInternalError",
                          "HorovodInternalError", "TransportError", "HoraTimeoutError",
                          "ProtocolError"})


BUG_SAYS = "This is a bug in hora"
"""What :func:`hora.errors.internal_error` says: a rank whose own hora thread failed (its error
is a ``HoraInternalError``, but a root cause, not a consequence)."""


def starts_block(line: str) -> bool:
    """Whether ``line`` (a rank's stderr line, without its prefix) begins an error block."""
    return line.startswith(TRACEBACK_HEADER) or HORA_ERROR_LOG.match(line) is not None


@dataclass
class ErrorBlock:
    """Consecutive lines of one rank's stderr, from a traceback or hora error line on.

    ``lines`` holds each line as relayed (prefix, text, terminator); ``raw`` the text alone.
    """

    rank: int
    stream: str
    lines: list[str] = field(default_factory=list)
    raw: list[str] = field(default_factory=list)

    def add(self, relayed: str, text: str) -> None:
        self.lines.append(relayed)
        self.raw.append(text)

    def exception(self) -> list[str]:
        """The exception that ends the block's traceback (its lines), or [] if none does."""
        return _exception_lines(tuple(line for line in self.raw if line.strip()))

    def exception_type(self) -> str:
        """``ValueError`` for ``ValueError: boom`` (the last dotted part); "" without one."""
        exc = self.exception()
        return exc[0].split(":", 1)[0].rsplit(".", 1)[-1].strip() if exc else ""

    def is_consequence(self) -> bool:
        """Whether the block shows an error hora raised because of another rank (or only hora's
        error log lines: the rank was stopped before it raised)."""
        exc = self.exception()
        if not exc:  # hora's log lines only, or a traceback cut short when the rank was stopped
            return True
        if BUG_SAYS in exc[0] and not exc[0].split(":", 1)[-1].strip().startswith("rank "):
            return False  # hora failed on this rank (others say "rank N failed: ..." then)
        return self.exception_type() in CONSEQUENCES or any(
            name in exc[0] for name in ("HorovodInternalError", "HoraInternalError"))

    def text(self, drop_echoes: bool = False) -> str:
        """The block as relayed. With ``drop_echoes``: without hora's error log lines whose
        message the block's exception repeats (the engine logs what it then raises)."""
        if not drop_echoes:
            return "".join(self.lines)
        said = "\n".join(self.exception())
        kept = [relayed for relayed, text in zip(self.lines, self.raw)
                if not ((m := HORA_ERROR_LOG.match(text)) and said and m.group(1) in said)]
        return "".join(kept)


class HeldErrors:
    """The blocks of one job's ranks whose stderr ended while a block was held.

    ``failing`` is set by the supervisor when a rank failed: relays then hold their blocks
    until the rank's stderr ends, for the supervisor to sort. A rank that exited 0 is
    *released*: its block is written out as it arrives.
    """

    def __init__(self, write: Callable[[ErrorBlock], None]) -> None:
        self.failing = threading.Event()
        self._write = write
        self._lock = threading.Lock()
        self._blocks: dict[int, ErrorBlock] = {}
        self._released: set[int] = set()

    def put(self, block: ErrorBlock) -> None:
        with self._lock:
            now = block.rank in self._released and not self.failing.is_set()
            if not now:
                self._blocks[block.rank] = block
        if now:
            self._write(block)

    def release(self, rank: int) -> None:
        """``rank`` exited 0: write its block now, and any that comes later."""
        with self._lock:
            self._released.add(rank)
            block = self._blocks.pop(rank, None)
        if block is not None:
            self._write(block)

    def take_all(self) -> dict[int, ErrorBlock]:
        with self._lock:
            blocks, self._blocks = self._blocks, {}
        return blocks


def consequences_line(blocks: Iterable[ErrorBlock], cause: ErrorBlock | None,
                      cause_rank: int) -> str:
    """One line naming the ranks whose errors followed ``cause_rank``'s failure, and what each
    raised (the exception's type, not its text: the cause's error is the one to read)."""
    said = cause.exception() if cause is not None else []
    parts = []
    for block in sorted(blocks, key=lambda b: b.rank):
        exc = block.exception()
        if exc and exc == said:
            what = "raised the same error"
        elif exc:
            what = f"raised {block.exception_type()}"
        elif any(line.startswith(TRACEBACK_HEADER) for line in block.raw):
            what = "was stopped while writing a traceback"
        else:
            what = "logged an error"
        parts.append(f"rank {block.rank} {what}")
    plural = "s" if len(parts) > 1 else ""
    return (f"also failed after rank {cause_rank}: {'; '.join(parts)} (traceback{plural} not "
            "shown; --output-filename DIR keeps every rank's full output).")


__all__ = ["CONSEQUENCES", "HOLD_S", "ErrorBlock", "HeldErrors", "consequences_line",
           "starts_block"]
