"""Elastic training with Keras 3 (Horovod's ``horovod.tensorflow.keras.elastic`` and
``horovod.keras.elastic``: ``hvd.elastic``).

::

    import hora.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(opt), loss=...)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]  # last

    @hvd.elastic.run
    def train(state):
        while state.epoch < epochs:
            done = state.batch * batch_size          # batches of this epoch already trained
            model.fit(x[done:], y[done:], batch_size=batch_size, initial_epoch=state.epoch,
                      epochs=state.epoch + 1, callbacks=callbacks)

    train(state)

Callbacks (Horovod's, with the differences noted on each):

* :class:`CommitStateCallback`: ``state.commit()`` every ``batches_per_commit`` batches and at
  the end of every epoch; list it **after** the two below, so that a commit holds the updated
  ``epoch`` / ``batch``;
* :class:`UpdateBatchStateCallback`: ``state.batch`` = batches of the current epoch done;
* :class:`UpdateEpochStateCallback`: ``state.epoch`` = epochs done.

With ``TF_USE_LEGACY_KERAS=1`` (``tf.keras`` is tf-keras, Keras 2) the same classes serve
tf-keras models, optimizers and ``fit``.

A Keras 3 callback cannot shorten an epoch that ``fit`` has started, so the training function
passes ``fit`` the batches still to do, as above (Horovod's examples call ``fit`` once with
``epochs=total - state.epoch``; that works too, but repeats the committed batches of a resumed
epoch).
"""

from __future__ import annotations

import importlib
from typing import Any

from hora.elastic.state import ObjectState
from hora.tensorflow.elastic import TensorFlowKerasState, run
from hora.tensorflow.keras_flavor import keras_of_tf, legacy_keras

# the callbacks subclass those of whichever Keras tf.keras is (tf-keras: Keras 2)
keras: Any = keras_of_tf() if legacy_keras() else importlib.import_module("keras")


class KerasState(TensorFlowKerasState):
    """State of a Keras model and its optimizer (Horovod's ``KerasState``): a
    :class:`~hora.tensorflow.elastic.TensorFlowKerasState` (model weights and optimizer
    variables; an optimizer without variables yet is built now) with Keras's backend.

    Args:
        model: a built Keras model.
        optimizer: default ``model.optimizer``.
        **kwargs: plain attributes, e.g. ``epoch=0, batch=0`` for the callbacks.
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, backend=keras.backend, **kwargs)


def _require(state: Any, attr: str, callback: str) -> None:
    if not hasattr(state, attr):
        raise ValueError(f"{callback} needs a state with a `{attr}` attribute: create it as "
                         f"KerasState(model, {attr}=0, ...)")


class CommitStateCallback(keras.callbacks.Callback):
    """``state.commit()`` every ``batches_per_commit`` batches and at the end of every epoch.

    A commit is collective (every rank commits at the same batch) and is where a new worker
    joins (``HostsUpdatedInterrupt`` ends ``fit``; :func:`run` rebuilds the world and calls the
    training function again). hora restarts the batch count at the start of every ``fit`` and
    after the epoch-end commit (Horovod carries it over).

    Raises:
        ValueError: ``batches_per_commit`` < 1.
    """

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        if int(batches_per_commit) < 1:
            raise ValueError(f"CommitStateCallback: batches_per_commit must be >= 1, got "
                             f"{batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self.batches_remaining = self.batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining <= 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()
        self.batches_remaining = self.batches_per_commit


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` = the number of batches of the current epoch trained so far, and
    sets it to 0 at the end of every epoch.

    In the first epoch of a ``fit`` that resumes an epoch (``state.batch`` > 0 when the epoch
    begins) the count goes on from there: pass ``fit`` only the remaining batches (see the
    module docstring). Differences from Horovod: Horovod's ``state.batch`` is the index of the
    last batch (one less, so a resumed epoch repeats one batch) and restarts from 0 in a resumed
    epoch; Horovod also lowers ``params['steps']`` by ``state.batch``, which in Keras 3 changes
    only what the progress bar shows (``fit`` runs the batches it was given), so hora leaves
    ``params`` alone.

    Raises:
        ValueError: the state has no ``batch`` attribute.
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        _require(state, "batch", "UpdateBatchStateCallback")
        self.state = state
        self._offset = 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._offset = int(self.state.batch)

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = self._offset + batch + 1

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0
        self._offset = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` = the number of epochs trained: at the end of each epoch of a
    ``fit``, ``state.epoch`` = its value when that ``fit`` started + epochs ended in it.

    Works with both ways of resuming: ``fit(..., epochs=total - state.epoch)`` (Horovod's
    examples) and ``fit(..., initial_epoch=state.epoch, epochs=total)``. Horovod reads
    ``state.epoch`` once, when the callback is made, so a ``fit`` after a reset counts from the
    wrong epoch; hora reads it at the start of every ``fit``.

    Raises:
        ValueError: the state has no ``epoch`` attribute.
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        _require(state, "epoch", "UpdateEpochStateCallback")
        self.state = state
        self.initial_epoch = int(state.epoch)
        self._first: int | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        self.initial_epoch = int(self.state.epoch)
        self._first = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if self._first is None:
            self._first = epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        first = epoch if self._first is None else self._first
        self.state.epoch = self.initial_epoch + (epoch - first) + 1


__all__ = ["CommitStateCallback", "KerasState", "ObjectState", "TensorFlowKerasState",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
