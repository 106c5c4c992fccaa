"""``horovod.tensorflow.util``: the small helpers Horovod's TensorFlow code and tests import.

``_executing_eagerly()`` is False inside ``tf.function`` and in ``tf.compat.v1`` graphs;
``_make_subgraph(f)`` is ``tf.function(f)``; ``_cache(f)`` memoizes ``f`` per arguments and
mode (eager or graph), for ops that should be built once per mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

_has_eager = True
"""Eager execution exists (always, on TensorFlow 2)."""


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs ops eagerly here (False while a graph is being built)."""
    return bool(tf.executing_eagerly())


def _make_subgraph(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` compiled as one graph function."""
    return tf.function(f)


def _cache(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` memoized on its (hashable) positional arguments and the execution mode."""
    results: dict[tuple[Any, ...], Any] = {}

    def wrapper(*args: Any) -> Any:
        key = (args, _executing_eagerly())
        if key not in results:
            results[key] = f(*args)
        return results[key]

    return wrapper


def vars_to_refs(variables: Any) -> list[Any]:
    """Hashable references of ``variables`` (``v.ref()``; Keras 3 variables are hashable as
    they are)."""
    return [v.ref() if hasattr(v, "ref") else v for v in variables]


def refs_to_vars(refs: Any) -> list[Any]:
    """The variables behind :func:`vars_to_refs`' references."""
    return [r.deref() if hasattr(r, "deref") else r for r in refs]


__all__ = ["_cache", "_executing_eagerly", "_has_eager", "_make_subgraph", "refs_to_vars",
           "vars_to_refs"]
