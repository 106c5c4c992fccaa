"""Functions the ElasticRayExecutor tests run on the workers (sent by value: the workers cannot
import this directory). Heavy imports happen inside them, on the workers.

Each worker sends ``{"event": "started", "wid", "pid", "node"}`` to the driver's callbacks when it
starts, and rank 0 sends ``{"step", "size"}`` at every commit: the tests follow the job (and
decide when to kill a worker or change the cluster) through these values. Training stops when
the file ``stop_file`` exists: rank 0 looks at each commit and broadcasts what it saw, so every
rank stops at the same step.
"""

from __future__ import annotations

import os
import time
from typing import Any


def started(wid: int) -> None:
    """Tell the driver's callbacks that worker ``wid`` started: its pid and Ray node."""
    import ray

    from hora.ray import ray_logger

    ray_logger.log({"event": "started", "wid": wid, "pid": os.getpid(),
                    "node": ray.get_runtime_context().get_node_id()}, chief_only=False)


def torch_train_until_stopped(stop_file: str, step_delay: float = 0.05,
                              max_steps: int = 3000) -> dict[str, Any]:
    """A small regression trained with hora.torch's elastic API (TorchState, DistributedOptimizer,
    commits every 5 steps, as examples/torch_elastic.py); every rank draws its own batches.
    Returns the rank, size, worker id, step and the model's parameters."""
    import torch
    import torch.nn.functional as F

    import hora.torch as hvd
    from hora.ray import ray_logger

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    hvd.init()
    wid = int(os.environ["HORA_ELASTIC_WORKER_ID"])
    started(wid)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0, stop=False)
    truth = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

    @hvd.elastic.run
    def train(state: Any) -> None:
        while not state.stop and state.step < max_steps:
            gen = torch.Generator().manual_seed(state.step * 100 + hvd.rank())
            x = torch.randn(16, 4, generator=gen)
            optimizer.zero_grad()
            F.mse_loss(model(x), x @ truth).backward()
            optimizer.step()
            state.step += 1
            time.sleep(step_delay)
            if state.step % 5 == 0:
                state.stop = bool(hvd.broadcast_object(os.path.exists(stop_file), root_rank=0,
                                                       name=f"stop.{state.step}"))
                state.commit()
                ray_logger.log({"step": state.step, "size": hvd.size()})

    train(state)
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"rank": hvd.rank(), "size": hvd.size(), "wid": wid, "step": state.step,
            "params": params.tolist()}


def numpy_train_until_stopped(stop_file: str, step_delay: float = 0.05,
                              max_steps: int = 3000) -> dict[str, Any]:
    """The same loop without torch (faster to start): a counter averaged every step."""
    import numpy as np

    import hora
    from hora import elastic
    from hora.ray import ray_logger

    hora.init()
    wid = int(os.environ["HORA_ELASTIC_WORKER_ID"])
    started(wid)
    state = elastic.ObjectState(hora.broadcast_object, hora.rank, step=0, total=0.0,
                                stop=False)

    @elastic.run
    def train(state: Any) -> None:
        while not state.stop and state.step < max_steps:
            state.total += float(hora.allreduce(np.ones(1), op=hora.Sum, name="x")[0])
            state.step += 1
            time.sleep(step_delay)
            if state.step % 5 == 0:
                state.stop = bool(hora.broadcast_object(os.path.exists(stop_file), 0,
                                                        name=f"stop.{state.step}"))
                state.commit()
                ray_logger.log({"step": state.step, "size": hora.size()})

    train(state)
    return {"rank": hora.rank(), "size": hora.size(), "wid": wid, "step": state.step,
            "total": state.total}


def bad_hyperparameter() -> None:
    """Fails at once, on every worker."""
    raise ValueError("bad hyperparameter")
