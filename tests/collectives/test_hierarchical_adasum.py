"""Hierarchical Adasum (hora.collectives.hierarchical_adasum) on fake hosts of one loopback
world, against a numpy reference written from the formula: each host's mean vector (float64),
then the recursive pairwise Adasum over the hosts in host order.

Layouts: every host with the same number of ranks (shard scheme: shards reduced in parallel,
their dot products summed over the host) and uneven hosts (leader scheme); local phases over
shared memory and over the ring; 2 and 4 hosts; a host count that is not a power of two refused
on every rank before anything is sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hora.collectives.adasum import check_set, hierarchical_hosts
from hora.collectives.hierarchical import host_layout
from hora.collectives.hierarchical_adasum import leader_adasum, shard_adasum
from hora.collectives.ops import to_dtype

from .helpers import FLOAT_DTYPES
from .test_adasum import reference
from .test_hierarchical import _hostnames, job_id, run_hosts

__all__ = ["job_id"]  # the fixture, imported for the tests below

TOL = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 1e-6, "float64": 1e-12}


def _hosts(hostnames: list[str]) -> list[list[int]]:
    return host_layout(hostnames, 0).hosts


def _expected(inputs: list[np.ndarray], hosts: list[list[int]]) -> np.ndarray:
    means = [np.mean([inputs[r].astype(np.float64) for r in ranks], axis=0) for ranks in hosts]
    return reference(means)


def _inputs(n: int, dtype: str, count: int, seed: int) -> list[np.ndarray]:
    """Vectors whose halves point in different directions, so that per-shard coefficients
    (a shard's dot products instead of the whole vector's) would give a different answer."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(n):
        v = rng.standard_normal(count)
        v[: count // 2] += 3.0  # a component every rank shares: the halves do not agree alike
        v[count // 2:] *= 1 + r
        out.append(v.astype(to_dtype(dtype)))
    return out


@pytest.mark.parametrize(("layout", "scheme"), [
    ([2, 2], "shard"), ([3, 3], "shard"), ([2, 2, 2, 2], "shard"), ([1, 1], "shard"),
    (["a", "b", "a", "b"], "shard"), ([3, 1], "leader"), ([1, 2], "leader"),
    ([2, 1, 1, 1], "leader")])
@pytest.mark.parametrize("local_kind", ["shm", "ring"])
def test_hierarchical_adasum_matches_the_reference(job_id: str, layout: list[Any], scheme: str,
                                                   local_kind: str) -> None:
    hostnames = [str(h) for h in layout] if isinstance(layout[0], str) else _hostnames(layout)
    n, hosts = len(hostnames), _hosts(hostnames)
    cases = [(d, c) for d in FLOAT_DTYPES for c in (1, 2, 3, 37, 1001)]
    inputs = {case: _inputs(n, case[0], case[1], seed=i) for i, case in enumerate(cases)}
    fn = shard_adasum if scheme == "shard" else leader_adasum

    def body(local: Any, cross: Any, rank: int) -> dict[Any, np.ndarray]:
        out = {}
        for case in cases:
            buf = inputs[case][rank].copy()
            fn(local, cross, buf, hosts=len(hosts))
            out[case] = buf
        empty = np.empty(0, np.float32)
        fn(local, cross, empty, hosts=len(hosts))
        return out

    results = run_hosts(hostnames, job_id, body, scheme=scheme, local_kind=local_kind)
    for case in cases:
        want = _expected(inputs[case], hosts)
        for rank in range(n):
            got = results[rank][case]
            assert got.dtype == to_dtype(case[0])
            tol = TOL[case[0]]
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol,
                                       err_msg=f"{layout} rank {rank} {case}")
            assert got.tobytes() == results[0][case].tobytes(), (layout, rank, case)


def test_whole_vector_coefficients_not_per_shard(job_id: str) -> None:
    """2 hosts x 2 ranks, so each rank reduces half of the vector across hosts: the result must
    use the dot products of the whole host vectors."""
    a = np.array([1.0, 0.0, 0.0, 0.0])  # host 0's mean
    b = np.array([1.0, 0.0, 0.0, 1.0])  # host 1's mean
    inputs = [a, a, b, b]

    def body(local: Any, cross: Any, rank: int) -> np.ndarray:
        buf = inputs[rank].copy()
        shard_adasum(local, cross, buf, hosts=2)
        return buf

    want = reference([a, b])  # a.b = 1, |a|^2 = 1, |b|^2 = 2: 0.5 a + 0.75 b
    assert np.allclose(want, [1.25, 0.0, 0.0, 0.75])
    for got in run_hosts([2, 2], job_id, body, scheme="shard", local_kind="shm"):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)


@pytest.mark.parametrize(("layout", "scheme"), [([2, 1, 1], "leader"), ([1, 1, 1], "shard"),
                                                ([2, 2, 2], "shard")])
def test_a_host_count_that_is_not_a_power_of_two_is_refused_on_every_rank(
        job_id: str, layout: list[int], scheme: str) -> None:
    fn = shard_adasum if scheme == "shard" else leader_adasum

    def body(local: Any, cross: Any, rank: int) -> str:
        with pytest.raises(NotImplementedError, match="non-power of 2 nodes") as info:
            fn(local, cross, np.ones(5), hosts=len(layout))
        return str(info.value)

    for message in run_hosts(layout, job_id, body, scheme=scheme, local_kind="ring"):
        assert "spans 3 hosts" in message and "HOROVOD_HIERARCHICAL_ALLREDUCE=0" in message


def test_integers_are_refused(job_id: str) -> None:
    def body(local: Any, cross: Any, rank: int) -> None:
        with pytest.raises(TypeError, match="floating-point"):
            shard_adasum(local, cross, np.ones(3, np.int32), hosts=2)

    run_hosts([1, 1], job_id, body, scheme="shard", local_kind="ring")


def test_which_sets_run_hierarchically() -> None:
    four = ["a", "a", "b", "b"]
    assert hierarchical_hosts(four, None) == 2  # automatic: several ranks on a host
    assert hierarchical_hosts(four, False) is None  # HOROVOD_HIERARCHICAL_ALLREDUCE=0: flat
    assert hierarchical_hosts(four, True) == 2
    assert hierarchical_hosts(["a", "b"], None) is None  # one rank per host: flat
    assert hierarchical_hosts(["a", "b"], True) == 2
    assert hierarchical_hosts(["a"] * 4, True) is None  # one host: flat (shared memory)
    check_set(["a", "a", "a", "b", "b", "b"], None)  # 6 ranks on 2 hosts: fine
    check_set(["a", "a", "b"], None)  # 3 ranks on 2 hosts (leader scheme): fine
    with pytest.raises(NotImplementedError, match="non-power of 2 ranks .* has 6 ranks"):
        check_set(["a", "a", "a", "b", "b", "b"], False)
    with pytest.raises(NotImplementedError, match="non-power of 2 nodes.* spans 3 hosts"):
        check_set(["a", "a", "b", "c"], None)
    with pytest.raises(NotImplementedError, match="non-power of 2 ranks .* has 3 ranks"):
        check_set(["a", "b", "c"], None)


@pytest.mark.parametrize(("layout", "scheme"), [([2, 2], "shard"), ([3, 3], "shard"),
                                                ([3, 1], "leader")])
def test_fused_tensors_across_hosts(job_id: str, layout: list[int], scheme: str) -> None:
    """A fused buffer whose tensors straddle the host shards: each tensor is combined with its
    own whole-tensor coefficients, as when it is reduced alone."""
    hostnames = _hostnames(layout)
    n, hosts = len(hostnames), _hosts(hostnames)
    counts = [7, 0, 1, 30, 4]
    inputs = [[_inputs(n, "float64", c, seed=10 + t)[r] if c else np.empty(0)
               for t, c in enumerate(counts)] for r in range(n)]
    fn = shard_adasum if scheme == "shard" else leader_adasum

    def body(local: Any, cross: Any, rank: int) -> np.ndarray:
        buf = np.concatenate(inputs[rank])
        fn(local, cross, buf, hosts=len(hosts), counts=counts)
        return buf

    results = run_hosts(hostnames, job_id, body, scheme=scheme, local_kind="shm")
    want = np.concatenate([_expected([inputs[r][t] for r in range(n)], hosts) if c else
                           np.empty(0) for t, c in enumerate(counts)])
    for rank, got in enumerate(results):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"rank {rank}")
