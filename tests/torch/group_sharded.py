"""Case group: hora.torch.ShardedOptimizer at 2 ranks (cases in sharded_cases.py; the last
one loads the checkpoint the 4-rank job wrote)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sharded_cases

NP = 2


def init(hvd: Any) -> None:
    hvd.init()


def cases() -> list[tuple[str, Callable[..., None]]]:
    return [*sharded_cases.cases(), ("load_other_size", sharded_cases.load_other_size)]
