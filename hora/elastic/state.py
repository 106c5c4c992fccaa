"""What an elastic job keeps across membership changes: :class:`State` and :class:`ObjectState`.

Framework-neutral (the torch, TensorFlow and JAX states build on these). A state lives in each
worker's memory:

* ``commit()`` snapshots it (``save()``), then asks whether hosts changed
  (``check_host_updates()``); it is the only point where a newcomer can join;
* ``restore()`` rolls back to the last commit after a failed collective: every survivor then
  holds the same values;
* ``sync()`` broadcasts the committed values from rank 0 (the oldest surviving worker after a
  reset), so newcomers start from them.

A commit is an in-memory copy, not a checkpoint: if every worker dies, everything since the last
checkpoint *you* wrote to disk is lost.
"""

from __future__ import annotations

import copy
import queue
import time
from collections.abc import Callable, Iterable
from typing import Any

from hora.errors import HostsUpdatedInterrupt
from hora.rendezvous.elastic import HostUpdateResult, session


class State:
    """Base class of elastic states (Horovod's ``horovod.common.elastic.State``).

    Args:
        bcast_object: broadcasts a picklable object from a root rank (``hvd.broadcast_object``).
        get_rank: this process's rank (``hvd.rank``).
    """

    def __init__(self, bcast_object: Callable[..., Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: queue.Queue[tuple[float, HostUpdateResult]] = queue.Queue()
        self._last_updated_timestamp = 0.0
        self._reset_callbacks: list[Callable[[], None]] = []
        self._commit_count = 0  # commits this process made (progress, read by run_fn)

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call ``callbacks`` after every reset (the new world is up, before the next sync):
        e.g. to rescale the learning rate to the new ``size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: HostUpdateResult) -> None:
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Snapshot the state (the point a failure rolls back to), then check for new or
        removed hosts: raises :class:`~hora.errors.HostsUpdatedInterrupt` on every rank at the
        same commit when membership should change."""
        self.save()
        self._commit_count += 1
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`~hora.errors.HostsUpdatedInterrupt` on every rank when the driver
        announced a membership change (rank 0 reads it; its decision is broadcast)."""
        if self._rank() == 0:
            worker = session(connect=False)
            update = worker.host_update() if worker is not None else HostUpdateResult.no_update
            if update:
                self.on_hosts_updated(time.time(), update)
        prev_timestamp = self._last_updated_timestamp
        timestamp, update = prev_timestamp, HostUpdateResult.no_update
        while not self._host_messages.empty():
            when, what = self._host_messages.get()
            timestamp = max(timestamp, when)
            update |= what
        prev_timestamp, timestamp, update = self._bcast_object(
            (prev_timestamp, timestamp, int(update)))
        self._last_updated_timestamp = timestamp
        if timestamp > prev_timestamp:
            raise HostsUpdatedInterrupt(HostUpdateResult(update) == HostUpdateResult.removed)

    def save(self) -> None:
        """Snapshot the current values (in memory)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Put the last snapshot back."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank hold rank 0's committed values."""
        raise NotImplementedError

    def reset(self) -> None:
        """Hook called after the world changed (before the reset callbacks)."""


class ObjectState(State):
    """Picklable attributes kept across resets: ``ObjectState(bcast, rank, epoch=0, batch=0)``
    makes ``state.epoch`` and ``state.batch``; ``sync()`` broadcasts the *committed* values."""

    def __init__(self, bcast_object: Callable[..., Any], get_rank: Callable[[], int],
                 **kwargs: Any) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        new_state = {attr: copy.deepcopy(getattr(self, attr)) for attr in self._saved_state}
        self._saved_state = new_state

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))


__all__ = ["ObjectState", "State"]
