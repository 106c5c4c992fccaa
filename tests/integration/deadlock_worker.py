"""Rank program for tests/integration/test_deadlock.py: certain deadlocks, one after another in
one 3-rank job (a deadlock fails its ops and the job goes on), then one left uncaught.

Each case prints ``CASE <id> <seconds> <outcome>`` per rank, where outcome is ``ok`` or the
exception's type and message. After each deadlock, an unnamed allreduce on every rank shows
that automatic names still match (``AFTER <id> ok``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np

import hora
from hora import ProcessSet

PAIR = ProcessSet([1, 2])


def report(case: str, fn: Callable[[], object]) -> None:
    start = time.monotonic()
    try:
        fn()
        outcome = "ok"
    except hora.HorovodInternalError as exc:
        outcome = f"{type(exc).__name__} {exc}"
    print(f"CASE {case} {time.monotonic() - start:.2f} {outcome}", flush=True)
    total = hora.allreduce(np.ones(2, np.float32), op=hora.Sum)
    print(f"AFTER {case} {'ok' if total[0] == hora.size() else total}", flush=True)


def main() -> None:
    hora.init(process_sets=[PAIR])
    r = hora.rank()
    x = np.ones(4, np.float32)
    # every rank waits for a name the others never submit
    report("names", lambda: hora.allreduce(x, name=f"grad.{r}"))
    # one rank left a loop early (its reducescatter), the others went on to a barrier
    report("reducescatter_vs_barrier",
           lambda: hora.reducescatter(x) if r == 0 else hora.barrier())
    # an allreduce that ran before goes through the fast lane: the lane hands it over first
    for _ in range(3):
        hora.allreduce(x, name="cached")
    report("lane_vs_barrier", lambda: hora.allreduce(x, name="cached") if r == 0
           else hora.barrier())
    # rank 0 joined; ranks 1 and 2 wait for each other in different ops on their own set
    report("join_vs_allgather_object",
           lambda: hora.join() if r == 0 else
           hora.allgather_object(r, process_set=PAIR) if r == 1 else hora.barrier(PAIR))
    # a subset never submits: rank 2 waits on a set whose other member waits elsewhere
    report("subset_never_submits",
           lambda: hora.allreduce(x, name="step") if r < 2 else
           hora.broadcast(x, root_rank=1, process_set=PAIR))
    # a wait on a grouped op is a wait on its members; all of them fail
    report("grouped_vs_allreduce",
           lambda: hora.grouped_allreduce([x, x, x]) if r == 0 else hora.allreduce(x, name="solo"))
    # Not a deadlock: rank 0 computes (not blocked in hora) longer than the deadlock time.
    report("slow_rank", lambda: (time.sleep(0.5) if r == 0 else None, hora.allreduce(x)))
    # The error the user does not catch ends the job with a non-zero exit status.
    print("UNCAUGHT", flush=True)
    if r == 0:
        hora.allreduce(x, name="last")
    else:
        hora.barrier()
    print("NOT REACHED", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
