"""hora.torch: Horovod's PyTorch API (``import hora.torch as hvd``) on hora's engine.

A Horovod script runs unchanged except for the import, launched with
``hora run -np 2 python train.py``::

    import hora.torch as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

The process API (``init``, ``rank``, ``size``, ...) is :mod:`hora`'s; the collectives take and
return torch tensors (:mod:`hora.torch.ops` for the asynchronous and in-place forms,
:mod:`hora.torch.autograd` for the differentiable ones). Differences from Horovod are listed in
docs/torch.md.
"""

from __future__ import annotations

from hora import _basics
from hora._basics import *  # noqa: F403 - Horovod's common names, one list for every adapter
from hora.core.frontend.api import poll, synchronize
from hora.torch import elastic  # hvd.elastic, as in Horovod (~15 ms of import time)
from hora.torch.autograd import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from hora.torch.compression import Compression
from hora.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from hora.torch.ops import (
    allgather_async,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    reducescatter_async,
    sparse_allreduce_async,
)
from hora.torch.optimizer import DistributedOptimizer
from hora.torch.sharded import ShardedOptimizer  # hora-only: ZeRO-style sharded state
from hora.torch.sync_batch_norm import SyncBatchNorm

__all__ = [
    *_basics.__all__,
    "Compression", "DistributedOptimizer", "SyncBatchNorm", "allgather", "allgather_async",
    "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "join", "poll", "reducescatter", "reducescatter_async",
    "sparse_allreduce_async", "synchronize", "elastic",
    "ShardedOptimizer",
]
