"""Elastic state of the Keras ``ShardedOptimizer`` (hora-only, Keras 3):
``hvd.elastic.KerasState(model, optimizer)`` (and ``TensorFlowKerasState``) hand the optimizer
to :class:`ShardedKerasStateHandler` instead of snapshotting and broadcasting its variables
(each rank holds other slots, so rank 0's cannot be broadcast).

* ``save`` (at commit, collective as commits are) keeps the **full** state
  (:meth:`gather_state`, numpy), on every rank;
* ``restore`` loads this rank's shard of it, without any collective (it runs after a failure);
* ``sync`` loads rank 0's committed full state on every rank (a new rank gets its shard);
* ``reset`` (the world changed; after removals elastic skips ``sync``) re-shards each rank's
  committed copy under the new plan (the slots are built again for the variables this rank
  owns now).

The committed copy is the full state on every rank: an elastic job keeps the memory saving while
it trains, not in its commit snapshot.
"""

from __future__ import annotations

from typing import Any

from hora._basics import rank
from hora.tensorflow.functions import broadcast_object
from hora.tensorflow.keras_flavor import is_keras2


class ShardedKerasStateHandler:
    """The optimizer part of a Keras elastic state whose optimizer is a ``ShardedOptimizer``."""

    def __init__(self, optimizer: Any, model: Any) -> None:
        if is_keras2(optimizer):
            raise ValueError(
                "elastic states of a tf-keras ShardedOptimizer are not supported (its full "
                "state has no gather_state / scatter_state); use Keras 3, or "
                "DistributedOptimizer with tf-keras.")
        self.optimizer = optimizer
        self.model = model
        self.saved: dict[str, Any] | None = None
        self.save()  # the slots it has now (collective), then this rank's shard built of them
        self.restore()

    def _variables(self) -> list[Any]:
        return list(self.model.trainable_variables)

    def _load(self, full: dict[str, Any]) -> None:
        self.optimizer.scatter_state(full, self._variables())

    def save(self) -> None:
        """Keep the full state (collective)."""
        self.optimizer._hora.variables = self._variables()
        self.saved = self.optimizer.gather_state()

    def restore(self) -> None:
        """This rank's shard of the committed state (no collective)."""
        assert self.saved is not None
        self._load(self.saved)

    def sync(self) -> None:
        """Rank 0's committed full state, this rank's shard of it loaded (collective)."""
        full = broadcast_object(self.saved if rank() == 0 else None, 0,
                                name="sharded_keras.sync")
        self.saved = full
        self._load(full)

    def reset(self) -> None:
        """The world changed: this rank's shard of its committed copy, under the new plan."""
        assert self.saved is not None
        self._load(self.saved)


__all__ = ["ShardedKerasStateHandler"]
