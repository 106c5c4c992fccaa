"""Keeping parameters, optimizer state and Python objects identical on every rank, and the
control collectives (``join``, ``barrier``).

JAX values are immutable, so the broadcasts *return* the root's tree instead of writing in
place: ``params = hvd.broadcast_parameters(params, root_rank=0)``. All are collective: every
member of the process set calls them in the same order with a pytree of the same structure (a
differing structure raises on every rank, naming the first differing leaf).
"""

from __future__ import annotations

from typing import Any

from hora.core.frontend import api as _api
from hora.core.frontend import objects as _objects
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.jax.bridge import eager_only
from hora.jax.ops import broadcast
from hora.jax.tree import flatten


def broadcast_parameters(params: Any, root_rank: int = 0,
                         process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``params`` (any pytree of arrays: a Flax ``params`` dict, an
    ``nnx.State``, ...) on every member. ``process_set`` is a hora extension."""
    return broadcast(params, root_rank, name="broadcast_parameters", process_set=process_set)


def broadcast_optimizer_state(opt_state: Any, root_rank: int = 0,
                              process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s optax optimizer state (a pytree: step counts, moments...) on
    every member. Python scalars in the state come back as 0-d arrays."""
    return broadcast(opt_state, root_rank, name="broadcast_optimizer_state",
                     process_set=process_set)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s (cloud)pickled ``obj`` on every member (the root gets its own
    object back). Not inside ``jax.jit``."""
    eager_only("broadcast_object", flatten(obj).leaves)
    return _objects.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return every member's (cloud)pickled ``obj`` as a list in rank order. Not inside
    ``jax.jit``."""
    eager_only("allgather_object", flatten(obj).leaves)
    return _objects.allgather_object(obj, name=name, process_set=process_set)


def join(device: int = -1) -> int:
    """This rank has no more data: until every rank has joined, it contributes zeros to the
    others' allreduces. Blocks until all ranks joined; returns the last rank to join.
    ``device`` is accepted for Horovod compatibility. Not inside ``jax.jit``."""
    return _api.join(global_process_set)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every member of the set has called ``barrier``. Not inside ``jax.jit``."""
    _api.barrier(process_set)


__all__ = ["allgather_object", "barrier", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters", "join"]
