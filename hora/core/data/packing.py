"""Many arrays as one buffer per dtype: element-wise collectives on a whole tree in one op.

An allreduce is element-wise: how the elements are laid out does not change the result, so a
list of arrays (a pytree's leaves, a model's gradients) can be reduced as one flat buffer per
dtype instead of one op per array. Each op costs tens of microseconds of Python in the core
(request, handle, negotiation or the fast lane's log), so a 100-leaf tree as 100 ops costs
milliseconds more than as one; packing costs one copy in and one out.

The packed buffers' shapes are what the ranks validate, so ranks whose arrays differ in shape
but not in total size would pair silently: callers name each packed op with a tag of the
shapes (:func:`layout_tag`) so that such ranks do not meet, and report the difference.
Framework-neutral: :class:`Layout` plans the packing (an adapter may concatenate in its own
framework, as :mod:`hora.jax` does, inside ``jit`` too); :func:`pack` / :func:`unpack` do it on
numpy arrays.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PACK_BELOW = 128 * 1024
"""Arrays of at least this many bytes are not packed: one op costs ~50-100 us of Python in the
core, about what copying 128 KiB in and out costs, so packing only pays below it."""


@dataclass(frozen=True)
class Layout:
    """Where each array goes: ``groups[k]`` lists the arrays packed into buffer ``k`` (one per
    dtype for small arrays, in order of first appearance, then one per large array),
    ``offsets[k]`` where each starts in it (and, last, its end), ``sizes[k]`` its length,
    ``tag`` a short rank-independent tag of the shapes and dtypes (for op names)."""

    groups: tuple[tuple[int, ...], ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    offsets: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]
    tag: str

    @classmethod
    def of(cls, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[np.dtype],
           pack_below: int = PACK_BELOW) -> Layout:
        """Arrays under ``pack_below`` bytes share one buffer per dtype; larger ones keep a
        buffer each (their copy would cost more than the op it saves)."""
        shapes = [tuple(int(d) for d in s) for s in shapes]
        dts = [np.dtype(d) for d in dtypes]
        counts = [math.prod(s) for s in shapes]
        order: dict[np.dtype, list[int]] = {}
        alone: list[tuple[int, ...]] = []
        for i, dt in enumerate(dts):
            if counts[i] * dt.itemsize >= pack_below:
                alone.append((i,))
            else:
                order.setdefault(dt, []).append(i)
        groups = tuple(tuple(idx) for idx in order.values()) + tuple(alone)
        offsets = []
        for idx in groups:
            starts = [0]
            for i in idx:
                starts.append(starts[-1] + counts[i])
            offsets.append(tuple(starts))
        text = ";".join(f"{d.str}{s}" for d, s in zip(dts, shapes))
        return cls(groups, tuple(shapes), tuple(dts), tuple(offsets),
                   tuple(o[-1] for o in offsets), f"p{zlib.crc32(text.encode()):08x}")


def pack(arrays: Sequence[np.ndarray], pack_below: int = PACK_BELOW,
         layout: Layout | None = None) -> tuple[list[np.ndarray], Layout]:
    """Contiguous 1-D buffers (see :meth:`Layout.of`; ``layout`` if already made for these
    arrays), and the layout to :func:`unpack` results with. A buffer of one array is that
    array's flat view (no copy)."""
    if layout is None:
        layout = Layout.of([a.shape for a in arrays], [a.dtype for a in arrays], pack_below)
    buffers = []
    for idx in layout.groups:
        if len(idx) == 1:
            buffers.append(np.ascontiguousarray(arrays[idx[0]]).reshape(-1))
        else:
            buffers.append(np.concatenate([np.asarray(arrays[i]).reshape(-1) for i in idx]))
    return buffers, layout


def unpack(buffers: Sequence[np.ndarray], layout: Layout) -> list[np.ndarray]:
    """The arrays of ``layout`` cut out of ``buffers`` (views, no copy)."""
    out: list[np.ndarray] = [np.empty(0)] * len(layout.shapes)
    for buf, idx, starts in zip(buffers, layout.groups, layout.offsets):
        for k, i in enumerate(idx):
            out[i] = buf[starts[k]:starts[k + 1]].reshape(layout.shapes[i])
    return out


def layout_tag(layout: Layout) -> str:
    """A short rank-independent tag of the shapes and dtypes (for op names)."""
    return layout.tag


__all__ = ["Layout", "layout_tag", "pack", "unpack"]
