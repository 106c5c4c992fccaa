"""Soak: a real 3-rank `hora run` job doing thousands of mixed collectives, checked and metered.

Every rank derives the whole schedule from one seed: rounds of 1-12 ops (allreduce with
Sum/Average/Max/Min, allgather with a different first dimension per rank, broadcast from a
random root) on random dtypes and sizes of 0..64K elements (log-uniform: mostly small, some
large). Each rank submits a round's ops asynchronously in its *own* random order, then
synchronizes them in yet another order; op names repeat every round, as gradient names do.
Every result is compared with numpy (inputs are small integers, so sums are exact in every
dtype; Average of floats is compared with a tolerance).

Resident memory (``/proc/self/statm``) is sampled every few rounds; after a warm-up that runs
the largest ops first, it must not grow by more than :data:`RSS_GROWTH_LIMIT_MIB`.

Run this file directly as the worker: ``hora run -np 3 python tests/integration/test_soak.py
--worker``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any

import numpy as np

OPS = 6000
"""Collectives per rank (about 80% allreduce, 10% allgather, 10% broadcast)."""

MAX_ELEMENTS = 64 * 1024
RSS_GROWTH_LIMIT_MIB = 16.0
"""Allowed growth of a rank's resident memory from the end of warm-up to the end of the run.
The largest buffers (fusion buffer, scratch, results) are all created during warm-up; what is
left is allocator noise (a few MiB), so a leak of even a few hundred bytes per op shows up."""

WARMUP_FRACTION = 0.2
TIME_LIMIT_S = 120.0
"""Hard limit for the whole job (it normally takes ~10-25 s on 2 shared cores)."""

_DTYPES = ("float32", "float64", "float16", "int32", "int64", "uint8")
_SUM, _AVERAGE, _MAX, _MIN = "Sum", "Average", "Max", "Min"


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        resident = int(fh.read().split()[1])
    return resident * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _size(rng: np.random.Generator, biggest: bool) -> int:
    if biggest:
        return MAX_ELEMENTS
    if rng.random() < 0.05:
        return 0
    return int(min(MAX_ELEMENTS, np.exp(rng.uniform(0, np.log(MAX_ELEMENTS + 1)))))


def _schedule(seed: int, round_: int, biggest: bool) -> list[dict[str, Any]]:
    """The same list of op descriptions on every rank."""
    rng = np.random.default_rng([seed, round_])
    ops = []
    for i in range(12 if biggest else int(rng.integers(1, 13))):
        u = rng.random()
        kind = "allreduce" if u < 0.8 else "allgather" if u < 0.9 else "broadcast"
        dtype = "float64" if biggest else str(rng.choice(_DTYPES))
        op = _SUM
        if kind == "allreduce":
            choices = [_SUM, _MAX, _MIN] + ([_AVERAGE] if dtype.startswith("float") else [])
            op = str(rng.choice(choices))
            if dtype == "uint8" and op == _SUM:
                op = _MAX  # keep sums exact and non-negative
        n = _size(rng, biggest)
        cols = int(rng.integers(1, 5))
        ops.append({"i": i, "kind": kind, "dtype": dtype, "op": op, "n": n, "cols": cols,
                    "root": int(rng.integers(0, 3)), "name": f"soak.g{i}"})
    return ops


def _input(seed: int, round_: int, spec: dict[str, Any], rank: int) -> np.ndarray:
    rng = np.random.default_rng([seed, round_, spec["i"], rank])
    low = 0 if spec["dtype"] == "uint8" else -8
    if spec["kind"] == "allgather":
        rows = max(0, spec["n"] // spec["cols"] // 3 + int(rng.integers(-2, 3)))
        shape: tuple[int, ...] = (rows, spec["cols"])
    else:
        shape = (spec["n"],)
    return rng.integers(low, 9, size=shape).astype(spec["dtype"])


def _expected(seed: int, round_: int, spec: dict[str, Any], size: int) -> np.ndarray:
    inputs = [_input(seed, round_, spec, r) for r in range(size)]
    if spec["kind"] == "allgather":
        gathered: np.ndarray = np.concatenate(inputs, axis=0)
        return gathered
    if spec["kind"] == "broadcast":
        root: np.ndarray = inputs[spec["root"] % size]
        return root
    wide = np.stack([x.astype(np.float64) for x in inputs])
    out: np.ndarray
    if spec["op"] == _SUM:
        out = wide.sum(axis=0)
    elif spec["op"] == _AVERAGE:
        out = wide.mean(axis=0)
    elif spec["op"] == _MAX:
        out = wide.max(axis=0)
    else:
        out = wide.min(axis=0)
    return out


def worker(seed: int, total_ops: int) -> None:
    import hora

    hora.init()
    rank, size = hora.rank(), hora.size()
    ops_by_name = {_SUM: hora.Sum, _AVERAGE: hora.Average, _MAX: hora.Max, _MIN: hora.Min}
    order_rng = np.random.default_rng([seed, 1000 + rank])  # differs per rank
    done = {"allreduce": 0, "allgather": 0, "broadcast": 0}
    samples: list[float] = []
    warm_rss: float | None = None
    round_ = 0
    t0 = time.monotonic()
    while sum(done.values()) < total_ops:
        specs = _schedule(seed, round_, biggest=round_ < 3)
        handles: dict[int, int] = {}
        for j in order_rng.permutation(len(specs)):
            spec = specs[int(j)]
            x = _input(seed, round_, spec, rank)
            if spec["kind"] == "allreduce":
                h = hora.allreduce_async(x, name=spec["name"], op=ops_by_name[spec["op"]])
            elif spec["kind"] == "allgather":
                h = hora.allgather_async(x, name=spec["name"])
            else:
                h = hora.broadcast_async(x, spec["root"] % size, name=spec["name"])
            handles[spec["i"]] = h
        for j in order_rng.permutation(len(specs)):
            spec = specs[int(j)]
            got = hora.synchronize(handles[spec["i"]])
            ref = _expected(seed, round_, spec, size)
            ok = got.dtype == np.dtype(spec["dtype"]) and got.shape == ref.shape
            if ok and spec["op"] == _AVERAGE:
                ok = np.allclose(got.astype(np.float64), ref, rtol=1e-2, atol=1e-2)
            elif ok:
                ok = np.array_equal(got.astype(np.float64), ref)
            if not ok:
                print(f"MISMATCH rank {rank} round {round_} {spec}: got {got.dtype} "
                      f"{got.shape} {got.ravel()[:8]} expected {ref.shape} {ref.ravel()[:8]}",
                      flush=True)
                sys.exit(3)
            done[spec["kind"]] += 1
        round_ += 1
        if round_ % 10 == 0:
            samples.append(_rss_mib())
            if warm_rss is None and sum(done.values()) >= WARMUP_FRACTION * total_ops:
                warm_rss = samples[-1]
    elapsed = time.monotonic() - t0
    final = _rss_mib()
    hora.shutdown()
    report = {"rank": rank, "ops": done, "rounds": round_, "seconds": round(elapsed, 2),
              "rss_warm_mib": round(warm_rss or final, 1), "rss_end_mib": round(final, 1),
              "rss_max_mib": round(max(samples + [final]), 1)}
    print("SOAK " + json.dumps(report), flush=True)


def run_soak(np_: int = 3, ops: int = OPS, seed: int = 1234,
             timeout: float = TIME_LIMIT_S) -> tuple[int, list[dict[str, Any]], str]:
    """Launch the soak job; returns (exit status, per-rank reports, full output)."""
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(np_), sys.executable,
           os.path.abspath(__file__), "--worker", "--seed", str(seed), "--ops", str(ops)]
    from _case_jobs import run_group  # (here: this file also runs as the ranks' script)

    ran = run_group(cmd, timeout=timeout, merge_stderr=True)
    out = ran.stdout
    if ran.timed_out:
        return -1, [], f"TIMEOUT after {timeout} s\n{out}"
    reports = [json.loads(m) for m in re.findall(r"SOAK (\{.*\})", out)]
    return ran.returncode, sorted(reports, key=lambda r: r["rank"]), out


if __name__ != "__main__":
    import pytest

    @pytest.mark.integration
    @pytest.mark.timeout(TIME_LIMIT_S + 30)
    def test_soak_three_ranks_mixed_collectives() -> None:
        t0 = time.monotonic()
        status, reports, out = run_soak()
        wall = time.monotonic() - t0
        assert status == 0, out[-5000:]
        assert len(reports) == 3, out[-5000:]
        for rep in reports:
            assert sum(rep["ops"].values()) >= OPS, rep
            assert min(rep["ops"].values()) > OPS // 20, rep  # every kind was exercised
            growth = rep["rss_end_mib"] - rep["rss_warm_mib"]
            assert growth <= RSS_GROWTH_LIMIT_MIB, (rep, out[-3000:])
        print(f"soak: {reports[0]['ops']} per rank in {wall:.1f} s wall; "
              + "; ".join(f"rank {r['rank']}: rss {r['rss_warm_mib']} -> {r['rss_end_mib']} MiB "
                          f"(max {r['rss_max_mib']})" for r in reports))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="run as one rank (under hora run)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--ops", type=int, default=OPS)
    parser.add_argument("--np", type=int, default=3)
    args = parser.parse_args()
    if args.worker:
        worker(args.seed, args.ops)
    else:
        status, reports, output = run_soak(args.np, args.ops, args.seed)
        print(output if status else "\n".join(json.dumps(r) for r in reports))
        sys.exit(0 if status == 0 else 1)
