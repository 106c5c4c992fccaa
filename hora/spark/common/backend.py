"""Horovod's ``horovod.spark.common.backend``: how an Estimator runs its training function.

:class:`SparkBackend` runs it with :func:`hora.spark.run` (one rank per Spark task, a barrier
stage); a custom :class:`Backend` can run it elsewhere (e.g. a cluster beside Spark).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hora._util.log import get_logger

log = get_logger(__name__)


def default_num_proc() -> int:
    """``spark.default.parallelism`` of the active SparkContext (Horovod's default)."""
    from hora.spark.runner import _active_context

    return int(_active_context().defaultParallelism)


class Backend:
    """Runs the distributed training function; returns each rank's result in rank order."""

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...] = (),
            kwargs: Mapping[str, Any] | None = None,
            env: Mapping[str, str] | None = None) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank with ``env`` added to its environment."""
        raise NotImplementedError

    def num_processes(self) -> int:
        """How many ranks :meth:`run` starts."""
        raise NotImplementedError


class SparkBackend(Backend):
    """Runs the training function with :func:`hora.spark.run`.

    Args:
        num_proc: number of ranks (default ``spark.default.parallelism``).
        env: variables for every rank, on top of its executor's environment (Horovod's default
            is the driver's whole environment; hora's ranks inherit their executor's, as
            :func:`hora.spark.run` documents).
        **kwargs: more arguments for :func:`hora.spark.run` (``stdout``, ``stderr``,
            ``prefix_output_with_timestamp``, ``start_timeout``, ``verbose``, ``nics``,
            ``executable``, ...).
    """

    def __init__(self, num_proc: int | None = None, env: Mapping[str, str] | None = None,
                 **kwargs: Any) -> None:
        self._num_proc = num_proc
        self._env = dict(env or {})
        self._kwargs = kwargs

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...] = (),
            kwargs: Mapping[str, Any] | None = None,
            env: Mapping[str, str] | None = None) -> list[Any]:
        from hora.spark.runner import run

        full_env = {**self._env, **(env or {})}
        return run(fn, args=args, kwargs=kwargs, num_proc=self.num_processes(),
                   env=full_env, **self._kwargs)

    def num_processes(self) -> int:
        if self._num_proc is None:
            self._num_proc = default_num_proc()
        return self._num_proc


__all__ = ["Backend", "SparkBackend", "default_num_proc"]
