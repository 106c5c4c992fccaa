"""Horovod's Keras callbacks for Keras 3 (``hvd.callbacks``).

* :class:`BroadcastGlobalVariablesCallback`: after the first batch (optimizer slots exist),
  every model and optimizer variable takes ``root_rank``'s value, once.
* :class:`MetricAverageCallback`: at each epoch end, the ``logs`` are averaged across ranks
  (one grouped allreduce, keys in sorted order); list it before callbacks that read metrics.
* :class:`LearningRateScheduleCallback` / :class:`LearningRateWarmupCallback`: Horovod's
  schedules on the optimizer's ``learning_rate``.
* :class:`BestModelCheckpoint`: ``ModelCheckpoint(save_best_only=True)`` whose path may be set
  later.

Keras 3 compiles ``momentum`` into the train step as a constant, so momentum correction is
applied only to optimizers whose ``momentum`` is a variable (see docs/tensorflow.md).

The classes subclass the callbacks of whichever Keras ``tf.keras`` is
(:func:`~hora.tensorflow.keras_flavor.legacy_keras`): Keras 3's, or tf-keras's (Keras 2, under
``TF_USE_LEGACY_KERAS=1``), where the learning-rate callbacks read and write
``optimizer.lr`` as Horovod's Keras 2 callbacks do.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import tensorflow as tf

import hora
from hora.tensorflow.keras_flavor import keras_of_tf, legacy_keras
from hora.tensorflow.mpi_ops import broadcast_, grouped_allreduce

_KERAS2 = legacy_keras()
keras: Any = keras_of_tf() if _KERAS2 else importlib.import_module("keras")
io_utils: Any = importlib.import_module(
    "tf_keras.src.utils.io_utils" if _KERAS2 else "keras.src.utils.io_utils")


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from ``root_rank`` at the end of the
    first batch (so the optimizer's slots exist). ``local_variables`` are left alone."""

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.local_variables = {id(v) for v in (local_variables or [])}
        self.broadcast_done = False

    def _variables(self) -> list[Any]:
        found = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            opt_vars = optimizer.variables  # a method on tf-keras legacy optimizers
            found += list(opt_vars() if callable(opt_vars) else opt_vars)
        seen: set[int] = set()
        out = []
        for v in found:
            if id(v) not in seen and id(v) not in self.local_variables:
                seen.add(id(v))
                out.append(v)
        return out

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.broadcast_done:
            return
        broadcast_(self._variables(), self.root_rank,
                   name="BroadcastGlobalVariablesCallback")
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Average every metric in ``logs`` across ranks at the end of each epoch."""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float)) or
                      hasattr(v, "dtype"))
        if not keys:
            return
        values = [tf.cast(tf.convert_to_tensor(logs[k]), tf.float64) for k in keys]
        averaged = grouped_allreduce(values, name=f"MetricAverageCallback.{epoch}")
        for k, v in zip(keys, averaged):
            logs[k] = float(v.numpy())


def _value(x: Any) -> float:
    if _KERAS2:
        return float(keras.backend.get_value(x))
    return float(keras.ops.convert_to_numpy(x))


def _get_lr(optimizer: Any) -> float:
    return _value(optimizer.lr if _KERAS2 else optimizer.learning_rate)


def _set_lr(optimizer: Any, value: float) -> None:
    if _KERAS2:
        optimizer.lr = value
    else:
        optimizer.learning_rate = value


def _is_variable(x: Any) -> bool:
    return isinstance(x, tf.Variable) if _KERAS2 else isinstance(x, keras.Variable)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """For epochs in ``[start_epoch, end_epoch)``: ``lr = initial_lr * multiplier(epoch)`` (a
    number ``m`` means ``m ** (epoch - start_epoch)``). ``staircase`` adjusts at the first
    batch of each epoch, else every batch with the fractional epoch."""

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self.restore_momentum: Any = None
        if callable(multiplier):
            self.multiplier: Callable[[float], float] = multiplier
        else:
            self.staircase = True
            factor = float(multiplier)
            self.multiplier = lambda epoch: factor ** (epoch - start_epoch)

    def _autodetect_steps_per_epoch(self) -> int:
        params = self.params or {}
        if params.get("steps"):
            return int(params["steps"])
        if params.get("samples") and params.get("batch_size"):
            return int(params["samples"]) // int(params["batch_size"])
        raise ValueError("Could not autodetect the number of steps per epoch. Please specify "
                         "the steps_per_epoch parameter to the callback.")

    def _adjust_learning_rate(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = _get_lr(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        _set_lr(optimizer, new_lr)
        momentum: Any = getattr(optimizer, "momentum", None)
        if self.momentum_correction and old_lr and _is_variable(momentum):
            self.restore_momentum = _value(momentum)
            momentum.assign(self.restore_momentum * new_lr / old_lr)

    def _restore_momentum_if_needed(self) -> None:
        if self.restore_momentum is not None:
            self.model.optimizer.momentum.assign(self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs: Any = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current_epoch = epoch

    def _in_range(self) -> bool:
        return self.current_epoch >= self.start_epoch and (
            self.end_epoch is None or self.current_epoch < self.end_epoch)

    def on_batch_begin(self, batch: int, logs: Any = None) -> None:
        if not self._in_range():
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + batch / float(self.steps_per_epoch
                                                                          or 1))

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warmup (Goyal et al.): from ``initial_lr / size`` to ``initial_lr`` over
    ``warmup_epochs``, adjusted every batch."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            # the learning rate reached at the end of this batch
            epoch += 1.0 / float(self.steps_per_epoch or 1)
            size = hora.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and hora.rank() == 0:
            io_utils.print_msg(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup "
                               f"to {_get_lr(self.model.optimizer):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``ModelCheckpoint`` with ``save_best_only=True``; ``filepath`` may be given later
    (``callback.filepath = ...``) before training starts."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto",
                 save_freq: str | int = "epoch", filepath: str | None = None) -> None:
        placeholder = "model.weights.h5" if save_weights_only else "model.keras"
        super().__init__(filepath=filepath or placeholder, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs: Any = None) -> None:
        if not self.filepath:
            raise ValueError("BestModelCheckpoint: set `filepath` before training starts.")
        super().on_train_begin(logs)


__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback",
           "MetricAverageCallback"]
