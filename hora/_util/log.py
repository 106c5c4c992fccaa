"""Rank-prefixed logging for the library.

Every library module does ``log = get_logger(__name__)``. :func:`configure` (called by ``init``)
installs one handler on the ``hora`` logger whose lines read
``[2026-11-21 20:49:22.123456: WARNING rank 1/4 hora.core.engine.engine] message``.
The library never prints.
"""

from __future__ import annotations

import logging
import sys

_ROOT = "hora"
TRACE = 5
logging.addLevelName(TRACE, "TRACE")

_LEVELS = {"trace": TRACE, "debug": logging.DEBUG, "info": logging.INFO,
           "warning": logging.WARNING, "error": logging.ERROR, "fatal": logging.CRITICAL}


class _RankFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.prefix = "rank ?"

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_prefix = self.prefix
        return True


_filter = _RankFilter()
_handler: logging.Handler | None = None


def get_logger(name: str) -> logging.Logger:
    """The logger for a module (``name`` is normally ``__name__``)."""
    return logging.getLogger(name)


def set_rank(rank: int | None, size: int | None) -> None:
    """Set the rank shown in every log line (None: unknown yet)."""
    _filter.prefix = "rank ?" if rank is None else f"rank {rank}/{size}"


def configure(level: str = "warning", hide_time: bool = False) -> None:
    """Install the rank-prefixed handler on the ``hora`` logger (idempotent)."""
    global _handler
    root = logging.getLogger(_ROOT)
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.addFilter(_filter)
        root.addHandler(_handler)
        root.propagate = False
    fmt = "[%(levelname)s %(rank_prefix)s %(name)s] %(message)s"
    if not hide_time:
        fmt = "[%(asctime)s.%(msecs)03d: %(levelname)s %(rank_prefix)s %(name)s] %(message)s"
    _handler.setFormatter(logging.Formatter(fmt, datefmt="%Y-%m-%d %H:%M:%S"))
    root.setLevel(_LEVELS.get(level.lower(), logging.WARNING))
