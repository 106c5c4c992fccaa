"""Elastic training with PyTorch (Horovod's ``horovod.torch.elastic``, ``hvd.elastic``).

::

    import hora.torch as hvd
    hvd.init()
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        ...                  # collectives, state.commit() every few batches

    train(state)

Launch with ``hora run -np 4 --min-np 2 --host-discovery-script ./hosts.sh python train.py``.
No collective may run between ``hvd.init()`` and the call of the decorated function (workers
that join later start from the top of the script; the survivors wait in ``state.sync()``).
``State`` and ``ObjectState`` live in :mod:`hora.elastic` (not exported here, as in Horovod).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from hora.elastic.worker import reset, run_fn
from hora.torch.elastic.sampler import ElasticSampler
from hora.torch.elastic.state import TorchState

F = TypeVar("F", bound=Callable[..., Any])


def run(func: F) -> F:
    """Decorator: run ``func(state, *args, **kwargs)`` elastically.

    Before every attempt ``state.sync()`` gives every rank rank 0's committed state. When a
    collective fails (``HorovodInternalError``: a peer died), ``state.restore()`` rolls back
    to the last commit; when ``state.commit()`` finds that hosts changed
    (``HostsUpdatedInterrupt``), nothing is rolled back. Either way the world is rebuilt
    (``shutdown(); init()``), ``state.on_reset()`` runs the reset callbacks, and ``func`` is
    called again. Other exceptions propagate. ``func``'s first argument must be a
    :class:`TorchState` (or another ``hora.elastic.State``), else ``TypeError``.
    """
    return run_fn(func, reset)


__all__ = ["TorchState", "ElasticSampler", "run"]
