"""Timeline: Horovod's Chrome-trace timeline of every op's phases, and its summary tool.

:mod:`hora.timeline.writer` records (the engine calls its hooks; only rank 0 writes, unless
per-rank files are asked for) into a :mod:`hora.timeline.trace_file`; :mod:`hora.timeline.summary`
reads a timeline back (:mod:`hora.timeline.trace_reader`) and works out where the time went and
which rank kept the others waiting, which :mod:`hora.timeline.summary_report` prints
(``hora timeline FILE``).

Layering: imports only the base layer (``hora._util``, ``hora.errors``, ``hora.config``), so both
the engine (core) and the launcher (runner) may use it.
"""

from __future__ import annotations

from hora.timeline.writer import DYNAMIC, Timeline, collective_activity, is_dynamic, rank_path

__all__ = ["DYNAMIC", "Timeline", "collective_activity", "is_dynamic", "rank_path"]
