"""The full optimizer state of :mod:`hora.torch.sharded`'s ``ShardedOptimizer`` when parameters
are split across ranks (hora-only): a split parameter's state lives on each owner as the state
of a flat slice (elements ``[start, start + numel)``); these helpers join the slices' states
into one entry of the wrapped optimizer's format (per-element tensors concatenated and shaped as
the parameter, scalars such as Adam's ``step`` taken from the first slice) and cut a full entry
back into a slice's.

Which optimizers may be split is decided here too: an optimizer whose update of an element reads
only that element's gradient and state (Adam, SGD, ...) steps a slice exactly as it steps the
whole tensor; one that needs whole tensors (LBFGS, factored or orthogonalizing optimizers) does
not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

#: torch.optim classes whose update is elementwise: a slice of a parameter steps as the whole.
ELEMENTWISE = frozenset(
    getattr(torch.optim, name) for name in (
        "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop",
        "Rprop", "ASGD") if hasattr(torch.optim, name))

#: torch.optim classes that need whole tensors (or sparse gradients): never split.
WHOLE_TENSOR = frozenset(
    getattr(torch.optim, name) for name in ("LBFGS", "SparseAdam", "Adafactor", "Muon")
    if hasattr(torch.optim, name))


def resolve_split(base: type, split_parameters: bool | None) -> bool:
    """Whether ``ShardedOptimizer`` splits parameters for the wrapped class ``base``: by
    default (``None``) only for the elementwise torch.optim classes (:data:`ELEMENTWISE`,
    exact class); ``True`` for any class but the whole-tensor ones.

    Raises:
        ValueError: ``split_parameters=True`` for a whole-tensor optimizer.
    """
    if split_parameters is None:
        return base in ELEMENTWISE
    if split_parameters and any(issubclass(base, w) for w in WHOLE_TENSOR):
        raise ValueError(
            f"ShardedOptimizer(split_parameters=True): {base.__name__} needs whole tensors "
            "(its update of an element reads other elements), so a parameter cannot be split "
            "across ranks; use split_parameters=False (whole-tensor placement: a parameter "
            "larger than total / size leaves its owner with more than its share).")
    return bool(split_parameters)


def join_pieces(pieces: Sequence[tuple[int, int, Mapping[str, Any]]], shape: torch.Size,
                numel: int) -> dict[str, Any]:
    """One parameter's full state from its slices' states ``(start, numel, state)``."""
    pieces = sorted(pieces, key=lambda t: t[0])
    covered = sum(n for _, n, _ in pieces)
    if covered != numel:
        raise ValueError(f"the slices' states cover {covered} of {numel} elements")
    out: dict[str, Any] = {}
    for key, first in pieces[0][2].items():
        if torch.is_tensor(first) and first.dim() == 1 and first.numel() == pieces[0][1]:
            out[key] = torch.cat([s[key].reshape(-1) for _, _, s in pieces]).reshape(shape)
        else:
            out[key] = first
    return out


def cut_piece(full: Mapping[str, Any], start: int, numel: int, param: torch.Tensor
              ) -> dict[str, Any]:
    """A slice's state from its parameter's full state entry, on the slice's device and (for
    floating state other than ``step``) dtype, as ``Optimizer.load_state_dict`` casts."""
    out: dict[str, Any] = {}
    for key, value in full.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.numel() == param.numel():
            value = value.reshape(-1)[start:start + numel]
            if value.is_floating_point():
                value = value.to(dtype=param.dtype)
            out[key] = value.to(device=param.device).clone()
        elif torch.is_tensor(value):
            out[key] = value.clone()
        else:
            out[key] = value
    return out


__all__ = ["ELEMENTWISE", "WHOLE_TENSOR", "cut_piece", "join_pieces", "resolve_split"]
