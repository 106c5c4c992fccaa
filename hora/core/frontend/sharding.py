"""Shard planning for the sharded (ZeRO-style) optimizers of every adapter (hora-only).

A sharded optimizer keeps the optimizer state of each trainable parameter on one member of the
process set only (its *owner*). Each step, the gradients are reduce-scattered so that every
owner receives the averaged gradients of its parameters, each member steps the wrapped
optimizer on the parameters it owns, and the new values (or updates) are allgathered. The
decisions that are not framework-specific live here, once for torch, JAX and Keras:

* :func:`plan` assigns parameters (the unit: one parameter is never split) to shards, balanced
  by bytes (largest first, each to the least-loaded shard; deterministic, so every member
  computes the same plan from the same shapes);
* :func:`split_plan` does the same over the parameters' flattened bytes, splitting a
  parameter at element boundaries where it does not fit (for elementwise optimizers: every
  shard holds ``1/size`` of the bytes even when one parameter dominates); its pieces are the
  units that :func:`layout` places;
* :func:`layout` places the parameters of each bucket (one per dtype, or any key the adapter
  chooses) in a ``[size, width]`` buffer: row ``s`` holds shard ``s``'s parameters end to end,
  zero-padded to the widest row. A reduce-scatter of that buffer gives member ``s`` row ``s``
  (Horovod's reducescatter splits dimension 0 evenly), and an allgather of each member's
  ``[1, width]`` row rebuilds it: the same bytes on the wire as one allreduce, plus padding;
* :func:`merge_states` / :func:`select_states` map between the full optimizer state (one entry
  per parameter index, as in a checkpoint) and a member's shard, so a checkpoint written at one
  size loads at another.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

V = TypeVar("V")


@dataclass(frozen=True)
class Plan:
    """Which shard owns each parameter.

    Attributes:
        size: number of shards (the process set's size).
        owner: ``owner[i]`` is the shard (set rank) that owns parameter ``i``.
        nbytes: the bytes of each parameter, as planned.
    """

    size: int
    owner: tuple[int, ...]
    nbytes: tuple[int, ...]

    def owned(self, shard: int) -> list[int]:
        """Indices of the parameters ``shard`` owns, in parameter order."""
        return [i for i, s in enumerate(self.owner) if s == shard]

    def loads(self) -> list[int]:
        """Bytes owned by each shard."""
        out = [0] * self.size
        for i, s in enumerate(self.owner):
            out[s] += self.nbytes[i]
        return out

    def imbalance(self) -> float:
        """The largest shard's bytes over the ideal ``total / size`` (1.0 is perfect)."""
        total = sum(self.nbytes)
        return max(self.loads()) * self.size / total if total else 1.0


def plan(nbytes: Sequence[int], size: int) -> Plan:
    """Assign parameters of ``nbytes`` bytes to ``size`` shards, balanced by bytes.

    Largest parameter first (ties: lower index first), each to the shard with the fewest bytes
    so far (ties: lower shard). A parameter is never split, so one parameter larger than
    ``total / size`` makes its owner hold more than its share.

    Raises:
        ValueError: ``size`` < 1 or a negative size.
    """
    if size < 1:
        raise ValueError(f"a shard plan needs size >= 1, got {size}")
    if any(n < 0 for n in nbytes):
        raise ValueError("parameter sizes must be >= 0 bytes")
    owner = [0] * len(nbytes)
    loads = [0] * size
    for i in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        target = min(range(size), key=lambda s: (loads[s], s))
        owner[i] = target
        loads[target] += nbytes[i]
    return Plan(size, tuple(owner), tuple(int(n) for n in nbytes))


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + numel)`` of parameter ``index`` (flattened): the unit of a
    split plan (a whole parameter is one piece)."""

    index: int
    start: int
    numel: int


def split_plan(numels: Sequence[int], itemsizes: Sequence[int], size: int,
               splittable: Sequence[bool] | None = None) -> tuple[Plan, list[Piece]]:
    """Assign the parameters' flattened bytes to ``size`` shards, splitting a parameter at
    element boundaries only where it does not fit: every shard holds at most
    ``ceil(total / size)`` bytes (plus less than one element per shard, and the excess of an
    unsplittable parameter).

    Largest parameter first (ties: lower index), each to the shard with the fewest bytes so far
    (ties: lower shard), whole if it fits under the cap; otherwise that shard is filled up to
    the cap with the parameter's next elements and the rest goes on to the next least-loaded
    shard. So every parameter stays whole but the ones larger than a shard's room (at most
    ``size - 1`` parameters are split), and a parameter's pieces are contiguous, in order,
    each on its own shard.

    Returns:
        a :class:`Plan` over the pieces (``owner[j]``, ``nbytes[j]`` of piece ``j``) and the
        pieces, ordered by (parameter, start).

    Raises:
        ValueError: ``size`` < 1, a negative size, or lengths that differ.
    """
    if size < 1:
        raise ValueError(f"a shard plan needs size >= 1, got {size}")
    if len(itemsizes) != len(numels) or (splittable is not None
                                         and len(splittable) != len(numels)):
        raise ValueError("numels, itemsizes and splittable must have one entry per parameter")
    if any(n < 0 for n in numels) or any(i < 1 for i in itemsizes):
        raise ValueError("parameter sizes must be >= 0 elements of >= 1 byte")
    nbytes = [int(n) * int(i) for n, i in zip(numels, itemsizes)]
    cap = -(-sum(nbytes) // size)
    loads = [0] * size
    placed: list[tuple[Piece, int]] = []
    for i in sorted(range(len(numels)), key=lambda i: (-nbytes[i], i)):
        item, left, start = int(itemsizes[i]), int(numels[i]), 0
        can_split = splittable is None or bool(splittable[i])
        while True:
            target = min(range(size), key=lambda s: (loads[s], s))
            room = (cap - loads[target]) // item
            if left <= room or not can_split or room <= 0:
                if room <= 0 and can_split and start > 0:  # rounding: extend the last piece
                    last, shard = placed.pop()
                    placed.append((Piece(i, last.start, last.numel + left), shard))
                    loads[shard] += left * item
                else:
                    placed.append((Piece(i, start, left), target))
                    loads[target] += left * item
                break
            placed.append((Piece(i, start, room), target))
            loads[target] += room * item
            start += room
            left -= room
    placed.sort(key=lambda t: (t[0].index, t[0].start))
    pieces = [piece for piece, _ in placed]
    the_plan = Plan(size, tuple(shard for _, shard in placed),
                    tuple(piece.numel * int(itemsizes[piece.index]) for piece in pieces))
    return the_plan, pieces


def chunk(the_plan: Plan, pieces: Sequence[Piece], itemsizes: Sequence[int],
          max_bytes: int) -> tuple[Plan, list[Piece]]:
    """Cut every piece of ``split_plan`` larger than ``max_bytes`` into consecutive pieces of
    at most ``max_bytes`` (at least one element each), on the same shard: so that no bucket's
    row (:func:`layout` with ``max_row_bytes``) has to hold more than the cap."""
    owner: list[int] = []
    out: list[Piece] = []
    for piece, shard in zip(pieces, the_plan.owner):
        step = max(1, max_bytes // int(itemsizes[piece.index]))
        start, end = piece.start, piece.start + piece.numel
        while True:
            n = min(step, end - start)
            out.append(Piece(piece.index, start, n))
            owner.append(shard)
            start += n
            if start >= end:
                break
    nbytes = tuple(p.numel * int(itemsizes[p.index]) for p in out)
    return Plan(the_plan.size, tuple(owner), nbytes), out


@dataclass(frozen=True)
class Slot:
    """Where parameter ``index`` sits in its bucket: row ``shard``, elements
    ``[offset, offset + numel)``."""

    index: int
    shard: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    """One ``[size, width]`` buffer: every parameter whose bucket key is ``key``."""

    key: Hashable
    width: int
    slots: tuple[Slot, ...] = field(default=())

    def row(self, shard: int) -> list[Slot]:
        """The slots of row ``shard`` (the parameters that shard owns in this bucket)."""
        return [s for s in self.slots if s.shard == shard]


def layout(the_plan: Plan, numels: Sequence[int], keys: Sequence[Hashable],
           max_row_bytes: int | None = None, itemsizes: Sequence[int] | None = None
           ) -> list[Bucket]:
    """Place every parameter in a bucket of its key (keys in order of first appearance): in
    its owner's row, after the earlier parameters of that row; a bucket's width is its longest
    row (at least 1 element, so every collective has a non-empty tensor).

    With ``max_row_bytes`` (and each parameter's ``itemsizes``), a key's parameters are spread
    over several buckets that fill every shard's row side by side (each row takes its owner's
    next parameters, in order, up to the cap; at least one), so that a bucket's rows stay about
    equally long and a bucket at a time bounds the memory of the packed buffers.
    """
    order: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        order.setdefault(key, []).append(i)
    buckets = []
    for key, members in order.items():
        if max_row_bytes is None:
            queues = [[i for i in members if the_plan.owner[i] == s]
                      for s in range(the_plan.size)]
            buckets.append(_bucket(key, queues, numels))
            continue
        sizes = itemsizes if itemsizes is not None else [1] * len(numels)
        queues = [[i for i in members if the_plan.owner[i] == s]
                  for s in range(the_plan.size)]
        while any(queues):
            rows: list[list[int]] = []
            for q in queues:
                row: list[int] = []
                used = 0
                while q and (not row or used + numels[q[0]] * sizes[q[0]] <= max_row_bytes):
                    used += numels[q[0]] * sizes[q[0]]
                    row.append(q.pop(0))
                rows.append(row)
            buckets.append(_bucket(key, rows, numels))
    return buckets


def _bucket(key: Hashable, rows: Sequence[Sequence[int]], numels: Sequence[int]) -> Bucket:
    slots = []
    width = 1
    for shard, row in enumerate(rows):
        fill = 0
        for i in row:
            slots.append(Slot(i, shard, fill, int(numels[i])))
            fill += int(numels[i])
        width = max(width, fill)
    return Bucket(key, width, tuple(sorted(slots, key=lambda s: s.index)))


def padding_ratio(buckets: Iterable[Bucket], size: int) -> float:
    """Elements moved (``size * width`` per bucket) over the parameters' elements."""
    buckets = list(buckets)
    moved = sum(size * b.width for b in buckets)
    real = sum(s.numel for b in buckets for s in b.slots)
    return moved / real if real else 1.0


def shard_of(ranks: Sequence[int], rank: int) -> int | None:
    """This process's shard: its position in the set's ``ranks`` (None if not a member)."""
    try:
        return list(ranks).index(rank)
    except ValueError:
        return None


def merge_states(parts: Iterable[Mapping[int, V]]) -> dict[int, V]:
    """The full state (parameter index -> state) from every member's shard, in index order.

    Raises:
        ValueError: two members hold state for the same parameter.
    """
    out: dict[int, V] = {}
    for part in parts:
        for index, value in part.items():
            if index in out:
                raise ValueError(f"two shards hold optimizer state for parameter {index}")
            out[int(index)] = value
    return dict(sorted(out.items()))


def select_states(full: Mapping[Any, V], owned: Iterable[int]) -> dict[Any, V]:
    """The entries of ``full`` (keyed by parameter index, int or str) for the ``owned``
    parameters: a member's shard of a full state written at any size."""
    wanted = set(owned)
    return {k: v for k, v in full.items() if int(k) in wanted}


__all__ = ["Bucket", "Piece", "Plan", "Slot", "chunk", "layout", "merge_states",
           "padding_ratio", "plan", "select_states", "shard_of", "split_plan"]
