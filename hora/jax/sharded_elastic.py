"""Elastic state of the optax ``ShardedOptimizer`` (hora-only): ``tx.elastic_state(params,
opt_state, epoch=0, ...)`` returns a :class:`ShardedState`, a :class:`hora.elastic.ObjectState`
that also keeps the parameters and the sharded optimizer state, as torch's ``TorchState`` does
for its ``ShardedOptimizer`` (hora.jax has no framework state class of its own):

* ``commit()`` / ``save`` (collective, as commits are) keeps numpy copies of ``state.params``
  and the **full** optimizer state (``tx.gather_state``), on every rank;
* ``restore()`` puts the committed parameters back in ``state.params`` and this rank's shard of
  the committed state in ``state.opt_state``, without any collective (it runs after a failure);
* ``sync()`` takes rank 0's committed parameters and full state on every rank (a new rank gets
  its shard);
* ``reset()`` (the world changed; after removals elastic skips ``sync``) re-shards this rank's
  committed copy under the new plan.

Train from ``state.params`` / ``state.opt_state`` and write them back before each commit. The
committed copy is the full state on every rank: the memory saving holds while training, not in
the commit snapshot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from hora._basics import rank
from hora.elastic.state import ObjectState
from hora.jax.functions import broadcast_object


class ShardedState(ObjectState):
    """``state.params`` and ``state.opt_state`` (this rank's shard) of a sharded optax
    transformation ``tx``, plus plain attributes (``**kwargs``, as ``ObjectState``)."""

    def __init__(self, tx: Any, params: Any, opt_state: Any, **kwargs: Any) -> None:
        self.tx = tx
        self.params = params
        self.opt_state = opt_state
        self._committed: tuple[Any, Any] | None = None
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)
        self._keep()

    def _keep(self) -> None:
        params = jax.tree_util.tree_map(np.asarray, self.params)
        self._committed = (params, self.tx.gather_state(self.opt_state))

    def _load(self) -> None:
        assert self._committed is not None
        params, full = self._committed
        self.params = jax.tree_util.tree_map(jnp.asarray, params)
        self.opt_state = self.tx.scatter_state(full, self.params)

    def save(self) -> None:
        self._keep()
        super().save()

    def restore(self) -> None:
        self._load()
        super().restore()

    def sync(self) -> None:
        self._committed = broadcast_object(self._committed if rank() == 0 else None, 0,
                                           name="sharded_jax.sync")
        self._load()
        super().sync()

    def reset(self) -> None:
        """The world changed: this rank's shard of its committed copy, under the new plan."""
        assert self._committed is not None
        self.opt_state = self.tx.scatter_state(self._committed[1], self.params)

    if TYPE_CHECKING:  # the keyword attributes (state.epoch, ...) for type checkers
        def __getattr__(self, name: str) -> Any: ...


__all__ = ["ShardedState"]
