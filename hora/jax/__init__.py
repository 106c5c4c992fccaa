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

from hora import (
    Adasum,
    Average,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from hora.core.api import poll, synchronize
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

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Max", "Min", "Product", "ProcessSet", "Sum", "add_process_set",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_async",
    "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_async", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built",
    "gloo_enabled", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_reducescatter", "grouped_reducescatter_async", "init",
    "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter",
    "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "start_timeline", "stop_timeline", "synchronize",
]
