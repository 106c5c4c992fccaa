"""hora.jax: Horovod-style data parallelism for JAX (``import hora.jax as hvd``).

Horovod never had a JAX binding; this adapter gives JAX the same model as ``hora.torch``: one
script launched with ``hora run -np 2 python train.py``, gradients averaged by hora's engine::

    import hora.jax as hvd
    hvd.init()
    tx = hvd.DistributedOptimizer(optax.adam(1e-3 * hvd.size()))
    params = hvd.broadcast_parameters(params, root_rank=0)
    opt_state = hvd.broadcast_optimizer_state(tx.init(params), root_rank=0)

The process API (``init``, ``rank``, ``size``, ...) is :mod:`hora`'s; the collectives take
``jax.Array``\\ s or pytrees of them (one fused group per tree), eagerly or inside ``jax.jit``
(:mod:`hora.jax.ops`), with gradients; asynchronous forms are in :mod:`hora.jax.async_ops`.
See docs/jax.md.
"""

from __future__ import annotations

from hora import _basics
from hora._basics import *  # noqa: F403 - Horovod's common names, one list for every adapter
from hora.core.frontend.api import poll, synchronize
from hora.jax.async_ops import (
    allgather_async,
    allreduce_async,
    alltoall_async,
    broadcast_async,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_reducescatter_async,
    reducescatter_async,
)
from hora.jax.compression import Compression
from hora.jax.functions import (
    allgather_object,
    barrier,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    join,
)
from hora.jax.ops import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from hora.jax.optimizer import DistributedOptimizer
from hora.jax.sharded import ShardedOptimizer  # hora-only: ZeRO-style sharded state

__all__ = [
    *_basics.__all__,
    "Compression", "DistributedOptimizer", "allgather", "allgather_async", "allgather_object",
    "allreduce", "allreduce_async", "alltoall", "alltoall_async", "barrier", "broadcast",
    "broadcast_async", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_reducescatter", "grouped_reducescatter_async", "join",
    "poll", "reducescatter", "reducescatter_async", "synchronize", "ShardedOptimizer",
]
