"""Reading a Chrome-trace timeline back as a stream of events, in bounded memory.

:func:`iter_events` reads a file written by :mod:`hora.timeline.writer` (or by Horovod's
``HOROVOD_TIMELINE``) in chunks and yields its event objects one by one; both the array form and
the ``{"traceEvents": [...]}`` object form are accepted. A file cut off mid-write (the job
crashed) is read up to the last complete event, and :class:`ParseState` says where and why it
stopped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from hora.errors import TimelineFormatError

_CHUNK = 1 << 20
_DECODER = json.JSONDecoder()
_WS = " \t\r\n"


@dataclass
class ParseState:
    """How reading the file went."""

    events: int = 0
    truncated: bool = False
    stopped_at: int = -1  # character offset where reading stopped early (truncated files)
    reason: str = ""


def iter_events(fh: IO[str], state: ParseState | None = None) -> Iterator[dict[str, Any]]:
    """Yield the event objects of a timeline file one by one, reading it in chunks.

    Stops quietly at the first incomplete or corrupt event (a file truncated by a crash) and
    records that in ``state``. Non-object array elements are skipped.

    Raises:
        TimelineFormatError: the file does not start like a trace (``[`` or ``{``).
    """
    state = state if state is not None else ParseState()
    buf = fh.read(_CHUNK)
    base = 0  # file offset of buf[0]
    pos = 0
    eof = not buf
    while True:  # skip leading whitespace (reading more if the first chunk was all blank)
        while pos < len(buf) and buf[pos] in _WS:
            pos += 1
        if pos < len(buf) or eof:
            break
        more = fh.read(_CHUNK)
        eof = not more
        buf, base, pos = more, base + len(buf), 0
    if pos >= len(buf):
        raise TimelineFormatError("the file is empty")
    if buf[pos] == "{":  # {"traceEvents": [...]}: the object form; small files only
        try:
            whole = json.loads(buf[pos:] + fh.read())
        except ValueError as exc:
            raise TimelineFormatError(f"not valid JSON: {exc}") from None
        events = whole.get("traceEvents") if isinstance(whole, dict) else None
        if not isinstance(events, list):
            raise TimelineFormatError("a JSON object without a 'traceEvents' list")
        for ev in events:
            if isinstance(ev, dict):
                state.events += 1
                yield ev
        return
    if buf[pos] != "[":
        raise TimelineFormatError(f"expected a JSON array of trace events, found {buf[pos]!r} "
                                  "at the start")
    pos += 1
    while True:
        while pos < len(buf) and (buf[pos] in _WS or buf[pos] == ","):
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        if pos >= len(buf) and eof:
            state.truncated, state.stopped_at = True, base + pos
            state.reason = "the file ends before the closing ']'"
            return
        try:
            if pos >= len(buf):
                raise ValueError("need more data")
            ev, end = _DECODER.raw_decode(buf, pos)
        except ValueError as exc:
            if eof:
                state.truncated, state.stopped_at = True, base + pos
                state.reason = f"incomplete or corrupt event ({exc})"
                return
            more = fh.read(_CHUNK)
            eof = not more
            buf, base, pos = buf[pos:] + more, base + pos, 0
            continue
        pos = end
        if isinstance(ev, dict):
            state.events += 1
            yield ev


__all__ = ["ParseState", "iter_events"]
