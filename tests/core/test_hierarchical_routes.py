"""Which data path a process set's allgather takes across hosts, through the whole engine.

Engines on threads over the loopback transport, each told a (fake) host name: ranks with the
same name share a host (shared memory between them is real), ranks with different names talk
only over the transport. ``leader_allgather`` is wrapped to count the calls that reach it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hora.core.data.routing as routing
from hora.collectives.ops import check_dtype
from hora.config import Config
from hora.core.data.executor import Entry
from hora.core.engine.engine import Engine
from hora.core.op.handle import Handle
from hora.core.op.messages import OpKind, Request
from hora.core.op.process_set import Registry
from hora.transports.loopback import make_world
from hora.transports.shm import job_segments

_ids = itertools.count()


class HostWorld:
    """``len(hostnames)`` engines; rank ``i`` believes it runs on ``hostnames[i]``."""

    def __init__(self, hostnames: list[str], sets: list[list[int]], **cfg: Any) -> None:
        self.job_id = f"thr{os.getpid()}n{next(_ids)}"
        n = len(hostnames)
        config = Config().replace(**cfg)
        registries = [Registry(n) for _ in range(n)]
        self.set_ids = [[reg.register(ranks) for ranks in sets] for reg in registries][0]
        self.engines = [Engine(t, config, reg, hostnames=hostnames, job_id=self.job_id)
                        for t, reg in zip(make_world(n, timeout=10.0), registries)]
        for engine in self.engines:
            engine.start()

    def allgather(self, ranks: list[int], name: str, tensors: dict[int, np.ndarray],
                  set_id: int = 0) -> dict[int, np.ndarray]:
        handles = {}
        for r in ranks:
            x = np.ascontiguousarray(tensors[r])
            req = Request(name=name, kind=OpKind.ALLGATHER, rank=r, set_id=set_id,
                          dtype=check_dtype(x.dtype), shape=list(x.shape))
            handles[r] = Handle(name)
            self.engines[r].submit(Entry(request=req, tensor=x, output=None, handle=handles[r]))
        return {r: h.wait(20) for r, h in handles.items()}

    def close(self) -> None:
        for engine in self.engines:
            engine.stop(timeout=5.0)
        left = job_segments(self.job_id)
        assert left == [], f"segments left behind: {left}"


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Ranks (of their set) that entered ``leader_allgather``, one entry per call."""
    seen: list[int] = []
    real = routing.leader_allgather

    def spy(*args: Any) -> None:
        seen.append(args[-1])
        real(*args)

    monkeypatch.setattr(routing, "leader_allgather", spy)
    return seen


@pytest.fixture
def worlds() -> Iterator[Any]:
    made: list[HostWorld] = []

    def make(hostnames: list[str], sets: list[list[int]] | None = None,
             **cfg: Any) -> HostWorld:
        w = HostWorld(hostnames, sets or [], **cfg)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def _inputs(ranks: list[int], dtype: str, rows: list[int]) -> dict[int, np.ndarray]:
    return {r: (np.arange(rows[i] * 3).reshape(rows[i], 3) % 7 + 10 * r).astype(dtype)
            for i, r in enumerate(ranks)}


@pytest.mark.parametrize("hostnames", [["a", "a", "b", "b"], ["a", "a", "a", "b"],
                                       ["a", "b", "a", "b"]])
def test_allgather_across_hosts_is_hierarchical_when_asked(worlds: Any, calls: list[int],
                                                           hostnames: list[str]) -> None:
    w = worlds(hostnames, hierarchical_allgather=True)
    ranks = [0, 1, 2, 3]
    for dtype, rows in itertools.product(("float32", "int64", "bfloat16", "bool"),
                                         ([3, 0, 5, 1], [0, 0, 0, 0], [2, 2, 2, 2])):
        x = _inputs(ranks, dtype, rows)
        got = w.allgather(ranks, f"ag.{dtype}.{rows}", x)
        want = np.concatenate([x[r] for r in ranks])
        for r in ranks:
            assert got[r].dtype == want.dtype and got[r].tobytes() == want.tobytes()
    assert sorted(calls) == sorted(ranks * 12)


@pytest.mark.parametrize(("hostnames", "cfg"), [
    (["a", "a", "b", "b"], {}),  # off by default, as in Horovod
    (["a", "b", "c"], {"hierarchical_allgather": True}),  # one rank per host: nothing to gain
    (["a", "a", "a"], {"hierarchical_allgather": True}),  # one host: shared memory
])
def test_allgather_stays_flat_otherwise(worlds: Any, calls: list[int], hostnames: list[str],
                                        cfg: dict[str, Any]) -> None:
    w = worlds(hostnames, **cfg)
    ranks = list(range(len(hostnames)))
    x = _inputs(ranks, "float64", [r + 1 for r in ranks])
    got = w.allgather(ranks, "ag", x)
    want = np.concatenate([x[r] for r in ranks])
    assert all(np.array_equal(got[r], want) for r in ranks)
    assert calls == []


def test_process_sets_and_allreduce_beside_it(worlds: Any, calls: list[int]) -> None:
    """3 + 1 ranks, hierarchical allgather with the hierarchical allreduce off: the set
    {1, 2, 3} (two ranks on host a) gathers hierarchically, {0, 3} (one per host) flat;
    allreduce keeps the flat ring."""
    w = worlds(["a", "a", "a", "b"], [[1, 2, 3], [0, 3]], hierarchical_allgather=True,
               hierarchical_allreduce=False)
    three, two = w.set_ids
    x = _inputs([1, 2, 3], "float16", [4, 0, 2])
    got = w.allgather([1, 2, 3], "ag3", x, set_id=three)
    want = np.concatenate([x[r] for r in (1, 2, 3)])
    assert all(got[r].tobytes() == want.tobytes() for r in (1, 2, 3))
    assert sorted(calls) == [0, 1, 2]  # set ranks of 1, 2, 3
    calls.clear()
    y = _inputs([0, 3], "int32", [1, 3])
    got = w.allgather([0, 3], "ag2", y, set_id=two)
    assert all(np.array_equal(got[r], np.concatenate([y[0], y[3]])) for r in (0, 3))
    assert calls == []
    assert {e.data_path(0) for e in w.engines} == {None}
    handles = []
    for r in range(4):
        req = Request(name="sum", kind=OpKind.ALLREDUCE, rank=r, dtype="float32", shape=[5])
        h = Handle("sum")
        x5 = np.full(5, r, np.float32)
        w.engines[r].submit(Entry(request=req, tensor=x5, output=np.empty_like(x5), handle=h))
        handles.append(h)
    assert all(np.array_equal(h.wait(20), np.full(5, 6, np.float32)) for h in handles)
    assert {e.data_path(0) for e in w.engines} == {"ring"}
