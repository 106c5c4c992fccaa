"""Rank body for tests/collectives/test_shm.py: ShmGroup over hora's TCP comm in real processes.

Usage: ``hora run -np N python shm_worker.py SCENARIO``. The shared-memory path is not wired into
the engine yet, so this builds a ShmGroup directly over the transport's comm after hora.init().
Each rank prints ``JOB <job_id>`` and then ``OK <scenario>`` or the line the test asserts on.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from helpers import DTYPES, OPS, make_inputs, reference, same_bytes  # noqa: E402

import hora  # noqa: E402
import hora.collectives.shm as shm_collectives  # noqa: E402
from hora.collectives.ops import ReduceOp  # noqa: E402
from hora.collectives.shm import ShmGroup  # noqa: E402
from hora.core.engine import context  # noqa: E402
from hora.errors import PeerLostError  # noqa: E402
from hora.transports.shm import job_id_from_env
from hora.transports.shm_fabric import ShmFabric  # noqa: E402


def _group() -> ShmGroup:
    hora.init()
    job = job_id_from_env()
    print(f"JOB {job}", flush=True)
    comm = context.get().engine.transport.comm()
    return ShmGroup(ShmFabric.create(comm, job, timeout=30.0))


def conformance() -> None:
    group = _group()
    n, r = hora.size(), hora.rank()
    digest = hashlib.sha256()
    try:
        shm_collectives.SHM_CHUNK_BYTES = 4096  # several chunks for the larger sizes
        shm_collectives.SHM_CHUNK_BYTES_OVERSUBSCRIBED = 4096
        shm_collectives.SHM_ONE_CHUNK_BYTES = 0
        for i, (dtype, op, count) in enumerate(
                (d, op, c) for d in DTYPES for op in OPS for c in (0, 1, 7, 2053, 40_000)):
            inputs = make_inputs(dtype, op, n, count, seed=i)
            expected = reference(inputs, op)
            for algo in ("replicated", "chunked", "staged"):
                if algo == "staged":
                    buf = group.staging(inputs[r].nbytes).view(inputs[r].dtype)
                    buf[:] = inputs[r]
                    group.allreduce(buf, op)
                else:
                    buf = inputs[r].copy()
                    group.allreduce(buf, op, algorithm=algo)
                assert same_bytes(buf, expected), (dtype, op, count, algo)
        rng = np.random.default_rng(0)
        for dtype in ("float16", "bfloat16", "float32", "float64"):
            data = (rng.normal(size=(n, 30_001)) * 1000).astype(dtype)
            for algo in ("replicated", "chunked"):
                buf = data[r].copy()
                group.allreduce(buf, ReduceOp.Sum, algorithm=algo)
                digest.update(buf.tobytes())
        counts = [3 + 5 * j for j in range(n)]
        gathered = np.empty(sum(counts), np.int64)
        group.allgather(np.full(counts[r], r, np.int64), counts, gathered)
        assert gathered.tolist() == sum(([j] * c for j, c in enumerate(counts)), [])
        for root in range(n):
            buf = np.full(100_003, r, np.float32)
            group.broadcast(buf, root)
            assert (buf == root).all()
        out = np.empty(counts[r], np.float64)
        group.reducescatter(np.ones(sum(counts)), counts, ReduceOp.Sum, out)
        assert (out == n).all()
        send = np.arange(n, dtype=np.int32) + 10 * r
        recv = np.empty(n, np.int32)
        group.alltoall(send, [1] * n, recv, [1] * n)
        assert recv.tolist() == [10 * j + r for j in range(n)]
        group.barrier()
    finally:
        group.close()
    hashes = hora.allgather_object(digest.hexdigest(), name="digests")
    assert len(set(hashes)) == 1, hashes  # identical bytes on every rank
    hora.shutdown()
    print("OK conformance", flush=True)


def sigkill() -> None:
    group = _group()
    r = hora.rank()
    buf = np.ones(1 << 16, np.float32)
    group.allreduce(buf, ReduceOp.Sum)
    if r == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # outlive the launcher's stop to report
    start = time.monotonic()
    try:
        group.allreduce(buf, ReduceOp.Sum)
        print("NOT LOST", flush=True)
    except PeerLostError as exc:
        print(f"LOST {exc} after {time.monotonic() - start:.3f} s", flush=True)
    finally:
        group.close()
    os._exit(3)


def abandon() -> None:
    """Every rank dies by SIGKILL holding its segments (mapped, their names already gone)."""
    group = _group()
    group.allreduce(np.ones(1 << 20, np.float32), ReduceOp.Sum)  # grows the segments
    for path in group.fabric.paths:  # type: ignore[attr-defined]
        print(f"SEGMENT {path}", flush=True)
    group.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    {"conformance": conformance, "sigkill": sigkill, "abandon": abandon}[sys.argv[1]]()
