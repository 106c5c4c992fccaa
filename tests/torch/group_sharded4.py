"""Case group: hora.torch.ShardedOptimizer at 4 ranks, process sets [0, 1] and [2, 3]
registered at init (cases in sharded_cases.py; full_state_dict writes the checkpoint the
2-rank job loads)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sharded_cases

NP = 4


def init(hvd: Any) -> None:
    sharded_cases.SETS["low"] = hvd.ProcessSet([0, 1])
    sharded_cases.SETS["high"] = hvd.ProcessSet([2, 3])
    hvd.init(process_sets=[sharded_cases.SETS["low"], sharded_cases.SETS["high"]])


def cases() -> list[tuple[str, Callable[..., None]]]:
    return sharded_cases.cases()
