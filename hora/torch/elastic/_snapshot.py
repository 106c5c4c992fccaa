"""Copies of state-dict trees for elastic commits: into the buffers of the previous commit
(``Tensor.copy_``, no allocation in the steady state), and back out without aliasing.

A commit of ~100 MB (model + optimizer state) costs about one copy of those bytes this way;
``copy.deepcopy`` of the state dicts costs 3-6x that (it allocates and faults in new pages every
time). Trees are dicts / lists / tuples of tensors and other (deep-copied) leaves.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


def _reusable(buffer: Any, value: torch.Tensor) -> bool:
    return (type(buffer) is torch.Tensor and type(value) is torch.Tensor
            and buffer.layout == torch.strided and value.layout == torch.strided
            and buffer.shape == value.shape and buffer.dtype == value.dtype
            and buffer.device == value.device)


def _same_kind(original: dict[Any, Any], items: dict[Any, Any]) -> dict[Any, Any]:
    """``items`` in a mapping of ``original``'s type (an ``OrderedDict`` keeps a module state
    dict's ``_metadata``, which ``load_state_dict`` reads)."""
    if type(original) is dict:
        return items
    out = copy.copy(original)
    out.clear()
    out.update(items)
    if hasattr(original, "_metadata"):
        out._metadata = copy.deepcopy(original._metadata)  # type: ignore[attr-defined]
    return out


def snapshot(value: Any, previous: Any) -> Any:
    """A copy of the tree ``value`` (dicts / lists / tuples of tensors and other leaves) that
    shares no memory with it; tensors are copied into ``previous``'s matching buffers where
    their layout agrees, cloned otherwise; other leaves are deep-copied."""
    if isinstance(value, torch.Tensor):
        with torch.no_grad():
            if _reusable(previous, value):
                return previous.copy_(value)
            return value.detach().clone()
    if isinstance(value, dict):
        old = previous if isinstance(previous, dict) else {}
        return _same_kind(value, {k: snapshot(v, old.get(k)) for k, v in value.items()})
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        old_seq = previous if isinstance(previous, (list, tuple)) else ()
        return type(value)(snapshot(v, old_seq[i] if i < len(old_seq) else None)
                           for i, v in enumerate(value))
    return copy.deepcopy(value)


def thawed(saved: Any, live: Any, copy_tensors: bool) -> Any:
    """A tree equal to the snapshot ``saved``, to load into a live object; other leaves are
    deep-copied. Tensors: with ``copy_tensors=True`` they are copied into the matching tensor of
    the ``live`` tree where the layout agrees and cloned where not, so the result shares no
    memory with ``saved``; with ``copy_tensors=False`` they are ``saved``'s own (only for
    consumers that copy them, like ``Module.load_state_dict``)."""
    if isinstance(saved, torch.Tensor):
        if not copy_tensors:
            return saved
        if _reusable(live, saved):
            with torch.no_grad():
                live.copy_(saved)
            return live
        return saved.clone()
    if isinstance(saved, dict):
        old = live if isinstance(live, dict) else {}
        return _same_kind(saved, {k: thawed(v, old.get(k), copy_tensors)
                                  for k, v in saved.items()})
    if isinstance(saved, (list, tuple)) and type(saved) in (list, tuple):
        old_seq = live if isinstance(live, (list, tuple)) else ()
        return type(saved)(thawed(v, old_seq[i] if i < len(old_seq) else None, copy_tensors)
                           for i, v in enumerate(saved))
    return copy.deepcopy(saved)


__all__ = ["snapshot", "thawed"]
