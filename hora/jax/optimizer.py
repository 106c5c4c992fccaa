"""``DistributedOptimizer`` for optax: average gradients across ranks, then apply ``tx``.

:func:`DistributedOptimizer` returns an ``optax.GradientTransformation``: its ``update``
allreduces the gradient pytree (one fused group, or ``groups`` groups) and hands the result to
the wrapped transformation. It works eagerly and inside a jitted train step (the allreduce is a
host callback named at trace time: the same names every step; the large gradients the step
computes are reduced in place, in XLA's own buffers, and the small ones packed into one buffer:
:mod:`hora.jax.packed`). With
``backward_passes_per_step=k`` gradients are accumulated locally for ``k`` calls
(``optax.MultiSteps``: their mean) and reduced and applied on every k-th call only.

With ``op=Adasum`` (and more than one rank) it is Horovod's Adasum *delta* optimizer
(:func:`hora.core.frontend.distopt.adasum_active`): the wrapped transformation runs first, on this
rank's own gradients, and its updates (the parameter deltas, since optax's updates are what is
added to the parameters) are combined across ranks with Adasum, one leaf at a time; the
combined updates are returned, so ``optax.apply_updates`` gives every rank
``params + adasum(delta)``.

The option rules (checks, predivide factors, groups) are :mod:`hora.core.frontend.distopt`'s.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from hora.collectives.ops import ReduceOp
from hora.core.frontend import distopt
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.jax.compression import Compression, Compressor
from hora.jax.ops import grouped_allreduce


def _reducer(name: str, compression: type[Compressor], op: ReduceOp, prescale: float,
             postscale: float, groups: Any, process_set: ProcessSet
             ) -> optax.GradientTransformation:
    def init(params: Any) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        if not process_set.included() or int(process_set.size() or 0) <= 1:
            return updates, state
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        parts = distopt.group_indices(len(leaves), groups if isinstance(groups, int) else None)
        if groups is None:
            parts = [list(range(len(leaves)))]
        out: list[Any] = list(leaves)
        for k, part in enumerate(parts):
            reduced = grouped_allreduce(
                [leaves[i] for i in part], name=f"{name}.{k}" if len(parts) > 1 else name,
                compression=compression, op=op, prescale_factor=prescale,
                postscale_factor=postscale, process_set=process_set)
            for i, r in zip(part, reduced):
                out[i] = r
        return jax.tree_util.tree_unflatten(treedef, out), state

    return optax.GradientTransformation(init, update)


def DistributedOptimizer(optimizer: optax.GradientTransformation,  # noqa: N802 - Horovod
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: int = ReduceOp.Average,
                         gradient_predivide_factor: float = 1.0, groups: int | None = None,
                         process_set: ProcessSet = global_process_set,
                         name: str = "DistributedOptimizer") -> optax.GradientTransformation:
    """Wrap optax transformation ``optimizer`` so that gradients are averaged (``op``) across
    the process set before it sees them.

    Args:
        compression: ``Compression.fp16`` sends floating gradients as float16.
        backward_passes_per_step: accumulate this many gradients locally (their mean) before
            one allreduce and one update (``optax.MultiSteps``).
        op: Average (default), Sum, or Adasum: the delta optimizer (see the module docstring;
            global process set, 2^k ranks or hosts).
        gradient_predivide_factor: Average only: divide by it before the sum and multiply
            after (Horovod's split of the average).
        groups: None (one fused group for the whole gradient tree) or k > 0 (k groups of
            consecutive leaves). Horovod's list-of-tensors form has no meaning for pytrees.
        process_set: average over these ranks only; other ranks keep their own gradients.
        name: hora-only: the base of the allreduce names (two optimizers in one program need
            different names).

    Raises:
        ValueError: invalid options (Horovod's texts), ``groups`` not an int.
        NotImplementedError: ``op=Adasum`` with a process set other than the global one, or
            ranks (hosts, when hierarchical) that are not a power of two.
    """
    if groups is not None and (isinstance(groups, bool) or not isinstance(groups, int)):
        raise ValueError("hora.jax.DistributedOptimizer: groups must be None or a positive int "
                         "(pytrees are grouped by position).")
    groups = distopt.check_options(op, gradient_predivide_factor, backward_passes_per_step, 0,
                                   groups)
    prescale, postscale = distopt.scale_factors(op, gradient_predivide_factor)
    reducer = _reducer(name, compression, ReduceOp(op), prescale, postscale, groups,
                       process_set)
    if distopt.adasum_active(op, process_set):
        tx = optax.chain(optimizer, reducer)  # the local update, then Adasum of the deltas
    else:
        tx = optax.chain(reducer, optimizer)
    if backward_passes_per_step > 1:
        multi = optax.MultiSteps(tx, every_k_schedule=backward_passes_per_step)
        return multi.gradient_transformation()
    return tx


__all__ = ["DistributedOptimizer"]
