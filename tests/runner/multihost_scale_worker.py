"""A rank for test_multihost_scale.py: how many connections it holds, before and after an
alltoall (which opens a connection to every other member on first use), and the results.

    python multihost_scale_worker.py counts    print one JSON line
"""

from __future__ import annotations

import json

import numpy as np

import hora
from hora.core.engine import context


def main() -> None:
    hora.init()
    rank, size = hora.rank(), hora.size()
    transport = context.get().engine.transport
    at_start = transport.connection_counts()  # type: ignore[attr-defined]
    total = hora.allreduce(np.full(8, rank + 1.0, np.float32), op=hora.Sum, name="sum")
    ring = transport.connection_counts()  # type: ignore[attr-defined]
    sent = np.repeat(np.arange(size, dtype=np.int64) + 100 * rank, 2)
    got = hora.alltoall(sent, name="a2a")
    after = transport.connection_counts()  # type: ignore[attr-defined]
    want = np.repeat(rank + 100 * np.arange(size, dtype=np.int64), 2)
    print(json.dumps({"rank": rank, "start": at_start, "ring": ring, "after": after,
                      "sum_ok": bool(np.all(total == size * (size + 1) / 2)),
                      "a2a_ok": bool(np.array_equal(got, want))}), flush=True)
    hora.shutdown()


if __name__ == "__main__":
    main()
