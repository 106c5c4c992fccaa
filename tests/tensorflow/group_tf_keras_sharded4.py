"""Case group: the Keras 3 ShardedOptimizer (hora-only) with ``model.fit`` at 4 ranks: the cases
of tf_sharded_cases.py that do not need the 2-rank job's one-rank process sets."""

from __future__ import annotations

from typing import Any

import tf_sharded_cases

CASE_IDS = ["sharded-fit", "sharded-state-bytes", "sharded-passes"]


def init(hvd: Any) -> None:
    hvd.init()


def cases() -> list[tuple[str, Any]]:
    return [(c, fn) for c, fn in tf_sharded_cases.keras3_cases() if c in CASE_IDS]
