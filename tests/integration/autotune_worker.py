"""One rank of a small training job under autotune (tests/integration/test_autotune.py).

    autotune_worker.py MAX_STEPS [--allgather]

Trains a linear model of four weight tensors (one of 4.3 MB, above the fast lane's limit, so
it is negotiated with rank 0 and fused or held there; the others take the fast lane) with plain
SGD on averaged gradients, each rank its own fixed noise. Every 10 steps the ranks agree
(an allreduce of ``Tuning.active``, Max) whether some rank still tunes, and stop when none does
or after MAX_STEPS. ``--allgather`` adds an allgather per step (hierarchical allgather matters).
Prints one JSON line: steps, whether tuning is over, every setting this rank applied, a digest
of the weights.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

import hora as hvd
from hora.core.engine import context

SHAPES = [(256, 256), (64,), (1024, 1100), (16, 16)]


def main() -> None:
    max_steps = int(sys.argv[1])
    gather = "--allgather" in sys.argv[2:]
    hvd.init()
    rank = hvd.rank()
    rng = np.random.default_rng(100 + rank)
    weights = [np.full(shape, 0.01, np.float32) for shape in SHAPES]
    noise = [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]
    tuning = context.get().engine.tuning
    steps = 0
    while steps < max_steps:
        for _ in range(10):
            handles = [hvd.allreduce_async(w * 0.5 + n, name=f"grad{i}", op=hvd.Average)
                       for i, (w, n) in enumerate(zip(weights, noise))]
            if gather:
                hvd.allgather(np.full((rank + 1, 3), steps, np.int64), name="rows")
            for w, h in zip(weights, handles):
                w -= 0.01 * hvd.synchronize(h)
            steps += 1
        still = hvd.allreduce(np.array([float(tuning.active)]), name="still_tuning", op=hvd.Max)
        if still[0] == 0:
            break
    digest = hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest()
    print(json.dumps({"rank": rank, "steps": steps, "active": tuning.active,
                      "applied": [p.to_wire() for p in tuning.applied], "digest": digest}),
          flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
