"""The gradient of each collective, once for every adapter (Horovod's rules).

An adapter's differentiable forms (``torch.autograd.Function``, TensorFlow's registered
gradients, JAX's ``custom_vjp``) call these with the incoming gradient and what the forward pass
saved; each runs collectives through the adapter's :class:`~hora.core.frontend.op_forms.Bridge`:

* allreduce: the gradient is allreduced with the same op and scale factors;
* allgather: the gradient is averaged across the set, and each rank keeps its own rows;
* broadcast: the gradient is averaged across the set and belongs to the root (zero elsewhere);
* alltoall: the gradient travels back along the received splits (rows that were not sent get a
  zero gradient);
* reducescatter: the gradient, scaled by the forward's factors (and the set size for Sum), is
  allgathered.

The few tensor operations the rules need (take rows, zeros, pad rows, scale) are the bridge's
:class:`TensorMath`. ``name`` (optional) names the gradient's collectives; an adapter whose
backward passes may run in a different order on different ranks (JAX's host callbacks) passes a
name fixed when the program was traced, so ops pair by name rather than by call order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from hora.collectives.ops import ReduceOp
from hora.core.engine import context as _context
from hora.core.frontend import api
from hora.core.frontend import op_forms as sp
from hora.core.op.process_set import ProcessSet


class TensorMath(Protocol):
    """Tensor operations on the adapter's own tensors (the bridge provides them)."""

    def rows(self, tensor: Any, start: int, count: int) -> Any:
        """``tensor[start:start + count]`` along dimension 0."""
        ...

    def zeros_like(self, tensor: Any) -> Any: ...

    def pad_rows(self, tensor: Any, rows: int) -> Any:
        """``tensor`` with zero rows appended up to ``rows`` rows."""
        ...

    def scaled(self, tensor: Any, factor: float) -> Any: ...


class GradientBridge(sp.Bridge, TensorMath, Protocol):
    """A bridge that can also do the gradient rules' tensor math."""


def _row_offsets(process_set: ProcessSet, dims: Sequence[int], name: str | None = None
                 ) -> list[int]:
    """Where this rank's rows start in each gathered tensor (first dimensions ``dims`` here)."""
    gathered = api.allgather_async(np.asarray([list(dims)], np.int64),
                                   name=f"{name}.offsets" if name else None,
                                   process_set=process_set).wait()
    rank = int(process_set.rank() or 0)
    return [int(v) for v in gathered[:rank].sum(axis=0)]


def allreduce(bridge: GradientBridge, grad: Any, op: ReduceOp, prescale: float,
              postscale: float, process_set: ProcessSet, name: str | None = None) -> Any:
    return sp.run(bridge, sp.ALLREDUCE, grad, None, name, op, prescale, postscale, process_set)


def grouped_allreduce(bridge: GradientBridge, grads: Sequence[Any], op: ReduceOp,
                      prescale: float, postscale: float, process_set: ProcessSet,
                      name: str | None = None) -> list[Any]:
    out: list[Any] = sp.run(bridge, sp.GROUPED_ALLREDUCE, list(grads), None, name, op, prescale,
                            postscale, process_set)
    return out


def allgather(bridge: GradientBridge, grad: Any, dim0: int, process_set: ProcessSet,
              name: str | None = None) -> Any:
    reduced = sp.run(bridge, sp.ALLREDUCE, grad, None, name, ReduceOp.Average, 1.0, 1.0,
                     process_set)
    return bridge.rows(reduced, _row_offsets(process_set, [dim0], name)[0], dim0)


def grouped_allgather(bridge: GradientBridge, grads: Sequence[Any], dims: Sequence[int],
                      process_set: ProcessSet, name: str | None = None) -> list[Any]:
    reduced = sp.run(bridge, sp.GROUPED_ALLREDUCE, list(grads), None, name, ReduceOp.Average,
                     1.0, 1.0, process_set)
    offsets = _row_offsets(process_set, dims, name)
    return [bridge.rows(r, o, d) for r, o, d in zip(reduced, offsets, dims)]


def broadcast(bridge: GradientBridge, grad: Any, root_rank: int,
              process_set: ProcessSet, name: str | None = None) -> Any:
    reduced = sp.run(bridge, sp.ALLREDUCE, grad, None, name, ReduceOp.Average, 1.0, 1.0,
                     process_set)
    if _context.get("broadcast gradient").rank != root_rank:
        return bridge.zeros_like(reduced)
    return reduced


def alltoall(bridge: GradientBridge, grad: Any, received_splits: Any, rows: int,
             process_set: ProcessSet, name: str | None = None) -> Any:
    back, _ = sp.run(bridge, sp.ALLTOALL, grad, received_splits, name, process_set)
    return bridge.pad_rows(back, rows)


def reducescatter_scale(op: ReduceOp, prescale: float, postscale: float,
                        process_set: ProcessSet) -> float:
    """The factor the forward pass applied to each rank's contribution, as seen by its share."""
    size = float(process_set.size() or 0) if op is ReduceOp.Sum else 1.0
    return size * prescale * postscale


def reducescatter(bridge: GradientBridge, grad: Any, scale: float,
                  process_set: ProcessSet, name: str | None = None) -> Any:
    g = bridge.scaled(grad, scale) if scale != 1.0 else grad
    return sp.run(bridge, sp.ALLGATHER, g, name, process_set)


def grouped_reducescatter(bridge: GradientBridge, grads: Sequence[Any], scale: float,
                          process_set: ProcessSet, name: str | None = None) -> list[Any]:
    scaled = [bridge.scaled(g, scale) if scale != 1.0 else g for g in grads]
    out: list[Any] = sp.run(bridge, sp.GROUPED_ALLGATHER, scaled, name, process_set)
    return out
