"""A rank of ``test_hierarchical_allgather.py``: allgathers with uneven first dimensions, every
dtype, on the global set and on one process set, each checked against numpy on this rank.

    python hier_allgather_worker.py DIR SUBSET     SUBSET: the process set's ranks, "1,2,3"

The results' bytes go to ``DIR/rank<r>.npz`` (the test compares them between a hierarchical and
a flat job); the rank prints ``OK <rank>`` at the end.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

import hora
from hora.collectives.ops import SUPPORTED_DTYPES

ROWS: dict[str, Callable[[int, int], int]] = {
    "growing": lambda rank, size: rank + 1,
    "odd_empty": lambda rank, size: 0 if rank % 2 else 3,
    "all_empty": lambda rank, size: 0,
    "last_only": lambda rank, size: 5 if rank == size - 1 else 0,
    "first_host_empty": lambda rank, size: 0 if rank < 2 else 2 * rank,
    "large": lambda rank, size: 40000 + 517 * rank,  # ~1 MB of float32 per rank
}


def data(rank: int, case: str, dtype: str, rows: int) -> np.ndarray:
    width = 8 if case == "large" else 3
    values = (np.arange(rows * width).reshape(rows, width) * 7 + 1000 * rank) % 251
    if dtype == "bool":
        return (values % 2).astype(bool)
    return values.astype(SUPPORTED_DTYPES[dtype])


def main() -> None:
    directory, subset = Path(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")]
    ps = hora.ProcessSet(subset)
    hora.init(process_sets=[ps])
    rank, size = hora.rank(), hora.size()
    saved: dict[str, np.ndarray] = {}
    for case, rows in ROWS.items():
        dtypes = ["float32"] if case == "large" else list(SUPPORTED_DTYPES)
        for dtype in dtypes:
            name = f"{case}.{dtype}"
            got = hora.allgather(data(rank, case, dtype, rows(rank, size)), name=name)
            want = np.concatenate([data(q, case, dtype, rows(q, size)) for q in range(size)])
            assert got.dtype == want.dtype and got.shape == want.shape, (name, got.shape)
            assert got.tobytes() == want.tobytes(), name
            saved[name] = np.frombuffer(got.tobytes(), np.uint8)
            if rank in subset:
                members = len(subset)
                mine = data(rank, case, dtype, rows(subset.index(rank), members))
                got = hora.allgather(mine, name=f"set.{name}", process_set=ps)
                want = np.concatenate([data(q, case, dtype, rows(i, members))
                                       for i, q in enumerate(subset)])
                assert got.tobytes() == want.tobytes(), f"set.{name}"
                saved[f"set.{name}"] = np.frombuffer(got.tobytes(), np.uint8)
    hora.barrier()  # rank 0 may not be in the set: its shutdown would end the job
    np.savez(directory / f"rank{rank}.npz", **saved)
    print(f"OK {rank}", flush=True)
    hora.shutdown()


if __name__ == "__main__":
    main()
