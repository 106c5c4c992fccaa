"""Timeline: Horovod's Chrome-trace timeline of every op's phases, and its summary tool.

:mod:`hora.timeline.writer` records (the engine calls its hooks; only rank 0 writes, unless
per-rank files are asked for); :mod:`hora.timeline.summary` reads a timeline back and prints where
the time went and which rank kept the others waiting (``hora timeline FILE``).

Layering: imports only the base layer (``hora._util``, ``hora.errors``, ``hora.config``), so both
the engine (core) and the launcher (runner) may use it.
"""

from __future__ import annotations

from hora.timeline.writer import DYNAMIC, Timeline, collective_activity, is_dynamic, rank_path

__all__ = ["DYNAMIC", "Timeline", "collective_activity", "is_dynamic", "rank_path"]
