"""``ShmGroup.allreduce_parts``: several arrays reduced as one buffer where they live (no packing),
against the allreduce of their concatenation: the same bytes, on every rank."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hora.collectives.ops import ReduceOp, scale_inplace
from hora.collectives.shm import ShmGroup

from .helpers import make_inputs, same_bytes
from .test_shm import job_id, shm_world

__all__ = ["job_id"]  # (the fixture, used by name)

LAYOUTS = [[5], [0, 3, 0, 17, 1], [64, 64], [1, 2053, 7, 300]]


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("chunk", [64, 1000, None])
def test_parts_equal_the_concatenation_reduced(job_id: str, monkeypatch: Any, n: int,
                                               chunk: int | None) -> None:
    """In place and from separate inputs (left unchanged), with and without a postscale, many
    chunks (a chunk's slices spanning several arrays) or one."""
    if chunk is not None:
        monkeypatch.setattr("hora.collectives.shm.SHM_CHUNK_BYTES", chunk)
        monkeypatch.setattr("hora.collectives.shm.SHM_CHUNK_BYTES_OVERSUBSCRIBED", chunk)
        monkeypatch.setattr("hora.collectives.shm.SHM_ONE_CHUNK_BYTES", 0)
    cases = [(d, op, tuple(sizes), f, inplace)
             for d in ("float32", "float16", "int32", "bool")
             for op in (ReduceOp.Sum, ReduceOp.Max, ReduceOp.Product)
             for sizes in LAYOUTS for f in (1.0, 1 / 3) for inplace in (True, False)]
    inputs = {case: make_inputs(case[0], case[1], n, sum(case[2]), seed=i)
              for i, case in enumerate(cases)}

    def body(group: ShmGroup) -> dict[Any, tuple[list[np.ndarray], np.ndarray]]:
        out = {}
        for case in cases:
            _, op, sizes, f, inplace = case
            whole = inputs[case][group.rank]
            bounds = np.cumsum((0,) + sizes)
            xs = [whole[a:b].copy() for a, b in zip(bounds[:-1], bounds[1:])]
            if inplace:
                dsts, srcs = xs, None
            else:
                dsts, srcs = [np.full_like(x, 7) for x in xs], xs
            group.allreduce_parts(dsts, op, srcs=srcs, postscale=f)
            if not inplace:
                assert all(same_bytes(x, whole[a:b]) for x, a, b
                           in zip(xs, bounds[:-1], bounds[1:])), "an input was modified"
            ref = whole.copy()
            group.allreduce(ref, op)
            scale_inplace(ref, f)
            out[case] = (dsts, ref)
        return out

    for rank, results in enumerate(shm_world(n, job_id, body)):
        for case, (dsts, ref) in results.items():
            got = np.concatenate(dsts) if dsts else ref[:0]
            assert same_bytes(got, ref), (n, rank, case, got[:8], ref[:8])


def test_parts_errors(job_id: str) -> None:
    def body(group: ShmGroup) -> None:
        a, b = np.zeros(8, np.float32), np.zeros(4, np.float32)
        with pytest.raises(TypeError):
            group.allreduce_parts([a, np.zeros(4)], ReduceOp.Sum)
        with pytest.raises(ValueError, match="7 elements, its output 8"):
            group.allreduce_parts([a, b], ReduceOp.Sum, srcs=[np.zeros(7, np.float32), None])
        with pytest.raises(NotImplementedError):
            group.allreduce_parts([a, b], ReduceOp.Adasum)
        group.staging(16)
        with pytest.raises(ValueError, match="staging"):
            group.allreduce_parts([a, b], ReduceOp.Sum)
        group.allreduce_parts([a, b], ReduceOp.Sum)  # the group is still usable
        assert not a.any() and not b.any()

    shm_world(2, job_id, body)

