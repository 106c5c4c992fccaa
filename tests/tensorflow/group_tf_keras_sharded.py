"""Case group: the Keras 3 ShardedOptimizer (hora-only) with ``model.fit`` on 2 ranks (cases in
tf_sharded_cases.py)."""

from __future__ import annotations

from typing import Any

import tf_sharded_cases

CASE_IDS = ["sharded-fit", "sharded-state-bytes", "sharded-sum-predivide", "sharded-passes",
            "sharded-full-state", "sharded-elastic", "sharded-clip"]


def init(hvd: Any) -> None:
    tf_sharded_cases.init(hvd)


def cases() -> list[tuple[str, Any]]:
    return tf_sharded_cases.keras3_cases()
