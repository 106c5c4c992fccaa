"""Pytrees as groups of collectives: flattening, names, and the error when ranks disagree.

A pytree is one fused group (every leaf one member of a grouped op). Its op name carries a tag
of the tree's structure (``<base>.t<crc32 of the treedef>``), so ranks that pass differently
structured trees never pair their leaves silently: their ops do not meet, the core reports the
stall or mismatch on every rank, and :func:`diagnose` then compares the ranks' leaf lists
(one ``allgather_object``) and raises an error naming the first differing leaf path.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import numpy as np

from hora.core.engine import context as _context
from hora.core.frontend import objects as _objects
from hora.core.op.process_set import ProcessSet
from hora.errors import HoraInternalError, MismatchError

T = TypeVar("T")

_TAGS: dict[Any, str] = {}


@dataclass
class Flat:
    """A pytree's leaves and structure."""

    leaves: list[Any]
    treedef: Any

    @property
    def single(self) -> bool:
        """A bare array (not a container): Horovod's one-tensor op and name."""
        return bool(jax.tree_util.treedef_is_leaf(self.treedef))

    def tag(self) -> str:
        """A short, rank-independent tag of the structure."""
        tag = _TAGS.get(self.treedef)
        if tag is None:
            tag = _TAGS[self.treedef] = f"t{zlib.crc32(str(self.treedef).encode()):08x}"
        return tag

    def unflatten(self, leaves: list[Any]) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def paths(self) -> list[str]:
        leaves = jax.tree_util.tree_flatten_with_path(self.unflatten(self.leaves))[0]
        return [jax.tree_util.keystr(path) or "<root>" for path, _ in leaves]


def flatten(tree: Any) -> Flat:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return Flat(leaves, treedef)


def group_name(kind: str, name: str | None, flat: Flat, process_set: ProcessSet) -> str | None:
    """The op name of a collective over ``flat``: ``name`` as given for a single array (None:
    the core's automatic name), else ``<name or noname.n>.<structure tag>``."""
    if flat.single:
        return name
    engine = _context.get(kind).engine
    return f"{engine.names.base(kind, name, process_set.process_set_id or 0)}.{flat.tag()}"


def describe(flat: Flat) -> list[tuple[str, str]]:
    """``(path, dtype[shape])`` of every leaf."""
    out = []
    for path, leaf in zip(flat.paths(), flat.leaves):
        shape = ",".join(str(d) for d in np.shape(leaf))
        out.append((path, f"{np.dtype(getattr(leaf, 'dtype', np.asarray(leaf).dtype))}[{shape}]"))
    return out


def first_difference(kind: str, per_rank: list[list[tuple[str, str]]],
                     ranks: list[int]) -> str | None:
    """The message naming the first leaf on which the ranks' trees differ (None if equal)."""
    tables = [dict(d) for d in per_rank]
    order: list[str] = []
    for d in per_rank:
        order += [p for p, _ in d if p not in order]
    for path in order:
        seen = {r: t.get(path, "missing") for r, t in zip(ranks, tables)}
        if len(set(seen.values())) > 1:
            where = ", ".join(f"{v} on rank {r}" for r, v in seen.items())
            return (f"hora.jax.{kind}: ranks passed different pytrees: leaf {path} is {where}. "
                    "Every rank must pass a pytree of the same structure (same keys, shapes "
                    "and dtypes).")
    if any([p for p, _ in d] != [p for p, _ in per_rank[0]] for d in per_rank):
        return (f"hora.jax.{kind}: ranks passed pytrees whose leaves are in a different order "
                f"(rank {ranks[0]}: {[p for p, _ in per_rank[0]]}).")
    return None


def diagnose(kind: str, flat: Flat, process_set: ProcessSet,
             run: Callable[[], T]) -> T:
    """``run()``; if the collective fails on every rank (a HoraInternalError), compare the
    ranks' trees and raise :class:`MismatchError` naming the differing leaf, or re-raise."""
    try:
        return run()
    except HoraInternalError as exc:
        try:
            everyone = _objects.allgather_object(describe(flat), process_set=process_set)
        except HoraInternalError:
            raise exc from None
        ranks = list(process_set.ranks or range(len(everyone)))
        message = first_difference(kind, everyone, ranks)
        if message is None:
            raise
        raise MismatchError(message) from exc


__all__ = ["Flat", "describe", "diagnose", "first_difference", "flatten", "group_name"]
