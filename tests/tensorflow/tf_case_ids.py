"""The case ids of the TensorFlow job, known without importing TensorFlow (the pytest process
lists them; only the ranks import TensorFlow). The dtype tables of the factory live here too."""

from __future__ import annotations

from types import SimpleNamespace

import collective_suite

REDUCE = ["int32", "bfloat16", "float32", "float64"]
MOVE = REDUCE + ["int8", "uint16"]
REJECTED = {family: ["bool", "int16", "complex64"]
            for family in ("allreduce", "grouped_allreduce", "reducescatter")} | {
    family: ["complex64", "string"] for family in ("allgather", "broadcast", "alltoall")}
GRAPH_DTYPES = ("int32", "float32", "bfloat16")
TF_ONLY = [f"graph-{d}" for d in GRAPH_DTYPES] + [
    "grad-eager", "grad-graph", "tape-eager", "tape-graph", "tape-results", "host-call-in-place",
    "variables-sparse",
    "mismatch-eager", "mismatch-graph"] + [
    "v1-unordered", "v1-unordered-kinds", "v1-grouped-grad", "v1-names",
    "v1-broadcast-inplace", "error-types", "sparse-rules", "util"]  # tf_v1_cases.V1_IDS


def suite_ids() -> list[str]:
    tables = SimpleNamespace(reduce_dtypes=REDUCE, move_dtypes=MOVE, rejected=REJECTED)
    return [case_id for case_id, _ in collective_suite.cases(tables)]  # type: ignore[arg-type]


def all_ids() -> list[str]:
    """Execution order: the suite, the TensorFlow-only cases, then the suite's join."""
    ids = suite_ids()
    return ids[:-1] + TF_ONLY + ids[-1:]
