"""The case ids of the JAX job, known without importing JAX (the pytest process lists them;
only the ranks import JAX). The dtype tables of the factory live here too."""

from __future__ import annotations

from types import SimpleNamespace

import collective_suite

REDUCE = ["int32", "bfloat16", "float32", "float64"]
MOVE = REDUCE + ["int8", "int16"]
REJECTED = {family: ["bool", "int16", "uint32", "complex64"]
            for family in ("allreduce", "grouped_allreduce", "reducescatter")} | {
    family: ["uint32", "complex64"] for family in ("allgather", "broadcast", "alltoall")}
JAX_ONLY = [
    "results-adopted", "tree-ops", "tree-async", "metrics-dict", "tree-packed",
    "pure-callback-fallback",
    "jit-ops", "jit-steady-names", "vmap", "jit-into-results",
    "jit-inplace-computed",
    "grad-allreduce", "grad-allreduce-tree", "grad-allgather", "grad-broadcast",
    "grad-reducescatter", "grad-alltoall", "grad-eager-equals-jit", "optimizer-identical",
    "optimizer-passes-fp16", "broadcast-state", "mismatch-tree-structure",
    "mismatch-tree-structure-jit", "mismatch-tree-shape", "mismatch-shape", "traced-errors",
]


def suite_ids() -> list[str]:
    tables = SimpleNamespace(reduce_dtypes=REDUCE, move_dtypes=MOVE, rejected=REJECTED)
    return [case_id for case_id, _ in collective_suite.cases(tables)]  # type: ignore[arg-type]


def all_ids() -> list[str]:
    """Execution order: the suite, the JAX-only cases, then the suite's join."""
    ids = suite_ids()
    return ids[:-1] + JAX_ONLY + ids[-1:]


ADASUM = ["adasum-allreduce-eager", "adasum-allreduce-jit", "adasum-tree",
          "adasum-optimizer-sgd", "adasum-optimizer-adam", "adasum-optimizer-passes",
          "adasum-errors"]
"""The cases of group_jax_adasum.py (test_jax_adasum.py)."""


SHARDED = ["sharded-equivalence", "sharded-state-bytes", "sharded-full-state",
           "sharded-accumulation", "sharded-eager", "sharded-elastic", "sharded-clip"]
SHARDED4 = ["sharded-equivalence", "sharded-state-bytes", "sharded-accumulation",
            "sharded-elastic"]
"""The cases of group_jax_sharded.py (test_jax_sharded.py)."""


def ids(group: str) -> list[str]:
    if group == "group_jax_sharded":
        return SHARDED
    if group == "group_jax_sharded4":
        return SHARDED4
    return ADASUM if group == "group_jax_adasum" else all_ids()
