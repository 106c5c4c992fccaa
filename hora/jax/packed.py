"""A pytree's allreduce as one buffer per dtype (:mod:`hora.core.data.packing`): one core op for
the whole tree, and as little work per leaf as JAX allows.

What a leaf costs is JAX's, not the collective's: making one ``jax.Array`` from host memory
costs ~20 µs (``jnp.asarray``), a jitted function's output a few µs, a ``pure_callback``
result ~3 µs of Python. So every tree shape gets a cached :class:`Plan` (keyed by the leaves'
shapes and dtypes: the dtype checks, the layout and the functions below are made once):

* eagerly, the small leaves are concatenated by one jitted function (one dispatch), the core
  reduces the host buffers (in place when every buffer is such a concatenation: hora's own
  memory, so the core neither copies it nor allocates a result; measured ~10-20 % less time
  for a 100-leaf tree on 2 ranks), and one jitted function whose only operation is a host call
  (:mod:`hora.jax.host_call`) copies each leaf's bytes out of the reduced buffers into its new
  array (one dispatch, ~1 µs a leaf, nothing per leaf to compile: a jitted split compiles for
  ~1 s at 100 leaves); large leaves go to the core as views and come back as one array each,
  as a single array would;
* traced (inside ``jit``), XLA concatenates the small leaves and one host call (one operand
  per packed group, and each large leaf as it is) reduces them and copies every packed leaf
  out as its own result (``pieces``). With the FFI host call each concatenation is also
  aliased to an extra result, so the core reduces it in place (~20 % less time for the call
  in one process), and a large leaf that the jitted function computes (a gradient) is aliased
  to its own result: reduced in place, no copy and no fresh result pages (the optax step of
  benchmarks/step_overhead.py: the host call 2.5 -> 1.2-1.4 ms). A large leaf that is an
  argument of the jitted function is not aliased (XLA would copy it first, measured slower
  than the core's own copy): the core writes its result straight into XLA's result buffer.
  Cutting in XLA instead costs a kernel per leaf (compiled: ~1 s more to compile a 100-leaf
  tree; a slice does not fuse into every consumer), and its gradient pads every piece to the
  whole buffer; here the backward pass concatenates the cotangents and reduces them in one
  host call.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hora.core.data import packing as _packing
from hora.jax import host_call
from hora.jax.bridge import check_leaf, computed, to_host, to_jax

_PLANS: dict[tuple[Any, ...], Plan] = {}
_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")
_MAX_PLANS = 128


class Plan:
    """How one tree shape (leaves' shapes and dtypes) is packed, and the functions that do it.

    ``specs`` are the leaves' checked shapes and dtypes, ``layout`` the packing,
    ``packed`` the indices of the layout's groups of two or more leaves (concatenated; the
    other groups are one large leaf each, sent as a view)."""

    def __init__(self, specs: list[jax.ShapeDtypeStruct]) -> None:
        self.specs = specs
        self.layout = _packing.Layout.of([s.shape for s in specs],
                                         [np.dtype(s.dtype) for s in specs])
        self.packed = tuple(k for k, idx in enumerate(self.layout.groups) if len(idx) > 1)
        self._packed_leaves = [i for k in self.packed for i in self.layout.groups[k]]
        self.buffer_specs = [jax.ShapeDtypeStruct((n,), self.layout.dtypes[idx[0]])
                             for n, idx in zip(self.layout.sizes, self.layout.groups)]
        where = {i: (k, self.layout.offsets[k][j] * self.layout.dtypes[i].itemsize)
                 for k, idx in enumerate(self.layout.groups) for j, i in enumerate(idx)}
        self.pieces = [where[i] for i in range(len(specs))]
        """Where each leaf lies in the buffers: (buffer, byte offset)."""
        packed_index = {k: n for n, k in enumerate(self.packed)}
        self._packed_pieces = [(packed_index[where[i][0]], where[i][1])
                               for i in self._packed_leaves]
        self.concatenated = tuple(
            k for k in self.packed
            if sum(1 for a, b in zip(self.layout.offsets[k], self.layout.offsets[k][1:])
                   if b > a) > 1)
        """The packed groups of two or more non-empty leaves: a concatenation XLA cannot fold
        into one of the leaves, so its buffer is the call's own (aliased to a result, XLA
        copies nothing)."""
        self.owned = len(self.concatenated) == len(self.layout.groups)
        """Every buffer is such a concatenation: :meth:`host_buffers` are private and
        writable, so the op may reduce them in place."""
        self.lone = {k: idx[0] for k, idx in enumerate(self.layout.groups)
                     if k not in self.packed}
        """Buffer -> its one (large) leaf, for the groups that are not packed."""
        self.operand_specs = [specs[self.lone[k]] if k in self.lone else b
                              for k, b in enumerate(self.buffer_specs)]
        """The traced host call's operands: :meth:`operands`' shapes and dtypes."""
        self._lock = threading.Lock()
        self._result: list[np.ndarray] = []
        self._pack = jax.jit(self.concatenate)
        self._unpack = jax.jit(self._copy_out)

    # ---- traced (also the body of the eager jitted functions) ---------------------------
    def concatenate(self, leaves: Sequence[Any]) -> list[Any]:
        """The buffers of the packed groups: their leaves raveled and concatenated."""
        return [jnp.concatenate([jnp.ravel(leaves[i]) for i in self.layout.groups[k]])
                for k in self.packed]

    def buffers(self, leaves: Sequence[Any]) -> list[Any]:
        """Every group's buffer (traced leaves): packed groups concatenated, lone leaves
        raveled."""
        packed = iter(self.concatenate(leaves))
        return [next(packed) if k in self.packed else jnp.ravel(leaves[idx[0]])
                for k, idx in enumerate(self.layout.groups)]

    def operands(self, leaves: Sequence[Any]) -> list[Any]:
        """The traced host call's operands: packed groups concatenated, each lone leaf as it
        is (its own shape: it may be aliased to its result, which has that shape)."""
        packed = iter(self.concatenate(leaves))
        return [next(packed) if k in self.packed else leaves[self.lone[k]]
                for k in range(len(self.layout.groups))]

    def aliases(self, leaves: Sequence[Any]) -> dict[int, int | None]:
        """The FFI host call's aliases (operand -> result, None: an extra result) for traced
        ``leaves``: every concatenation (made for the call: the core reduces it in place), and
        each lone leaf the jitted function computes, a gradient (aliased to its own result:
        reduced in place, no copy, no fresh result pages). A lone leaf that is an argument is
        not (XLA would copy it first): the core writes its result into XLA's buffer."""
        aliases: dict[int, int | None] = dict.fromkeys(self.concatenated)
        aliases.update((k, i) for k, i in self.lone.items() if computed(leaves[i]))
        return aliases

    def views(self, buffers: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The leaves cut out of every group's host buffer (views)."""
        return _packing.unpack(buffers, self.layout)

    # ---- eager ----------------------------------------------------------------------------
    def host_buffers(self, leaves: Sequence[Any]) -> list[np.ndarray]:
        """Every group's buffer in host memory: one jitted concatenation of the packed
        groups, a flat view of each lone leaf."""
        packed = iter(jax.block_until_ready(self._pack(list(leaves))) if self.packed else [])
        return [_writable(next(packed)) if k in self.packed
                else to_host(leaves[idx[0]]).reshape(-1)
                for k, idx in enumerate(self.layout.groups)]

    def leaves(self, buffers: Sequence[np.ndarray]) -> list[Any]:
        """New ``jax.Array`` leaves holding ``buffers`` (the reduced groups' host buffers)."""
        out: list[Any] = [None] * len(self.specs)
        if self.packed:
            with self._lock:  # the callback reads the buffers from here (local work only)
                self._result = list(buffers)
                try:
                    pieces = self._unpack()
                    if pieces:  # one execution: every result is ready with the first
                        pieces[0].block_until_ready()
                finally:
                    self._result = []
            for i, piece in zip(self._packed_leaves, pieces):
                out[i] = piece
        for k, idx in enumerate(self.layout.groups):
            if k not in self.packed:
                out[idx[0]] = to_jax(buffers[k].reshape(self.specs[idx[0]].shape))
        return out

    def _copy_out(self) -> list[Any]:
        """(Jitted, no operands.) The packed leaves, copied by XLA out of the buffers that
        :meth:`leaves` holds."""
        specs = [self.specs[i] for i in self._packed_leaves]
        if host_call.available():
            return host_call.call(lambda _: [self._result[k] for k in self.packed], specs, [],
                                  self._packed_pieces)
        return list(jax.pure_callback(self._views, specs))

    def _views(self) -> list[np.ndarray]:
        views = self.views(self._result)
        return [views[i] for i in self._packed_leaves]


class _Owned:
    """The ``__array_interface__`` of a writable view of ``array``'s memory; keeps it alive."""

    def __init__(self, array: jax.Array) -> None:
        self.array = array
        self.__array_interface__ = {  # bytes: bfloat16's typestr would read back as void
            "data": (array.unsafe_buffer_pointer(), False), "shape": (array.nbytes,),
            "typestr": "|u1", "version": 3}


def _writable(array: jax.Array) -> np.ndarray:
    """A writable numpy view of a ready CPU ``array`` that this module made and no one else
    holds (a packed buffer: the op reduces it in place, which saves the core a copy and a
    buffer; the array itself is dropped once the leaves are copied out of the view)."""
    if all(d.platform == "cpu" for d in array.devices()):
        try:
            return np.asarray(_Owned(array)).view(array.dtype).reshape(array.shape)
        except Exception:  # noqa: BLE001 - no buffer pointer: the read-only view below
            pass
    return np.asarray(array)


def plan(leaves: Sequence[Any], table: str, kind: str,
         paths: Callable[[], list[str]]) -> Plan:
    """The cached :class:`Plan` of ``leaves``' shapes and dtypes; on first sight the dtypes
    are checked against ``table`` (ValueError naming the leaf's path, from ``paths()``)."""
    try:  # map with attrgetter: the loop in C (~10 µs less at 100 leaves)
        key = (table, tuple(map(_SHAPE, leaves)), tuple(map(_DTYPE, leaves)))
    except AttributeError:  # Python scalars among the leaves
        key = (table, tuple(map(np.shape, leaves)),
               tuple(getattr(x, "dtype", None) or type(x) for x in leaves))
    found = _PLANS.get(key)
    if found is not None:
        return found
    names = paths()
    specs = [check_leaf(x, table, f"{kind} leaf {p}") for x, p in zip(leaves, names)]
    made = Plan([jax.ShapeDtypeStruct(s.shape, jax.dtypes.canonicalize_dtype(s.dtype))
                 for s in specs])
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.pop(next(iter(_PLANS)))
    _PLANS[key] = made
    return made


__all__ = ["Plan", "plan"]
