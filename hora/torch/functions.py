"""Helpers that keep model, optimizer and Python state identical on every rank.

``broadcast_parameters`` and ``broadcast_optimizer_state`` use in-place tensor broadcasts;
``broadcast_object`` / ``allgather_object`` pickle through the core's object collectives. All
are collective: every member of the process set must call them, in the same order.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from hora.core.frontend import objects as _objects
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.torch import ops


def broadcast_parameters(params: Any, root_rank: int,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite ``params`` in place with ``root_rank``'s values.

    Args:
        params: a dict of tensors (e.g. ``model.state_dict()``; broadcast in key order, each
            key naming its op) or a list of tensors or of ``(name, tensor)`` tuples.
            Generators (``model.parameters()``) are rejected as in Horovod: wrap them in
            ``list(...)``.
        root_rank: the global rank whose values win.
        process_set: hora extension (Horovod broadcasts over the global set only).

    Raises:
        ValueError: ``params`` of another type ("invalid params of type ...").
        HorovodInternalError: a broadcast failed (raised after all have finished).
    """
    if isinstance(params, dict):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, list):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = [ops.broadcast_async_(p, root_rank, name, process_set) for name, p in items]
    _wait_all(handles)


def _wait_all(handles: list[int]) -> None:
    first_error: BaseException | None = None
    for handle in handles:
        try:
            ops.synchronize(handle)
        except BaseException as exc:  # noqa: BLE001 - finish every op, then raise the first
            first_error = first_error or exc
    if first_error is not None:
        raise first_error


def _sparse_param_ids(model: Any) -> set[int]:
    modules = model if isinstance(model, (list, tuple)) else [model] if model is not None else []
    ids: set[int] = set()
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse:
                ids.update(id(p) for p in sub.parameters())
    return ids


def _zero_missing_grads(optimizer: torch.optim.Optimizer, model: Any) -> None:
    """Give every trainable parameter without a gradient a zero one, as Horovod's
    ``broadcast_optimizer_state`` leaves them (code written for Horovod broadcasts or reads
    ``p.grad`` right after it); ``zero_grad()`` clears them as usual."""
    sparse_ids = _sparse_param_ids(model)
    all_sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                zeros = torch.zeros_like(p)
                p.grad = zeros.to_sparse() if all_sparse or id(p) in sparse_ids else zeros


def _materialize_state(optimizer: torch.optim.Optimizer, model: Any) -> None:
    """Create the optimizer's state with one step on zero gradients. Unlike Horovod, the
    parameters and gradients are restored afterwards (so weight decay does not move them)."""
    sparse_ids = _sparse_param_ids(model)
    all_sparse = isinstance(optimizer, torch.optim.SparseAdam)
    saved = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                saved.append((p, p.grad, p.detach().clone()))
                zeros = torch.zeros_like(p)
                p.grad = zeros.to_sparse() if all_sparse or id(p) in sparse_ids else zeros
    base_step = getattr(type(optimizer), "_hora_base", None)
    try:
        if base_step is not None:  # a DistributedOptimizer: its step() would allreduce
            base_step.step(optimizer)
        else:
            optimizer.step()
    finally:
        with torch.no_grad():
            for p, grad, value in saved:
                p.copy_(value)
                p.grad = grad


def _has_state(optimizer: torch.optim.Optimizer) -> bool:
    return any(len(s) for s in optimizer.state.values())


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Any = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make the optimizer's state and hyperparameters equal to ``root_rank``'s, in place.

    Every param-group option (``lr``, ``betas``, ...) takes the root's value. As in Horovod, a
    rank whose optimizer has no state yet leaves a zero gradient on every trainable parameter
    that had none (``p.grad`` is then a tensor, e.g. for a broadcast). If the root's
    optimizer has no state yet (it has not stepped), every rank's state is left empty, i.e.
    exactly as fresh as the root's; Horovod instead creates state with one step on zero
    gradients, which moves parameters under weight decay and shifts Adam's step count.
    Otherwise a rank without state first creates it that way (parameters restored afterwards;
    sparse zero gradients for ``SparseAdam`` and for sparse embeddings found in ``model``), then
    tensor state is broadcast in place (op names ``<state key>.<occurrence>``) and scalar state
    travels with the options in one ``broadcast_object``.

    Raises:
        ValueError: ``torch.optim.LBFGS`` (its state cannot be broadcast this way).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    root_has_state = _objects.broadcast_object(_has_state(optimizer), root_rank,
                                           name="broadcast_optimizer_state.has_state",
                                           process_set=process_set)
    if not _has_state(optimizer):
        _zero_missing_grads(optimizer, model)
    if root_has_state and not _has_state(optimizer):
        _materialize_state(optimizer, model)
    state_dict = optimizer.state_dict()
    tensors: list[tuple[str, torch.Tensor]] = []
    options: dict[tuple[int, str], Any] = {}
    scalars: dict[tuple[Any, Any], Any] = {}
    occurrences: dict[str, int] = defaultdict(int)
    for index, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key != "params":
                options[(index, key)] = value
        if not root_has_state:
            continue
        for pid in group["params"]:
            for name, value in state_dict["state"].get(pid, {}).items():
                occurrences[str(name)] += 1
                if torch.is_tensor(value):
                    tensors.append((f"{name}.{occurrences[str(name)]}", value))
                else:
                    scalars[(pid, name)] = value
    broadcast_parameters(tensors, root_rank, process_set=process_set)
    synced_options, synced_scalars = _objects.broadcast_object(
        (options, scalars), root_rank, name="broadcast_optimizer_state", process_set=process_set)
    for (index, key), value in synced_options.items():
        optimizer.param_groups[index][key] = value
    if not root_has_state:
        optimizer.state.clear()
        return
    by_pid = dict(zip((pid for g in state_dict["param_groups"] for pid in g["params"]),
                      (p for g in optimizer.param_groups for p in g["params"])))
    for (pid, name), value in synced_scalars.items():
        optimizer.state[by_pid[pid]][name] = value


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s (cloud)pickled ``obj`` on every member (the root gets its own
    object back). ``name`` defaults to an automatic, call-order name (Horovod used the object's
    type name, which hangs when ranks pass objects of different types, e.g. ``None``)."""
    return _objects.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return every member's (cloud)pickled ``obj`` as a list in rank order."""
    return _objects.allgather_object(obj, name=name, process_set=process_set)
