"""Local ops in flight: :class:`Entry` (one op: the request, its buffers and its handle) and
:class:`InFlight` (the names of the ops in flight, which must be unique per process set).

An entry is created by :mod:`hora.core.frontend.api` (the user's call), carried by the engine, the
coordinator's responses and the fast lane, completed by :mod:`hora.core.data.executor`; its name is
taken in :class:`InFlight` when the engine accepts it and freed when its handle completes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from hora.core.op.handle import Handle
from hora.core.op.messages import Request

if TYPE_CHECKING:
    from hora.core.op.device import DeviceBuffer

Buffer = Union[np.ndarray, "DeviceBuffer"]
"""An op's input or output: host memory, or a device buffer (:mod:`hora.core.op.device`)."""


@dataclass
class Entry:
    """One local op waiting for its response.

    ``tensor`` is the contiguous input: a host array, or a device buffer when the job's data
    plane takes the adapter's tensors as they are (:mod:`hora.core.op.device`; only the
    executor's device forms, :mod:`hora.core.data.device_exec`, see those). ``output`` is where the
    result goes (may be ``tensor`` itself for in-place ops; None when the size is only known
    after negotiation). ``finish`` post-processes the result (e.g. copy back into a
    non-contiguous original) before the handle completes.
    """

    request: Request
    tensor: Buffer
    output: Buffer | None
    handle: Handle
    finish: Callable[[Any], Any] | None = None
    sync: bool = False  # the submitter waits for it at once (the fast lane lets it run the op)


DUPLICATE = ("Requested to allreduce, allgather, or broadcast a tensor with the same name as "
             "another tensor that is currently being processed.")
"""Horovod's text for a name already in flight."""


class InFlight:
    """The names of the ops in flight, per process set (an op's name is taken at submission and
    freed when it completes). Thread-safe without a lock on the submit path: a name is taken
    by one ``dict.setdefault``, which the GIL makes atomic (str keys: no Python code runs in
    it), and freed by one ``dict.pop`` (two lock round trips per op saved)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # (only to add a set's table)
        self._names: dict[int, dict[str, object]] = {}

    def _table(self, set_id: int) -> dict[str, object]:
        names = self._names.get(set_id)
        if names is None:
            with self._lock:
                names = self._names.setdefault(set_id, {})
        return names

    def take(self, set_id: int, name: str) -> None:
        """Take ``name`` on ``set_id``.

        Raises:
            ValueError: it is in flight already (Horovod's text).
        """
        names = self._names.get(set_id)
        if names is None:
            names = self._table(set_id)
        token = object()
        if names.setdefault(name, token) is not token:
            raise ValueError(f"{DUPLICATE} (name: '{name}'; give each in-flight op a "
                             "distinct name=)")

    def take_all(self, set_id: int, wanted: list[str]) -> None:
        """Take every name of ``wanted``, or none of them (ValueError as :meth:`take`)."""
        names = self._table(set_id)
        taken: list[tuple[str, object]] = []
        for name in wanted:
            token = object()
            if names.setdefault(name, token) is not token:
                for mine, its in taken:  # none of them: give back what this call took
                    if names.get(mine) is its:
                        names.pop(mine, None)
                raise ValueError(f"{DUPLICATE} (name: '{name}'; give each in-flight op a "
                                 "distinct name=)")
            taken.append((name, token))

    def free(self, set_id: int, name: str) -> None:
        self._names[set_id].pop(name, None)

    def release(self, handle: Handle) -> None:
        """A handle's op is done: free its name (:attr:`~hora.core.op.handle.Handle.release`)."""
        self._names[handle.set_id].pop(handle.name, None)
