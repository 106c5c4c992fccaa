"""Transformations that read every leaf, under :func:`hora.jax.ShardedOptimizer` (hora-only).

The sharded optimizer runs the wrapped optax transformation on the leaves this rank owns only.
That is exact for transformations that treat each leaf on its own (Adam, SGD, ...), but one that
reads the whole tree (``optax.clip_by_global_norm``: the norm of every gradient) would compute
from this rank's shard and give another result than ``DistributedOptimizer`` silently.

:func:`check_transformation` looks through the wrapped transformation (``optax.chain``,
``inject_hyperparams``, ``MultiSteps`` and the like: the functions its ``init`` / ``update``
close over) for the optax transformations known to read every leaf and raises ``ValueError``.
:func:`clip_by_global_norm` is the sharded replacement of ``optax.clip_by_global_norm``: the
squared norms of this rank's leaves are summed across the process set (in-jit allreduce), so
every rank scales by the norm of the full tree.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from hora.collectives.ops import ReduceOp
from hora.core.op.process_set import ProcessSet
from hora.jax.ops import allreduce

# optax transformations (their factory's name, the first part of the inner functions'
# ``__qualname__``) whose update reads every leaf of the tree: a norm, a dot product or a
# finiteness check over the whole tree
GLOBAL = frozenset({
    "clip_by_global_norm", "apply_if_finite", "normalize_by_update_norm", "scale_by_polyak",
    "scale_by_lbfgs", "scale_by_backtracking_linesearch", "scale_by_zoom_linesearch",
    "scale_by_dog", "scale_by_dowg", "scale_by_distance_over_gradients", "momo", "momo_adam",
    "mechanize", "dadapt_adamw", "prodigy", "sam", "skip_not_finite", "skip_large_updates",
})


def _global_name(fn: Any) -> str | None:
    module = getattr(fn, "__module__", None) or ""
    qualname = getattr(fn, "__qualname__", None) or ""
    if not module.startswith("optax"):
        return None
    head = qualname.split(".")[0]
    return head if head in GLOBAL else None


def find_global(tx: Any, limit: int = 2000) -> str | None:
    """The name of the first optax transformation reading every leaf found inside ``tx``
    (through closures, bound methods' objects, partials, tuples, lists and dicts), or None."""
    seen: set[int] = set()
    stack: list[Any] = [tx]
    while stack and len(seen) < limit:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            continue
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            stack.extend([obj.func, *obj.args, *obj.keywords.values()])
        elif hasattr(obj, "__func__") and hasattr(obj, "__self__"):  # a bound method
            stack.extend([obj.__func__, obj.__self__])
        elif callable(obj) and hasattr(obj, "__code__"):  # a function
            found = _global_name(obj)
            if found is not None:
                return found
            for cell in obj.__closure__ or ():
                try:
                    stack.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
        elif isinstance(obj, (tuple, list, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif type(obj).__module__.startswith("optax") and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())  # e.g. optax.MultiSteps
    return None


def check_transformation(tx: Any) -> None:
    """Raise ``ValueError`` if ``tx`` holds an optax transformation known to read every leaf
    (it would see this rank's shard only)."""
    found = find_global(tx)
    if found is None:
        return
    fix = ("pass clip_global_norm=max_norm to hora.jax.ShardedOptimizer instead (the norm "
           "of every rank's leaves)" if found == "clip_by_global_norm"
           else "use hora.jax.DistributedOptimizer for it")
    raise ValueError(f"ShardedOptimizer runs the wrapped transformation on this rank's leaves "
                     f"only, but it contains optax.{found}, which reads every leaf and would "
                     f"silently see this rank's shard only: {fix}")


def check_max_norm(max_norm: float | None) -> None:
    if max_norm is not None and not float(max_norm) > 0.0:
        raise ValueError(f"clip_global_norm must be a positive number, not {max_norm!r}")


def clip_by_global_norm(grads: dict[str, Any], max_norm: float, sharded: bool,
                        name: str, process_set: ProcessSet) -> dict[str, Any]:
    """``optax.clip_by_global_norm(max_norm)`` over the full tree: the squared norm of this
    rank's leaves summed across the process set (when ``sharded``; every member calls it)."""
    squares = [jnp.sum(jnp.real(jnp.conj(g) * g)) for g in grads.values()]
    total = sum(squares, jnp.zeros((), jnp.float32)).astype(jnp.float32)
    if sharded:
        total = allreduce(total, name=f"{name}.global_norm", op=ReduceOp.Sum,
                          process_set=process_set)
    norm = jnp.sqrt(total)
    return jax.tree_util.tree_map(
        lambda g: jnp.where(norm < max_norm, g,
                            (g / norm.astype(g.dtype)) * jnp.asarray(max_norm, g.dtype)),
        grads)


__all__ = ["GLOBAL", "check_max_norm", "check_transformation", "clip_by_global_norm",
           "find_global"]
