"""Case group: the ShardedOptimizer (hora-only) with tf-keras (Keras 2, ``TF_USE_LEGACY_KERAS=1``
in the job's environment) and ``model.fit`` on 2 ranks (cases in tf_sharded_cases.py)."""

from __future__ import annotations

from typing import Any

import tf_sharded_cases

CASE_IDS = ["sharded-fit", "sharded-state-bytes", "sharded-sum-predivide", "sharded-passes",
            "sharded-clip"]


def init(hvd: Any) -> None:
    tf_sharded_cases.init(hvd)


def cases() -> list[tuple[str, Any]]:
    return tf_sharded_cases.keras2_cases()
