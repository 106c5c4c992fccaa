"""Rank side of tests/integration/test_data_planes.py: ``python plane_worker.py SCENARIO``.

* ``train``: a real torch training run (hora.torch's DistributedOptimizer, an MLP on
  scikit-learn's digits, each rank its own shard) on the job's data plane; each rank prints its
  data path, first and last loss and a checksum of its replica.
* ``dead``: 3+ ranks allreduce 4 MiB gradients in a loop; rank 1 SIGKILLs itself while one is in
  flight. Each survivor prints the error it got and how long after the kill it came. Survivors
  ignore SIGTERM: the launcher stops them at once after the first failure, and the test wants
  to read what hora tells each of them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np


def train() -> None:
    import torch
    from sklearn.datasets import load_digits

    import hora.torch as hvd
    from hora.core.engine import context

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    data = load_digits()
    x = torch.tensor(data.data[rank::size] / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target[rank::size])
    torch.manual_seed(rank)  # different initial weights: broadcast_parameters must unify them
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    losses = []
    for step in range(30):
        batch = slice((step * 32) % len(x), (step * 32) % len(x) + 32)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        opt.step()
        losses.append(float(hvd.allreduce(loss.detach(), name="loss")))
        if step == 0:  # (read while the job runs: rank 0 may shut down before the others)
            path = context.get().engine.data_path(0)
    with torch.no_grad():
        checksum = float(sum(p.double().sum() for p in model.parameters()))
    print(f"TRAIN rank {rank} path {path} gloo_enabled {hvd.gloo_enabled()} mpi_enabled "
          f"{hvd.mpi_enabled()} loss {losses[0]:.4f} -> {losses[-1]:.4f} "
          f"checksum {checksum!r}", flush=True)
    hvd.shutdown()


def dead() -> None:
    import hora

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    hora.init()
    rank = hora.rank()
    grads = np.ones(1 << 20, np.float32)
    hora.allreduce(grads, op=hora.Sum, name="warm")
    killed = hora.broadcast_object(time.time() + 0.5, 0, name="when")
    if rank == 1:
        threading.Timer(max(0.0, killed - time.time()),
                        lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    try:
        while True:
            hora.allreduce(grads, op=hora.Sum, name="grads")
    except hora.HorovodInternalError as exc:
        print(f"ERR rank {rank} {type(exc).__name__} after {time.time() - killed:.2f}s: {exc}",
              flush=True)
        sys.exit(3)


def raises() -> None:
    """Rank 1 raises an error of its own; rank 0's next op fails because of it (uncaught)."""
    import hora

    hora.init()
    hora.allreduce(np.ones(4), name="warm")
    if hora.rank() == 1:
        raise ValueError("bad input shape 42")
    hora.allreduce(np.ones(4), name="never")


if __name__ == "__main__":
    {"train": train, "dead": dead, "raises": raises}[sys.argv[1]]()
