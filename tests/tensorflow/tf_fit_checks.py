"""What the Keras 3 and the tf-keras ``fit`` case groups both check: weights identical on every
rank after each epoch, against one process trained on the union of the ranks' batches. Neither
Keras is imported here: each group passes its own callback base class and data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def weights(model: Any) -> np.ndarray:
    """Every weight of ``model``, flattened into one array."""
    return np.concatenate([np.asarray(v.numpy()).ravel() for v in model.weights])


def epoch_check(callback_base: type, allgather_object: Callable[[Any], list[Any]]) -> Any:
    """A ``callback_base`` (Keras 3's or tf-keras's ``Callback``) that asserts after every
    epoch that the weights are the same on every rank, counting the epochs it saw."""

    class EpochCheck(callback_base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.epochs = 0

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            everyone = allgather_object(weights(self.model))
            assert all(np.array_equal(everyone[0], w) for w in everyone), \
                f"epoch {epoch}: weights differ across ranks"
            self.epochs += 1

    return EpochCheck()


def interleaved(data: Callable[[int], tuple[np.ndarray, np.ndarray]], n: int, steps: int,
                batch: int, per_step: int) -> tuple[np.ndarray, np.ndarray]:
    """The union of every rank's batches (``data(rank)``), step by step: what one process
    would train on."""
    xs, ys = zip(*[data(q) for q in range(n)])
    bx, by = [], []
    for s in range(steps // per_step):
        rows = slice(s * per_step * batch, (s + 1) * per_step * batch)
        bx += [x[rows] for x in xs]
        by += [y[rows] for y in ys]
    return np.concatenate(bx), np.concatenate(by)
