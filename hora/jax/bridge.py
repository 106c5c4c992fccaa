"""JAX arrays <-> the core's host buffers, eagerly and inside ``jax.jit`` / ``jax.grad``.

Every collective of :mod:`hora.jax` is a function over numpy arrays (the core's one definition
of the op, run through :data:`HOST`, a :class:`~hora.core.frontend.host_bridge.HostBridge` with
JAX's dtype tables) handed to :func:`apply`:

* **eagerly** (concrete arrays), the leaves' host values are handed over (``np.asarray``: no
  copy for CPU arrays) and the results come back as ``jax.Array``;
* **traced** (``jit``, ``grad``, ``vmap``, ``scan``...), the call becomes one host call of the
  program whose output shapes are fixed at trace time (:mod:`hora.jax.host_call`, an XLA FFI
  custom call, on CPU; ``jax.pure_callback`` elsewhere), wrapped in a ``jax.custom_vjp`` whose
  backward pass is another host call running the rule of :mod:`hora.core.frontend.gradients`.
  Op names are chosen at trace time, so ranks pair the ops of a compiled step by name whatever
  order XLA runs the calls in, and a step that repeats keeps its names (the fast lane's steady
  state). Under ``vmap`` the call runs once per batch element (``vmap_method="sequential"``):
  the collective of each element, in order.

Both host calls are pure (no effect token): ordering across ranks comes from the trace-time
names, not from an effect token, so a call composes with ``vmap``, and a call whose result is
unused is removed by XLA on every rank alike. ``pure_callback`` costs less per call than
``io_callback(ordered=True)`` and the FFI host call less again (no operand copy, results copied
straight into XLA's buffers, or written there by the collective itself); the figures are in
docs/jax.md and docs/benchmarks.md ("Measurements behind the code's constants").
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hora.core.frontend import op_forms as _sp
from hora.core.frontend.host_bridge import HostBridge
from hora.jax import host_call

# Horovod's tables for the torch binding (JAX has no Horovod binding); bfloat16 via ml_dtypes.
REDUCE_DTYPES = frozenset(np.dtype(d) for d in (
    jnp.int32, jnp.int64, jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))
"""Dtypes accepted by allreduce, grouped_allreduce, reducescatter and their variants."""
MOVE_DTYPES = REDUCE_DTYPES | frozenset(np.dtype(d) for d in (jnp.uint8, jnp.int8, jnp.int16,
                                                              jnp.bool_))
"""Dtypes accepted by allgather, broadcast and alltoall."""
_TABLES = {_sp.REDUCE: REDUCE_DTYPES, _sp.MOVE: MOVE_DTYPES}

try:  # the jitted function's tracer type (:func:`computed`); jax's internals
    from jax._src.interpreters import partial_eval as _pe
except ImportError:  # another jax: no value is known to be computed (nothing aliased)
    _pe = None  # type: ignore[assignment]

HostFn = Callable[[list[np.ndarray]], list[np.ndarray]]


class _JaxHost(HostBridge):
    """The core's side of this adapter: host arrays checked against JAX's tables."""

    def check(self, array: np.ndarray, table: str) -> None:
        if array.dtype not in _TABLES[table]:
            allowed = ", ".join(sorted(d.name for d in _TABLES[table]))
            raise ValueError(f"Tensor type {array.dtype.name} is not supported. Allowed here: "
                             f"{allowed}.")


HOST = _JaxHost()
"""The bridge every collective of :mod:`hora.jax` runs through (on host arrays)."""


def check_leaf(leaf: Any, table: str, what: str) -> jax.ShapeDtypeStruct:
    """The shape and dtype of a leaf (array, tracer, numpy array or Python scalar), checked
    against ``table``. Raises ValueError naming ``what`` (the leaf's path)."""
    dtype = np.dtype(getattr(leaf, "dtype", None) or jnp.asarray(leaf).dtype)
    if dtype not in _TABLES[table]:
        allowed = ", ".join(sorted(d.name for d in _TABLES[table]))
        raise ValueError(f"Tensor type {dtype.name} is not supported ({what}). Allowed here: "
                         f"{allowed}.")
    return jax.ShapeDtypeStruct(np.shape(leaf), dtype)


def is_traced(leaves: Sequence[Any]) -> bool:
    """True when any leaf is a tracer (inside ``jit``, ``grad``, ``vmap``...)."""
    return any(map(isinstance, leaves, itertools.repeat(jax.core.Tracer)))


def computed(leaf: Any) -> bool:
    """True when ``leaf`` is a value the jitted function being traced computes (not one of
    its arguments or constants): XLA can alias it to a host call's result without a copy.
    False whenever that cannot be told (other traces, another jax's internals)."""
    try:
        if not isinstance(leaf, _pe.DynamicJaxprTracer):
            return False
        var, frame = leaf.val, leaf._trace.frame
        return not any(var is v for v in frame.invars) and var not in frame.constvar_to_val
    except (AttributeError, TypeError):
        return False


def to_host(leaf: Any) -> np.ndarray:
    """A concrete leaf's values in host memory (a view for CPU arrays)."""
    if isinstance(leaf, np.ndarray):
        return leaf
    return np.asarray(leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf))


def _adopter() -> Callable[[np.ndarray], jax.Array]:
    """``jax.device_put(x, may_alias=True)`` where this jax has it, else ``jnp.asarray``
    (decided from the signature: touching a device here would start JAX's backend at import)."""
    if "may_alias" not in inspect.signature(jax.device_put).parameters:
        return jnp.asarray

    def adopt(array: np.ndarray) -> jax.Array:
        return jax.device_put(array, may_alias=True)
    return adopt


_adopt = _adopter()


def to_jax(array: np.ndarray) -> jax.Array:
    """A core result as a ``jax.Array`` of JAX's dtype (as ``jnp.asarray``). On the CPU, XLA
    adopts the array's memory without a copy when it is 64-byte aligned, which the core's fresh
    results are (:mod:`hora.core.data.aligned`); the caller must not write to ``array``
    afterwards."""
    return _adopt(array)


def eager_only(what: str, leaves: Sequence[Any]) -> None:
    """Raise a clear error when ``what`` (an op that cannot live in a traced program) is
    called on tracers."""
    if is_traced(leaves):
        raise TypeError(f"hora.jax.{what} cannot be called inside jax.jit/grad/vmap (it "
                        "returns a handle or a Python object, or has no result to keep it "
                        "alive); call it outside the traced function, or use the synchronous "
                        "form there.")


def _callback(fn: Callable[..., list[np.ndarray]], specs: Sequence[jax.ShapeDtypeStruct],
              xs: Sequence[Any], pieces: Sequence[tuple[int, int]] | None = None,
              aliases: dict[int, int | None] | None = None,
              into: bool | Sequence[int] = False) -> list[Any]:
    """``fn`` as one host call of the traced program: :mod:`hora.jax.host_call` (an FFI custom
    call, CPU) or ``jax.pure_callback``; ``pieces``, ``aliases`` (FFI only) and ``into`` as in
    :func:`hora.jax.host_call.call` (through ``pure_callback``, an ``into`` function gets
    ``None`` for its outputs and makes its own)."""
    if host_call.available():
        return host_call.call(fn, specs, xs, pieces, into=into, aliases=aliases)

    def host(*arrays: np.ndarray) -> list[np.ndarray]:
        ins = [np.asarray(a) for a in arrays]
        outs = fn(ins, None) if into is not False else fn(ins)
        if pieces is not None:
            outs = _cut(outs, pieces, specs)
        return [np.asarray(o, dtype=s.dtype).reshape(s.shape) if o.shape != s.shape or
                o.dtype != s.dtype else o for o, s in zip(outs, specs)]

    return list(jax.pure_callback(host, list(specs), *xs, vmap_method="sequential"))


def _cut(buffers: list[np.ndarray], pieces: Sequence[tuple[int, int]],
         specs: Sequence[jax.ShapeDtypeStruct]) -> list[np.ndarray]:
    """The results ``pieces`` describes, as views of ``buffers``."""
    raw = [np.ascontiguousarray(b).reshape(-1).view(np.uint8) for b in buffers]
    out = []
    for (b, offset), s in zip(pieces, specs):
        dtype = np.dtype(s.dtype)
        n = int(np.prod(s.shape)) * dtype.itemsize
        out.append(raw[b][offset:offset + n].view(dtype).reshape(s.shape))
    return out


def _checked(fn: HostFn, specs: Sequence[jax.ShapeDtypeStruct], what: str) -> HostFn:
    """``fn`` whose results must have the shapes fixed at trace time."""
    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        outs = fn(arrays)
        for o, s in zip(outs, specs):
            if tuple(o.shape) != tuple(s.shape):
                raise ValueError(
                    f"hora.jax.{what} inside jax.jit: the result has shape {tuple(o.shape)} "
                    f"but shape {tuple(s.shape)} was fixed when the function was traced "
                    "(jit needs static shapes: every rank must pass the same first dimension "
                    "to this op, or call it outside jit).")
        return outs
    return run


def apply(what: str, leaves: Sequence[Any], forward: HostFn,
          out_specs: Sequence[jax.ShapeDtypeStruct], backward: HostFn | None,
          grad_specs: Sequence[jax.ShapeDtypeStruct] | None = None,
          cotangents: Callable[[list[Any]], list[Any]] | None = None,
          pieces: Sequence[tuple[int, int]] | None = None,
          aliases: dict[int, int | None] | None = None,
          into: Callable[..., list[np.ndarray]] | None = None,
          views: Sequence[int] | None = None) -> list[Any]:
    """Run ``forward`` on ``leaves``: eagerly, or as a host call when traced, differentiable
    through ``backward`` (cotangents of the outputs -> cotangents of the inputs, shaped like
    ``grad_specs``, the inputs' shapes by default) when every leaf is floating point.
    ``cotangents`` (traced) maps the outputs' cotangents to ``backward``'s operands (e.g. packs
    them into the inputs' buffers); by default they are its operands. With ``pieces`` (traced
    only) ``forward`` returns buffers and output ``k`` is cut out of them at
    ``pieces[k] = (buffer, byte offset)``; with ``aliases`` too, the FFI host call hands
    ``forward`` the aliased operands as writable buffers it may reduce in place (see
    :func:`hora.jax.host_call.call`; only when :func:`hora.jax.host_call.available`).
    ``into`` (traced only): ``forward``'s form that writes its results into the host call's
    result buffers, ``into(arrays, outputs)`` (``outputs`` None where the host call has none
    to lend), used instead of ``forward`` when given; ``views``: the results it gets views of
    (default all)."""
    if not is_traced(leaves):
        return [to_jax(o) for o in forward([to_host(x) for x in leaves])]
    fwd_fn: Callable[..., list[np.ndarray]]
    if into is not None:
        fwd_fn = into
    else:
        fwd_fn = forward if pieces is not None else _checked(forward, out_specs, what)
    xs = [jnp.asarray(x) for x in leaves]
    wanted: bool | Sequence[int] = (into is not None) if views is None or into is None \
        else views
    in_specs = list(grad_specs) if grad_specs is not None else [
        jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs]
    floating = all(jnp.issubdtype(x.dtype, jnp.inexact) for x in xs)
    if backward is None or not floating:
        return _callback(fwd_fn, out_specs, xs, pieces, aliases, wanted)
    bwd_fn = _checked(backward, in_specs, f"{what} (gradient)")

    @jax.custom_vjp
    def op(*inputs: Any) -> list[Any]:
        return _callback(fwd_fn, out_specs, inputs, pieces, aliases, wanted)

    def op_fwd(*inputs: Any) -> tuple[list[Any], None]:
        return op(*inputs), None

    def op_bwd(_: None, cts: list[Any]) -> tuple[Any, ...]:
        return tuple(_callback(bwd_fn, in_specs, cotangents(cts) if cotangents else cts))

    op.defvjp(op_fwd, op_bwd)
    out: list[Any] = op(*xs)
    return out


__all__ = ["HOST", "MOVE_DTYPES", "REDUCE_DTYPES", "apply", "check_leaf", "computed", "eager_only",
           "is_traced", "to_host", "to_jax"]
