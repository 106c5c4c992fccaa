"""An in-process world of engines over the loopback transport (threads, no sockets)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hora.collectives.ops import ReduceOp, check_dtype
from hora.config import Config
from hora.core.data.executor import Entry
from hora.core.engine.engine import Engine
from hora.core.op.handle import Handle
from hora.core.op.messages import OpKind, Request
from hora.core.op.process_set import Registry


class World:
    def __init__(self, n: int, **cfg: Any) -> None:
        from hora.transports.loopback import make_world

        config = Config().replace(**cfg)
        self.transports = make_world(n, timeout=5.0)
        self.engines = [Engine(t, config, Registry(n)) for t in self.transports]
        for e in self.engines:
            e.start()

    def submit(self, rank: int, name: str, tensor: Any, kind: OpKind = OpKind.ALLREDUCE,
               inplace: bool = False, **kw: Any) -> Handle:
        x = np.ascontiguousarray(tensor)
        req = Request(name=name, kind=kind, rank=rank, dtype=check_dtype(x.dtype),
                      shape=list(x.shape), **kw)
        out = None
        if kind is OpKind.ALLREDUCE:
            out = x if inplace else np.empty_like(x)
        elif kind is OpKind.BROADCAST:
            out = x
        handle = Handle(name)
        self.engines[rank].submit(Entry(request=req, tensor=x, output=out, handle=handle))
        return handle

    def close(self) -> None:
        for e in self.engines:
            e.stop(timeout=5.0)


@pytest.fixture
def world() -> Iterator[Any]:
    made: list[World] = []

    def make(n: int, **cfg: Any) -> World:
        w = World(n, **cfg)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


SUM = int(ReduceOp.Sum)
