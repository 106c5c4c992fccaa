"""Hierarchical allreduce and allgather with fake host identities: one loopback world, hosts as
rank blocks (or interleaved).

E.g. 2 hosts x 2 ranks: local groups {0,1}, {2,3} (shared memory, or the ring over a SubComm),
cross groups {0,2}, {1,3} (shard scheme) or {0,2} among leaders (leader scheme).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hora.collectives.comm import SubComm
from hora.collectives.hierarchical import (
    HostLayout,
    hierarchical_allreduce,
    host_layout,
    leader_allgather,
    leader_allreduce,
)
from hora.collectives.ops import ReduceOp
from hora.collectives.shm import ShmGroup
from hora.transports.loopback import run_world
from hora.transports.shm import job_segments
from hora.transports.shm_fabric import ShmFabric

from .helpers import DTYPES, OPS, make_inputs, reference, same_bytes

_ids = itertools.count()


@pytest.fixture
def job_id() -> Iterator[str]:
    jid = f"th{os.getpid()}n{next(_ids)}"
    yield jid
    left = job_segments(jid)
    for path in left:
        os.unlink(path)
    assert not left, f"segments left behind: {left}"


def _hostnames(layout: list[int]) -> list[str]:
    """Host names of ranks ``0..n-1`` for ``layout`` = ranks on each host, in blocks."""
    return [f"host{h}" for h, k in enumerate(layout) for _ in range(k)]


def run_hosts(layout: list[int] | list[str], job_id: str, fn: Any, *, scheme: str,
              local_kind: str) -> list[Any]:
    """``fn(local, cross, rank)`` on every rank of fake hosts with ``layout`` ranks each (or
    with the given host name per rank)."""
    hostnames = [str(h) for h in layout] if isinstance(layout[0], str) else _hostnames(
        [int(k) for k in layout])

    def body(transport: Any) -> Any:
        comm, rank = transport.comm(), transport.rank
        where = host_layout(hostnames, rank)
        assert where.scheme == scheme or (where.scheme == "local" and len(set(hostnames)) == 1)
        sub = SubComm(comm, where.local)
        cross = SubComm(comm, where.cross) if where.cross is not None else None
        local: Any = sub
        if local_kind == "shm":
            local = ShmGroup(ShmFabric.create(sub, job_id, timeout=10.0))
        try:
            return fn(local, cross, rank)
        finally:
            if local_kind == "shm":
                local.close()

    return run_world(len(hostnames), body, join_timeout=60.0)


def test_host_layout() -> None:
    abba, aaab = [[0, 3], [1, 2]], [[0, 1, 2], [3]]
    assert host_layout(["a", "a"], 1) == HostLayout("local", [0, 1], None, [[0, 1]])
    assert host_layout(["a", "b", "b", "a"], 3) == HostLayout("shard", [0, 3], [3, 2], abba)
    assert host_layout(["a", "b", "b", "a"], 1) == HostLayout("shard", [1, 2], [0, 1], abba)
    assert host_layout(["a", "b", "b", "a"], 2) == HostLayout("shard", [1, 2], [3, 2], abba)
    assert host_layout(["a", "a", "a", "b"], 0) == HostLayout("leader", [0, 1, 2], [0, 3], aaab)
    assert host_layout(["a", "a", "a", "b"], 1) == HostLayout("leader", [0, 1, 2], None, aaab)
    assert host_layout(["a", "a", "a", "b"], 3) == HostLayout("leader", [3], [0, 3], aaab)


@pytest.mark.parametrize(("scheme", "layout"), [
    ("shard", [2, 2]), ("shard", [3, 3]), ("shard", [1, 1, 1]), ("shard", [2, 2, 2]),
    ("shard", [4]), ("shard", ["a", "b", "b", "a", "c", "c"]), ("leader", [3, 1]),
    ("leader", [1, 2, 3]), ("leader", ["a", "b", "a"])])
@pytest.mark.parametrize("local_kind", ["shm", "ring"])
def test_hierarchical_matches_numpy(job_id: str, scheme: str, layout: list[Any],
                                    local_kind: str) -> None:
    n = len(layout) if isinstance(layout[0], str) else sum(layout)
    cases = [(d, op, c) for d in DTYPES for op in OPS for c in (0, 1, 5, 2 * n + 1, 1037)]
    inputs = {case: make_inputs(*case[:2], n, case[2], seed=i) for i, case in enumerate(cases)}
    fn = hierarchical_allreduce if scheme == "shard" else leader_allreduce

    def body(local: Any, cross: Any, rank: int) -> dict[Any, np.ndarray]:
        out = {}
        for case in cases:
            buf = inputs[case][rank].copy()
            fn(local, cross, buf, case[1])
            out[case] = buf
        return out

    results = run_hosts(layout, job_id, body, scheme=scheme, local_kind=local_kind)
    for case in cases:
        expected = reference(inputs[case], case[1])
        for rank in range(n):
            assert same_bytes(results[rank][case], expected), (scheme, layout, rank, case)


@pytest.mark.parametrize("scheme", ["shard", "leader"])
def test_hierarchical_float_results_identical_on_every_rank(job_id: str, scheme: str) -> None:
    rng = np.random.default_rng(1)
    data = [(rng.normal(size=(4, 3001)) * 1000).astype(d) for d in ("float32", "bfloat16")]
    fn = hierarchical_allreduce if scheme == "shard" else leader_allreduce

    def body(local: Any, cross: Any, rank: int) -> list[np.ndarray]:
        out = []
        for arr in data:
            buf = arr[rank].copy()
            fn(local, cross, buf, ReduceOp.Sum)
            out.append(buf)
        return out

    layout = [2, 2] if scheme == "shard" else [3, 1]
    results = run_hosts(layout, job_id, body, scheme=scheme, local_kind="shm")
    for i in range(len(data)):
        assert all(same_bytes(results[r][i], results[0][i]) for r in range(4)), (scheme, i)


def test_leader_allreduce_rejects_cross_on_non_leaders(job_id: str) -> None:
    def body(local: Any, cross: Any, rank: int) -> None:
        if local.rank == 1:
            with pytest.raises(ValueError, match="leader"):
                leader_allreduce(local, SubComm(local, [0, 1]), np.ones(3), ReduceOp.Sum)

    run_hosts([2], job_id, body, scheme="leader", local_kind="ring")


# ---- allgather ---------------------------------------------------------------------------------

def _layout_hosts(layout: list[Any]) -> list[str]:
    return [str(h) for h in layout] if isinstance(layout[0], str) else _hostnames(layout)


def _gather_counts(n: int) -> list[list[int]]:
    """Per-rank counts worth testing on ``n`` ranks: uneven, zeros, all empty, one rank only."""
    return [[(7 * r + 3) % 11 for r in range(n)], [0] * n, [5] + [0] * (n - 1),
            [0] * (n - 1) + [1031], [r % 2 * 3 for r in range(n)], [257 + r for r in range(n)]]


@pytest.mark.parametrize("layout", [[2, 2], [3, 1], [1, 3], [1, 2, 3], [2, 2, 2], [1, 1, 1], [4],
                                    ["a", "b", "a"], ["a", "b", "b", "a", "c", "c"]])
@pytest.mark.parametrize("local_kind", ["shm", "ring"])
def test_leader_allgather_matches_concatenation(job_id: str, layout: list[Any],
                                                local_kind: str) -> None:
    hostnames = _layout_hosts(layout)
    n = len(hostnames)
    scheme = host_layout(hostnames, 0).scheme
    cases = [(d, tuple(c)) for d in DTYPES for c in _gather_counts(n)]
    rng = np.random.default_rng(7)
    inputs = {case: [(rng.integers(-100, 100, c) * 0.5).astype(case[0]) for c in case[1]]
              for case in cases}

    def body(local: Any, cross: Any, rank: int) -> dict[Any, np.ndarray]:
        hosts = host_layout(hostnames, rank).hosts
        leaders = cross if local.rank == 0 else None
        out = {}
        for case in cases:
            result = np.full(sum(case[1]), 99, dtype=case[0])
            leader_allgather(local, leaders, inputs[case][rank], case[1], result, hosts, rank)
            out[case] = result
        return out

    results = run_hosts(hostnames, job_id, body, scheme=scheme, local_kind=local_kind)
    for case in cases:
        expected = np.concatenate(inputs[case[0], case[1]])
        for rank in range(n):
            assert same_bytes(results[rank][case], expected), (layout, rank, case)


def test_leader_allgather_sendbuf_may_alias_its_slot(job_id: str) -> None:
    counts = [3, 1, 4, 2]

    def body(local: Any, cross: Any, rank: int) -> np.ndarray:
        out = np.zeros(sum(counts), np.float32)
        lo = sum(counts[:rank])
        out[lo:lo + counts[rank]] = rank + 1
        hosts = host_layout(_hostnames([3, 1]), rank).hosts
        leader_allgather(local, cross if local.rank == 0 else None,
                         out[lo:lo + counts[rank]], counts, out, hosts, rank)
        return out

    expected = np.repeat(np.arange(1, 5, dtype=np.float32), counts)
    for got in run_hosts([3, 1], job_id, body, scheme="leader", local_kind="shm"):
        assert same_bytes(got, expected)


def test_leader_allgather_checks_its_arguments(job_id: str) -> None:
    def body(local: Any, cross: Any, rank: int) -> None:
        hosts = [[0, 1], [2, 3]]
        leaders = cross if local.rank == 0 else None
        one = np.ones(1, np.float32)
        with pytest.raises(ValueError, match="every rank of the set once"):
            leader_allgather(local, leaders, one, [1] * 4, np.ones(4, np.float32),
                             [[0, 1], [2, 2]], rank)
        with pytest.raises(ValueError, match="hosts say"):
            leader_allgather(local, leaders, one, [1] * 4, np.ones(4, np.float32),
                             [[1, 0], [3, 2]], rank)
        with pytest.raises(ValueError, match="counts\\[.\\] = 2"):
            leader_allgather(local, leaders, one, [2] * 4, np.ones(8, np.float32), hosts, rank)
        with pytest.raises(TypeError, match="dtype"):
            leader_allgather(local, leaders, one, [1] * 4, np.ones(4), hosts, rank)
        if local.rank == 1:
            with pytest.raises(ValueError, match="leader"):
                leader_allgather(local, SubComm(local, [0, 1]), one, [1] * 4,
                                 np.ones(4, np.float32), hosts, rank)

    run_hosts([2, 2], job_id, body, scheme="shard", local_kind="ring")
