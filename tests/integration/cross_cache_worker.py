"""A rank for test_cross_cache_jobs.py: each rank has its own HORA_HOSTNAME (its own "host"),
so process set 0 spans hosts and named allreduces go through the cross-host response cache.

    python cross_cache_worker.py CASE      print "OK <rank> <json>" or "ERR <rank> <type>: <msg>"

Cases: bitwise (eager slots: every reduction op on 4 KiB, each result compared bit for bit with
the rank-order reduction), hits (a named allreduce repeated, then a second name and a changed
shape that is learned again), join (one rank joins while the others reduce a cached name),
mismatch (rank 1 changes the shape of a cached name), deadlock (ranks wait on different cached
names), death (the last rank exits during a cached cycle), stall (the last rank submits a cached
name 4 s late), stall_every_host (2 x 2: a rank on each host is late, the others' ops marked,
unwaited), marked_death RANK (RANK marks a cached name, then dies before the others mark it: a
host's rank, or its leader), early_exit RANK (RANK calls shutdown() after a few cached cycles
while the others go on). The test chooses the hosts (``HORA_HOSTNAME``): one rank per host, or 2
hosts x 2 ranks.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import hora
from hora.core.engine import context


def cross() -> object:
    return context.get().engine._cross  # the engine's CrossCache (None: not in use)


def main(case: str) -> None:  # noqa: C901
    hora.init()
    rank, size = hora.rank(), hora.size()
    info: dict[str, object] = {"cache": cross() is not None}
    try:
        if case == "hits":
            for step in range(30):
                out = hora.allreduce(np.full(4, rank + step, np.float32), op=hora.Sum,
                                     name="grad")
                assert np.all(out == sum(range(size)) + size * step), out
            c = cross()
            info["slots"] = len(c._table)  # type: ignore[attr-defined]
            hs = [hora.allreduce_async(np.full(3, float(i), np.float32), op=hora.Sum,
                                       name=f"g{i}") for i in range(5)]
            for _ in range(5):  # several cached names at once: decided (and fused) together
                outs = [hora.synchronize(h) for h in hs]
                assert all(np.all(o == size * i) for i, o in enumerate(outs)), outs
                hs = [hora.allreduce_async(np.full(3, float(i), np.float32), op=hora.Sum,
                                           name=f"g{i}") for i in range(5)]
            [hora.synchronize(h) for h in hs]
            out = hora.allreduce(np.ones(6, np.float32), op=hora.Sum, name="grad")  # new shape
            assert np.all(out == size)
            out = hora.allreduce(np.ones(6, np.float32), op=hora.Sum, name="grad")
            assert np.all(out == size)
            info["slots_after"] = len(c._table)  # type: ignore[attr-defined]
            info["hits"] = c.hits  # type: ignore[attr-defined]
            info["marks_from"] = sorted(c.marks_from)  # type: ignore[attr-defined]
            info["leaders"] = c.layout.leaders  # type: ignore[attr-defined]
            hora.barrier()  # (read before any rank leaves: a goodbye ends eager slots)
        elif case == "mismatch":
            for _ in range(3):
                hora.allreduce(np.ones(4, np.float32), name="x")
            n = 5 if rank == 1 else 4
            hora.allreduce(np.ones(n, np.float32), name="x")
        elif case == "deadlock":
            for _ in range(3):
                hora.allreduce(np.ones(4, np.float32), name="a")
                hora.allreduce(np.ones(4, np.float32), name="b")
            hora.allreduce(np.ones(4, np.float32), name="a" if rank == 0 else "b")
        elif case == "join":
            for _ in range(3):
                hora.allreduce(np.ones(4, np.float32), op=hora.Sum, name="j")
            if rank != size - 1:  # the last rank joins; the others go on with the cached name
                for _ in range(2):
                    out = hora.allreduce(np.ones(4, np.float32), op=hora.Sum, name="j")
                    assert np.all(out == size - 1), out  # the joined rank adds zeros
            info["last_joined"] = hora.join()
            out = hora.allreduce(np.ones(4, np.float32), op=hora.Sum, name="j")
            assert np.all(out == size), out  # after the join, the cache again
            info["hits"] = cross().hits  # type: ignore[attr-defined]
        elif case == "stall":
            for _ in range(3):
                hora.allreduce(np.ones(4, np.float32), name="s")
            t0 = time.monotonic()
            if rank == size - 1:
                time.sleep(4)  # busy elsewhere; meets the others at the barrier
            else:
                try:
                    hora.allreduce(np.ones(4, np.float32), name="s")
                except hora.HorovodInternalError as exc:
                    print(f"STALLED {rank} after {time.monotonic() - t0:.1f}s: {exc}",
                          flush=True)
            hora.barrier()
        elif case == "stall_every_host":
            for _ in range(3):
                hora.allreduce(np.ones(4, np.float32), name="s")
            if rank % 2 == 0:  # ranks 0 and 2 mark it and wait for nothing: no wait reports
                handle = hora.allreduce_async(np.ones(4, np.float32), name="s")
                time.sleep(3)
                hora.synchronize(handle)
            else:  # ranks 1 (host 0's leader) and 3 (host 1's other rank) come late
                time.sleep(3)
                hora.allreduce(np.ones(4, np.float32), name="s")
        elif case == "marked_death":
            victim = int(sys.argv[2])
            for _ in range(3):
                hora.allreduce(np.ones(4, np.float32), name="m")
            hora.barrier()
            if rank == victim:
                hora.allreduce_async(np.ones(4, np.float32), name="m")  # marked, not decided
                time.sleep(0.5)
                os._exit(3)
            time.sleep(1.5)  # the victim marks, then dies before the others mark
            t0 = time.monotonic()
            try:
                hora.allreduce(np.ones(4, np.float32), name="m")
            except Exception as exc:  # noqa: BLE001
                print(f"ERR {rank} after {time.monotonic() - t0:.1f}s {type(exc).__name__}: "
                      f"{exc}", flush=True)
                hora.shutdown()
                return
        elif case == "early_exit":
            victim = int(sys.argv[2])
            for _ in range(3):
                hora.allreduce(np.ones(4, np.float32), name="e")
            hora.barrier()
            if rank == victim:
                hora.shutdown()  # leaves cleanly while the others go on
                print(f"LEFT {rank} cleanly", flush=True)
                return
            time.sleep(0.5)
            try:
                hora.allreduce(np.ones(4, np.float32), name="e")
            except Exception as exc:  # noqa: BLE001
                print(f"ERR {rank} {type(exc).__name__}: {exc}", flush=True)
        elif case == "bitwise":  # eager slots: every op, results checked bit for bit
            import hashlib

            digest = hashlib.sha256()
            n = 1024  # 4 KiB of float32

            def data(r: int, step: int) -> np.ndarray:
                x = np.random.default_rng(1000 * r + step).standard_normal(n).astype(np.float32)
                x[:8] = [0.0, -0.0, 0.0, -0.0, np.inf, -np.inf, 1e-40, -1e-40]
                if r % 2:
                    x[:4] = -x[:4]  # 0.0 against -0.0 (min/max are not bitwise commutative)
                return x

            ops = [(hora.Sum, np.add), (hora.Average, np.add), (hora.Min, np.minimum),
                   (hora.Max, np.maximum), (hora.Product, np.multiply)]
            eager_on = cross().eager is not None  # type: ignore[attr-defined]
            for step in range(12):
                for op, fn in ops:
                    mine = data(rank, step)
                    if step % 2:
                        out = mine.copy()
                        hora.allreduce_(out, op=op, name=f"b{int(op)}")  # in place
                    else:
                        out = hora.allreduce(mine, op=op, name=f"b{int(op)}")
                    want = data(0, step)
                    for r in range(1, size):  # rank order, as the eager exchange reduces
                        want = fn(want, data(r, step))
                    if op == hora.Average:
                        want = want * np.float32(1.0 / size)
                    if step > 0 and eager_on:  # (the first of each name is negotiated)
                        assert out.tobytes() == want.tobytes(), (step, op)
                    digest.update(np.asarray(out).tobytes())
            c = cross()
            eager = c.eager  # type: ignore[attr-defined]
            info["eager"] = eager is not None
            info["digest"] = digest.hexdigest()
            info["hits"] = c.hits  # type: ignore[attr-defined]
            info["decisions"] = c.decisions  # type: ignore[attr-defined]
            info["rounds"] = sum(eager.rounds.committed.values()) if eager else 0
        elif case == "death":
            for _ in range(3):
                hora.allreduce(np.ones(4, np.float32), name="d")
            if rank == size - 1:
                time.sleep(0.3)
                os._exit(3)  # this "host" dies while the others wait in a cached cycle
            hora.allreduce(np.ones(4, np.float32), name="d")
        print(f"OK {rank} {json.dumps(info)}", flush=True)
    except Exception as exc:  # noqa: BLE001  (reported for the test to compare)
        print(f"ERR {rank} {type(exc).__name__}: {exc}", flush=True)
    hora.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
