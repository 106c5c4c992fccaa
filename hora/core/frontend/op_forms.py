"""The op forms of every collective (Horovod's spellings of it), made once for every adapter.

Horovod offers each collective in up to four forms: ``x`` (wait, new result), ``x_`` (wait, in
place), ``x_async`` (a handle) and ``x_async_`` (a handle, in place), with one parameter list.
Each collective is one :class:`OpForm` here: that parameter list (a prototype function), the
dtype table it checks, and one ``submit`` that calls :mod:`hora.core.frontend.api`. An adapter
supplies a :class:`Bridge` (its tensors <-> the core's host buffers, each seen as a
:class:`TensorView`) and asks :func:`spell` for each public name::

    allreduce_async = spell(TORCH, ALLREDUCE, "allreduce_async", inplace=False, wait=False)

The function :func:`spell` returns has Horovod's exact signature (positional order and defaults:
it is compiled from the prototype's, as :mod:`dataclasses` compiles ``__init__``), so it costs no
more per call than a hand-written one. Adding an argument to a collective means editing its
prototype and its ``submit`` here (and the core call in :mod:`hora.core.frontend.api`), not the
adapters.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hora.collectives.ops import ReduceOp
from hora.core.engine import context as _context
from hora.core.frontend import api, grouped
from hora.core.op.entry import Buffer
from hora.core.op.handle import DerivedHandle, Handle
from hora.core.op.process_set import ProcessSet, global_process_set

REDUCE, MOVE = "reduce", "move"
"""Dtype tables a family checks: reductions (allreduce, reducescatter) or data movement
(allgather, broadcast, alltoall); an adapter may allow fewer dtypes for reductions."""


@dataclass
class TensorView:
    """An adapter's tensor as the core sees it: its values as a core buffer, its device kind,
    and the tensor itself."""

    array: Buffer  # the values (a view of the tensor's memory where possible, or the tensor
    # itself as a device buffer where the data plane takes it: hora.core.op.device)
    device: str  # device kind the ranks must agree on ('cpu', 'cuda', ...)
    tensor: Any  # the adapter's tensor


class Bridge(Protocol):
    """How an adapter's tensors cross into the core and back."""

    passthrough: bool
    """True when :meth:`result` and :meth:`written` return the core's result unchanged."""

    def host(self, tensor: Any, table: str) -> TensorView:
        """Check ``tensor`` against dtype table ``table`` (:data:`REDUCE` / :data:`MOVE`) and
        return its host view. Raises ValueError (Horovod's text) for what the adapter refuses."""
        ...

    def hosts(self, tensors: Sequence[Any], table: str) -> tuple[list[TensorView], str]:
        """Grouped ops: :meth:`host` of each tensor and the list's one device kind
        (ValueError if the tensors are on different devices)."""
        ...

    def result(self, like: TensorView, out: Any) -> Any:
        """A new adapter tensor holding the core's result ``out`` (placed like ``like``)."""
        ...

    def written(self, host: TensorView, out: Any) -> Any:
        """In-place forms: the adapter's tensor once the core wrote the result into ``host``
        (``out`` is what the core returned)."""
        ...

    def splits(self, splits: Any) -> list[int] | None:
        """Alltoall's ``splits`` argument as a list (or None)."""
        ...

    def received_splits(self, splits: Any, received: np.ndarray) -> Any:
        """Alltoall's received splits, placed like the ``splits`` argument."""
        ...


Convert = Callable[[Any], Any]
Submit = Callable[..., tuple[Handle, Convert]]


@dataclass(frozen=True)
class OpForm:
    """One collective: Horovod's parameters (``prototype``'s), and its core call.

    ``submit(bridge, inplace, sync, *arguments)`` starts the op and returns the core handle and
    the conversion of its result to what the spelling returns.
    """

    name: str
    prototype: Callable[..., Any]
    submit: Submit
    doc: str


# ---- the families -----------------------------------------------------------------------------
def _identity(out: Any) -> Any:
    return out


def _one(bridge: Bridge, host: TensorView, inplace: bool) -> Convert:
    if bridge.passthrough:  # results are already what the caller gets: no closure per op
        return _identity
    if inplace:
        return lambda out: bridge.written(host, out)
    return lambda out: bridge.result(host, out)


def _many(bridge: Bridge, hosts: list[TensorView], inplace: bool) -> Convert:
    if inplace:
        return lambda outs: [bridge.written(h, o) for h, o in zip(hosts, outs)]
    return lambda outs: [bridge.result(h, o) for h, o in zip(hosts, outs)]


def _allreduce_proto(tensor: Any, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> None: ...


def _allreduce(bridge: Bridge, inplace: bool, sync: bool, tensor: Any, average: bool | None,
               name: str | None, op: int | None, prescale_factor: float,
               postscale_factor: float, process_set: ProcessSet) -> tuple[Handle, Convert]:
    host = bridge.host(tensor, REDUCE)
    h = api.allreduce_async(host.array, name=name, op=api.resolve_op(op, average),
                            prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                            process_set=process_set, inplace=inplace, device=host.device,
                            sync=sync)
    return h, _one(bridge, host, inplace)


def _grouped_allreduce(bridge: Bridge, inplace: bool, sync: bool, tensors: Sequence[Any],
                       average: bool | None, name: str | None, op: int | None,
                       prescale_factor: float, postscale_factor: float,
                       process_set: ProcessSet) -> tuple[Handle, Convert]:
    hosts, device = bridge.hosts(tensors, REDUCE)
    h = grouped.grouped_allreduce_async([x.array for x in hosts], name=name,
                                        op=api.resolve_op(op, average),
                                        prescale_factor=prescale_factor,
                                        postscale_factor=postscale_factor,
                                        process_set=process_set, inplace=inplace, device=device,
                                        sync=sync)
    return h, _many(bridge, hosts, inplace)


def allreduce_unit(bridge: Bridge, sync: bool, tensors: Sequence[Any], names: Sequence[str],
                   op: int, prescale_factor: float, postscale_factor: float,
                   process_set: ProcessSet) -> list[tuple[Handle, Convert]]:
    """In-place allreduces of host ``tensors``, each under its own name (as single ops:
    negotiated, named and reported one by one), submitted together as one unit
    (:func:`~hora.core.frontend.grouped.allreduce_unit_async`: in a fast lane one fused
    collective where it fits): an adapter's pending gradients of one step. Per tensor, its
    handle and the conversion of its result.

    Raises:
        ValueError: a tensor the adapter refuses, or one that is not in host memory.
    """
    hosts = [bridge.host(t, REDUCE) for t in tensors]
    if any(h.device != "cpu" for h in hosts):
        raise ValueError("allreduce_unit: host tensors only")
    handles = grouped.allreduce_unit_async([h.array for h in hosts], names, op=op,
                                           prescale_factor=prescale_factor,
                                           postscale_factor=postscale_factor,
                                           process_set=process_set, inplace=True, sync=sync)
    return [(h, _one(bridge, host, True)) for h, host in zip(handles, hosts)]


def _allgather_proto(tensor: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> None: ...


def _allgather(bridge: Bridge, inplace: bool, sync: bool, tensor: Any, name: str | None,
               process_set: ProcessSet) -> tuple[Handle, Convert]:
    host = bridge.host(tensor, MOVE)
    h = api.allgather_async(host.array, name=name, process_set=process_set, device=host.device,
                            sync=sync)
    return h, _one(bridge, host, False)


def _grouped_allgather(bridge: Bridge, inplace: bool, sync: bool, tensors: Sequence[Any],
                       name: str | None, process_set: ProcessSet) -> tuple[Handle, Convert]:
    hosts, device = bridge.hosts(tensors, MOVE)
    h = grouped.grouped_allgather_async([x.array for x in hosts], name=name,
                                        process_set=process_set, device=device, sync=sync)
    return h, _many(bridge, hosts, False)


def _broadcast_proto(tensor: Any, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> None: ...


def _broadcast(bridge: Bridge, inplace: bool, sync: bool, tensor: Any, root_rank: int,
               name: str | None, process_set: ProcessSet) -> tuple[Handle, Convert]:
    host = bridge.host(tensor, MOVE)
    h = api.broadcast_async(host.array, root_rank, name=name, process_set=process_set,
                            inplace=inplace, device=host.device)
    return h, _one(bridge, host, inplace)


def _alltoall_proto(tensor: Any, splits: Any = None, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> None: ...


def _alltoall(bridge: Bridge, inplace: bool, sync: bool, tensor: Any, splits: Any,
              name: str | None, process_set: ProcessSet) -> tuple[Handle, Convert]:
    host = bridge.host(tensor, MOVE)
    h = api.alltoall_async(host.array, bridge.splits(splits), name=name,
                           process_set=process_set, device=host.device)

    def convert(result: tuple[np.ndarray, np.ndarray]) -> tuple[Any, Any]:
        out, received = result
        return bridge.result(host, out), bridge.received_splits(splits, received)

    return h, convert


def _reducescatter_proto(tensor: Any, name: str | None = None,
                         op: int | None = ReduceOp.Average,
                         process_set: ProcessSet = global_process_set,
                         prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> None: ...


def _reducescatter(bridge: Bridge, inplace: bool, sync: bool, tensor: Any, name: str | None,
                   op: int | None, process_set: ProcessSet, prescale_factor: float,
                   postscale_factor: float) -> tuple[Handle, Convert]:
    host = bridge.host(tensor, REDUCE)
    h = api.reducescatter_async(host.array, name=name, op=api.reducescatter_op(op),
                                prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, process_set=process_set,
                                device=host.device)
    return h, _one(bridge, host, False)


def _grouped_reducescatter(bridge: Bridge, inplace: bool, sync: bool, tensors: Sequence[Any],
                           name: str | None, op: int | None, process_set: ProcessSet,
                           prescale_factor: float,
                           postscale_factor: float) -> tuple[Handle, Convert]:
    hosts, device = bridge.hosts(tensors, REDUCE)
    h = grouped.grouped_reducescatter_async([x.array for x in hosts], name=name,
                                            op=api.reducescatter_op(op),
                                            prescale_factor=prescale_factor,
                                            postscale_factor=postscale_factor,
                                            process_set=process_set, device=device)
    return h, _many(bridge, hosts, False)


def _grouped(proto: Callable[..., Any]) -> Callable[..., Any]:
    """The grouped form's prototype: ``tensors`` in place of ``tensor``."""
    sig = inspect.signature(proto)
    params = list(sig.parameters.values())
    params[0] = params[0].replace(name="tensors")

    def grouped(*args: Any, **kwargs: Any) -> None: ...

    grouped.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return grouped


ALLREDUCE = OpForm("allreduce", _allreduce_proto, _allreduce,
                   "Reduce ``tensor`` element-wise across the process set: ``postscale * "
                   "op(prescale * x_i)`` (default op Average; integer Average truncates). "
                   "``average`` is deprecated (True: Average, False: Sum).")
GROUPED_ALLREDUCE = OpForm("grouped_allreduce", _grouped(_allreduce_proto), _grouped_allreduce,
                           "Allreduce a list of tensors as one group (names "
                           "``<name>_<i>of<n>``); the result is the list of results.")
ALLGATHER = OpForm("allgather", _allgather_proto, _allgather,
                   "Concatenate every member's tensor along dimension 0 in set rank order "
                   "(first dimensions may differ, the others must agree).")
GROUPED_ALLGATHER = OpForm("grouped_allgather", _grouped(_allgather_proto), _grouped_allgather,
                           "Allgather each tensor of a list; the result is the list.")
BROADCAST = OpForm("broadcast", _broadcast_proto, _broadcast,
                   "Copy ``root_rank``'s tensor (a global rank, member of the set) to every "
                   "member; shape, dtype and root must agree on every rank.")
ALLTOALL = OpForm("alltoall", _alltoall_proto, _alltoall,
                  "Send ``splits[j]`` rows of dimension 0 to set member ``j`` (an even split "
                  "when ``splits`` is None); the result is ``(received, received_splits)``.")
REDUCESCATTER = OpForm("reducescatter", _reducescatter_proto, _reducescatter,
                       "Reduce (Sum or Average) across the set, then keep this rank's share of "
                       "dimension 0 (the first ``dim0 % size`` members get one extra row).")
GROUPED_REDUCESCATTER = OpForm("grouped_reducescatter", _grouped(_reducescatter_proto),
                               _grouped_reducescatter,
                               "Reducescatter each tensor of a list; the result is the list of "
                               "this rank's shares.")


# ---- spellings ----------------------------------------------------------------------------------
def register(handle: Handle, convert: Convert) -> int:
    """Put ``handle`` in the process's integer handle table; ``synchronize`` returns
    ``convert(result)``."""
    return int(_context.get("handles").handles.add(DerivedHandle(handle, convert)))


def run(bridge: Bridge, family: OpForm, *args: Any, inplace: bool = False) -> Any:
    """Run ``family`` and wait (the caller is the waiter: the fast lane lets it drive the op);
    for adapters' own wrappers (e.g. differentiable forms)."""
    handle, convert = family.submit(bridge, inplace, True, *args)
    return convert(handle.wait())


_FORM_DOCS = {
    (False, True): "Waits and returns the result.",
    (True, True): "In place: the result is written into the input, which is returned.",
    (False, False): "Returns a handle for ``poll`` / ``synchronize`` (which gives the result).",
    (True, False): "In place, asynchronous: returns a handle; ``synchronize`` gives the input "
                   "with the result written into it.",
}


def spell(bridge: Bridge, family: OpForm, public: str, *, inplace: bool, wait: bool,
          module: str = "") -> Callable[..., Any]:
    """The public function ``public`` for ``family`` through ``bridge``: Horovod's signature,
    compiled, calling ``family.submit`` and then waiting (``wait``) or registering a handle."""
    sig = inspect.signature(family.prototype)
    names = list(sig.parameters)
    defaults = {f"_default_{p.name}": p.default for p in sig.parameters.values()
                if p.default is not inspect.Parameter.empty}
    params = ", ".join(f"{p.name}=_default_{p.name}"
                       if p.default is not inspect.Parameter.empty else p.name
                       for p in sig.parameters.values())
    call = f"_submit(_bridge, {inplace}, {wait}, {', '.join(names)})"
    if wait:
        body = f"    handle, convert = {call}\n    return convert(handle.wait())\n"
    else:
        body = f"    return _register(*{call})\n"
    namespace: dict[str, Any] = {"_submit": family.submit, "_bridge": bridge,
                                 "_register": register, **defaults}
    exec(f"def {public}({params}):\n{body}", namespace)  # noqa: S102 - our own source
    fn: Callable[..., Any] = namespace[public]
    fn.__doc__ = f"{family.doc}\n\n{_FORM_DOCS[(inplace, wait)]}"
    fn.__module__ = module or fn.__module__
    fn.__qualname__ = public
    return fn


__all__ = ["ALLGATHER", "ALLREDUCE", "ALLTOALL", "BROADCAST", "GROUPED_ALLGATHER",
           "GROUPED_ALLREDUCE", "GROUPED_REDUCESCATTER", "MOVE", "REDUCE", "REDUCESCATTER",
           "Bridge", "OpForm", "TensorView", "allreduce_unit", "register", "run", "spell"]
