"""Framework-neutral rules of Horovod's ``DistributedOptimizer`` (shared by every adapter).

An adapter's optimizer wrapper installs hooks and moves tensors; the decisions live here: which
constructor arguments are valid, how ``named_parameters`` are checked and named, how parameters
are split into groups, and how Average is split into pre/post-scale factors around the
allreduce (``gradient_predivide_factor``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from hora.collectives.ops import ReduceOp
from hora.core.engine import context
from hora.core.frontend import api, grouped
from hora.core.op.process_set import ProcessSet, global_process_set

T = TypeVar("T")


def check_options(op: int, gradient_predivide_factor: float, backward_passes_per_step: int,
                  num_groups: int, groups: Any) -> Any:
    """Validate the optimizer options; return the effective ``groups`` (``num_groups`` folded
    in, with Horovod's DeprecationWarning).

    Raises:
        ValueError: predivide factor with an op other than Average; ``backward_passes_per_step``
            not positive; ``groups`` neither a positive int nor a list of lists.
    """
    if gradient_predivide_factor != 1.0 and ReduceOp(op) is not ReduceOp.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is not None:
        is_int = isinstance(groups, int) and not isinstance(groups, bool)
        if not ((is_int and groups > 0) or isinstance(groups, list)):
            raise ValueError("groups should be a non-negative integer or a list of list of "
                             "tensors.")
        if is_int and groups == 0:
            groups = None
    return groups


def scale_factors(op: int, gradient_predivide_factor: float) -> tuple[float, float]:
    """``(prescale, postscale)`` for a gradient allreduce: Average is split as
    ``1/f`` before and ``f`` after (the engine divides by the set size as well); other ops
    are unscaled."""
    if ReduceOp(op) is ReduceOp.Average:
        return 1.0 / gradient_predivide_factor, gradient_predivide_factor
    return 1.0, 1.0


def adasum_active(op: int, process_set: ProcessSet) -> bool:
    """Whether a gradient wrapper (``DistributedOptimizer``, ``DistributedGradientTape``) with
    ``op`` combines across ranks with Adasum: ``op`` is Adasum and the job has more than one
    rank (with one rank, as in Horovod, the plain wrapper runs and nothing is combined).

    The optimizers then are Horovod's Adasum *delta* optimizer, one model for the torch, Keras
    and optax wrappers: each rank applies the wrapped optimizer to its own gradients
    (accumulated locally over ``backward_passes_per_step`` passes), the change of every
    parameter (its delta) is combined across ranks with Adasum, one tensor at a time, and every
    rank sets the parameter to its value before the step plus the combined delta. A gradient
    tape combines the gradients themselves with Adasum.

    Raises:
        NotImplementedError: a process set other than the global one (Horovod's text), or a
            job whose ranks (hosts, when hierarchical) are not a power of two.
    """
    if ReduceOp(op) is not ReduceOp.Adasum:
        return False
    size = context.get("DistributedOptimizer").size
    if size <= 1:
        return False
    if process_set is not global_process_set:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    api.check_adasum_set(range(size))
    return True


def check_named_parameters(named: list[Any], all_params: Sequence[Any]) -> list[tuple[str, Any]]:
    """Validate ``named_parameters`` against the optimizer's parameters.

    Raises:
        ValueError: an element is not a ``(name, parameter)`` tuple; duplicate names (listed);
            optimizer parameters without a name (their Python ids listed).
    """
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    seen: set[str] = set()
    dups: list[str] = []
    for name, _ in named:
        if name in seen and name not in dups:
            dups.append(name)
        seen.add(name)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(str(d) for d in dups))
    named_ids = {id(p) for _, p in named}
    unnamed = [id(p) for p in all_params if id(p) not in named_ids]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         "were not named. Python object ids: "
                         + ", ".join(str(i) for i in unnamed))
    return list(named)


def default_names(group_sizes: Sequence[int]) -> list[str]:
    """Names for parameters when ``named_parameters`` is None:
    ``allreduce.noname.<group>.<index>`` (unique across param groups)."""
    return [f"allreduce.noname.{g}.{i}" for g, n in enumerate(group_sizes) for i in range(n)]


def parameter_names(groups: Sequence[Sequence[Any]], named: Iterable[Any] | None
                    ) -> dict[Any, str]:
    """Each parameter of an optimizer's param groups -> its allreduce name: from
    ``named_parameters`` (checked, :func:`check_named_parameters`) or :func:`default_names`."""
    all_params = [p for group in groups for p in group]
    if named is not None:
        pairs = check_named_parameters(list(named), all_params)
    else:
        pairs = list(zip(default_names([len(group) for group in groups]), all_params))
    return {p: n for n, p in pairs}


def split_list(items: Sequence[T], parts: int) -> list[list[T]]:
    """Split ``items`` into ``parts`` contiguous, nearly equal lists (the first ones longer)."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return [group for group in out if group]


def check_explicit_groups(groups: list[Any], is_tensor: Any,
                          kind: str = "torch.Tensor") -> None:
    """A list of groups must hold tensors (``is_tensor(x)``), each at most once.

    Raises:
        ValueError: a non-tensor member, or a tensor in two groups.
    """
    seen: set[int] = set()
    for group in groups:
        for p in group:
            if not is_tensor(p):
                raise ValueError(f"groups must consist of tensors ({kind}).")
            if id(p) in seen:
                raise ValueError("A parameter can only appear once in groups.")
            seen.add(id(p))


def group_indices(count: int, groups: Any, group_of: Any = None) -> list[list[int]]:
    """Gradient positions ``0..count-1`` split into groups: an int k gives k contiguous, nearly
    equal groups; a list of lists gives one group per list (``group_of(i)`` is the index of the
    list that holds gradient ``i``, or None); positions in no group stay alone."""
    if groups is None:
        return [[i] for i in range(count)]
    if isinstance(groups, int):
        return split_list(list(range(count)), groups)
    by_group: dict[int, list[int]] = {}
    alone: list[list[int]] = []
    for i in range(count):
        g = group_of(i) if group_of is not None else None
        if g is None:
            alone.append([i])
        else:
            by_group.setdefault(g, []).append(i)
    return [by_group[g] for g in sorted(by_group)] + alone


def allreduce_groups(arrays: Sequence[np.ndarray], names: Sequence[str],
                     groups: Sequence[Sequence[int]], op: int, prescale: float,
                     postscale: float, process_set: ProcessSet) -> list[np.ndarray]:
    """Allreduce host arrays (gradients of a step) and wait for all of them.

    Each group (positions in ``arrays``) of more than one array is one grouped allreduce named
    after its first member; single arrays are allreduced alone (the engine fuses them). Every op
    is waited for before the first error is raised, so none is left in flight.
    """
    handles = []
    for group in groups:
        if len(group) == 1:
            i = group[0]
            handles.append(([i], api.allreduce_async(
                arrays[i], name=names[i], op=ReduceOp(op), prescale_factor=prescale,
                postscale_factor=postscale, process_set=process_set)))
        elif group:
            handles.append((list(group), grouped.grouped_allreduce_async(
                [arrays[i] for i in group], name=names[group[0]], op=ReduceOp(op),
                prescale_factor=prescale, postscale_factor=postscale, process_set=process_set)))
    out: list[np.ndarray] = list(arrays)
    first_error: BaseException | None = None
    for members, handle in handles:
        try:
            result = handle.wait()
        except BaseException as exc:  # noqa: BLE001 - wait for the rest, then raise
            first_error = first_error or exc
            continue
        for i, r in zip(members, result if len(members) > 1 else [result]):
            out[i] = r
    if first_error is not None:
        raise first_error
    return out


__all__ = ["adasum_active", "allreduce_groups", "check_explicit_groups", "check_named_parameters",
           "check_options", "default_names", "group_indices", "scale_factors", "split_list"]
