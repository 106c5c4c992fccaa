"""Case group: hora.jax.ShardedOptimizer (hora-only) at 4 ranks: the cases of
group_jax_sharded.py that do not need its one-rank process sets."""

from __future__ import annotations

from typing import Any

import group_jax_sharded as g


def init(hvd: Any) -> None:
    hvd.init()


def cases() -> list[tuple[str, Any]]:
    return [("sharded-equivalence", g.equivalence), ("sharded-state-bytes", g.state_bytes),
            ("sharded-accumulation", g.accumulation), ("sharded-elastic", g.elastic_state)]
