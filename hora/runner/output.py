"""The launcher's output: its console (launcher messages, structured events) and the relays
that copy each rank's stdout / stderr to it line by line with the rank prefix.

A rank's error on stderr (a Python traceback, or an error line hora logged, and what follows)
is held and written as one piece, so that ranks' tracebacks never interleave; when the rank's
stderr ends while one is held, it goes to the job's :class:`~hora.runner.rank_errors.HeldErrors`
for the supervisor to report (:mod:`hora.runner.rank_errors`).

Runner layer; used by :mod:`hora.runner.local` (the supervisor) and API callers that watch a job
(:mod:`hora.runner.api`).
"""

from __future__ import annotations

import collections
import os
import re
import select
import sys
import threading
import time
from pathlib import Path
from typing import IO, BinaryIO

from hora.runner import rank_errors
from hora.runner.failures import WorkerFailure
from hora.runner.rank_errors import ErrorBlock, HeldErrors

MAX_SEGMENT_BYTES = 64 * 1024
"""A line longer than this is relayed in pieces instead of being held back indefinitely."""

# A line ends at \n, \r\n, or a lone \r (progress bars redraw with \r). A \r at the very end of
# the data read so far is held back until we know whether \n follows.
_TERMINATOR = re.compile(rb"\r\n|\n|\r(?=[^\n])")


class Console:
    """The launcher's own stdout / stderr, shared by all relay threads.

    Writes are whole lines under one lock, so lines of different ranks never interleave
    mid-line. Streams are looked up at write time (``sys.stdout`` may be replaced).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._broken: set[str] = set()

    def write(self, stream: str, text: str) -> bool:
        """Write ``text`` to ``"stdout"`` or ``"stderr"`` and flush.

        Returns:
            False once the stream is closed (broken pipe): nothing more can be written there.
        """
        target = sys.stdout if stream == "stdout" else sys.stderr
        with self._lock:
            if stream in self._broken or target is None:
                return False
            try:
                buffer = getattr(target, "buffer", None)
                if buffer is not None:
                    target.flush()
                    buffer.write(text.encode(target.encoding or "utf-8", "replace"))
                    buffer.flush()
                else:
                    target.write(text)
                    target.flush()
            except (OSError, ValueError):
                self._broken.add(stream)
                return False
            return True

    def say(self, message: str) -> None:
        """A launcher message: each line on stderr, prefixed ``[hora]``."""
        self.write("stderr", "".join(f"[hora] {line}\n" for line in message.splitlines()))

    # Structured events, besides the messages: the base console ignores them; API callers
    # (hora.run) subclass it to learn what happened without parsing text.
    def rank_failed(self, failure: WorkerFailure) -> None:
        """The first rank that failed (exited non-zero, killed, or could not start)."""

    def interrupted(self, signum: int) -> None:
        """The launcher received ``signum`` and stopped every rank."""


CONSOLE = Console()


def say(message: str) -> None:
    """Print a launcher message to stderr with the ``[hora]`` prefix."""
    CONSOLE.say(message)


def rank_output_dir(root: str | os.PathLike[str], rank: int, size: int) -> Path:
    """``root/rank.<r>`` with ``r`` zero-padded to the width of ``size - 1`` (at least 1 digit)."""
    width = len(str(max(size - 1, 0)))
    return Path(root) / f"rank.{rank:0{width}d}"


class _Relay(threading.Thread):
    """Copies one pipe of one rank to the console, line by line, with the rank prefix."""

    def __init__(self, pipe: IO[bytes], rank: int, stream: str, console: Console,
                 copy_to: BinaryIO | None, tail: collections.deque[str] | None,
                 timestamp: bool, held: HeldErrors | None = None) -> None:
        super().__init__(name=f"hora-relay-{rank}-{stream}", daemon=True)
        self._pipe = pipe
        self._rank = rank
        self._prefix = f"[{rank}]<{stream}>:"
        self._stream = stream
        self._console = console
        self._copy = copy_to
        self._tail = tail
        self._timestamp = timestamp
        self._holds = stream == "stderr"
        self._held = held  # where a block goes when the stream ends (None: written out)
        self._block: ErrorBlock | None = None
        self._block_until = 0.0

    def run(self) -> None:
        fd = self._pipe.fileno()
        pending = b""
        try:
            while True:
                if not self._readable(fd):  # a held block's time is up: the rank runs on
                    if not self._write_block():
                        return
                    continue
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                if self._copy is not None:
                    self._copy.write(chunk)
                    self._copy.flush()
                pending, ok = self._emit_complete(pending + chunk)
                if not ok:
                    # Our stream is closed (`hora run ... | head`): close the rank's pipe too, so
                    # its next write fails as it would without the launcher in between.
                    return
            if pending:
                self._emit([(pending.rstrip(b"\r"), b"\n")])
            if self._block is not None:  # the rank's last words: the supervisor reports them
                if self._held is None:
                    self._write_block()
                else:
                    self._held.put(self._block)
                    self._block = None
        finally:
            self._pipe.close()
            if self._copy is not None:
                self._copy.close()

    def _readable(self, fd: int) -> bool:
        """Wait until ``fd`` has data (or EOF); False when a held block's time ran out first.
        While the job is failing, a block is held until the stream ends."""
        while self._block is not None and not (self._held and self._held.failing.is_set()):
            left = self._block_until - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if ready:
                return True
        return True

    def _write_block(self) -> bool:
        block, self._block = self._block, None
        return block is None or self._console.write(self._stream, block.text())

    def _emit_complete(self, data: bytes) -> tuple[bytes, bool]:
        """Relay every complete line of ``data``; return the unfinished rest and whether the
        console stream is still open."""
        lines: list[tuple[bytes, bytes]] = []
        start = 0
        for match in _TERMINATOR.finditer(data):
            lines.append((data[start:match.start()], match.group()))
            start = match.end()
        rest = data[start:]
        if len(rest) > MAX_SEGMENT_BYTES:
            lines.append((rest, b"\n"))
            rest = b""
        ok = self._emit(lines) if lines else True
        return rest, ok

    def _emit(self, lines: list[tuple[bytes, bytes]]) -> bool:
        prefix = time.asctime() + self._prefix if self._timestamp else self._prefix
        parts = []
        for raw, terminator in lines:
            text = raw.decode("utf-8", errors="replace")
            relayed = f"{prefix}{text}{terminator.decode('ascii')}"
            if self._tail is not None and terminator != b"\r":
                self._tail.append(text)
            if self._block is None and self._holds and rank_errors.starts_block(text):
                self._block = ErrorBlock(self._rank, self._stream)
                self._block_until = time.monotonic() + rank_errors.HOLD_S
            if self._block is not None:
                self._block.add(relayed, text)
            else:
                parts.append(relayed)
        ok = self._console.write(self._stream, "".join(parts)) if parts else True
        if self._block is not None and len(self._block.lines) > rank_errors.MAX_BLOCK_LINES:
            ok = self._write_block() and ok
        return ok
