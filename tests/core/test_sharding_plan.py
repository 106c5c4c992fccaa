"""hora.core.frontend.sharding.split_plan (hora-only): shards planned over the parameters'
flattened bytes, a parameter split at element boundaries only where it does not fit."""

from __future__ import annotations

import random

import pytest

from hora.core.frontend import sharding


def test_one_dominant_tensor_is_split_evenly() -> None:
    # one tensor of 80% of the bytes: whole-tensor placement leaves its owner with 80%
    numels, items = [800, 50, 50, 50, 50], [4] * 5
    whole = sharding.plan([n * i for n, i in zip(numels, items)], 2)
    assert whole.imbalance() == pytest.approx(1.6)
    for size in (2, 4, 8):
        the_plan, pieces = sharding.split_plan(numels, items, size)
        assert the_plan.imbalance() <= 1.0 + 1e-9 + size * 4 / 4000
        big = [p for p in pieces if p.index == 0]
        assert [p.start for p in big] == sorted(p.start for p in big)
        assert sum(p.numel for p in big) == 800 and len(big) > 1


def test_pieces_cover_each_parameter_once_in_order() -> None:
    rng = random.Random(0)
    for _ in range(500):
        numels = [rng.randint(0, 1000) for _ in range(rng.randint(1, 12))]
        items = [rng.choice([1, 2, 4, 8]) for _ in numels]
        size = rng.randint(1, 8)
        splittable = None if rng.random() < 0.5 else [rng.random() < 0.7 for _ in numels]
        the_plan, pieces = sharding.split_plan(numels, items, size, splittable)
        assert len(the_plan.owner) == len(pieces)
        for i, n in enumerate(numels):
            mine = [(p, the_plan.owner[j]) for j, p in enumerate(pieces) if p.index == i]
            assert mine[0][0].start == 0 and sum(p.numel for p, _ in mine) == n
            assert all(a.start + a.numel == b.start for (a, _), (b, _) in zip(mine, mine[1:]))
            assert len({s for _, s in mine}) == len(mine)  # each piece on its own shard
            if splittable is not None and not splittable[i]:
                assert len(mine) == 1
        if splittable is None:
            total = sum(n * i for n, i in zip(numels, items))
            assert max(the_plan.loads()) <= -(-total // size) + size * max(items)


def test_whole_when_it_fits_and_errors() -> None:
    the_plan, pieces = sharding.split_plan([10, 10, 10, 10], [4] * 4, 2)
    assert all(p.start == 0 and p.numel == 10 for p in pieces) and the_plan.loads() == [80, 80]
    with pytest.raises(ValueError):
        sharding.split_plan([1], [4], 0)
    with pytest.raises(ValueError):
        sharding.split_plan([1, 2], [4], 2)


def test_chunk_bounds_every_piece() -> None:
    the_plan, pieces = sharding.split_plan([100, 10], [4, 4], 2)
    plan2, chunks = sharding.chunk(the_plan, pieces, [4, 4], 64)
    assert max(plan2.nbytes) <= 64 and plan2.loads() == the_plan.loads()
    for i, n in enumerate((100, 10)):
        mine = [p for p in chunks if p.index == i]
        assert sum(p.numel for p in mine) == n
        assert all(a.start + a.numel == b.start for a, b in zip(mine, mine[1:]))
