"""Data-parallel training of a real classifier with ``hora.jax`` (Flax NNX + Optax).

Two ranks train one small MLP on scikit-learn's handwritten digits dataset (1797 8x8 images,
shipped inside the package: no download), the task of ``examples/torch_digits.py``. Each rank
takes its own shard of every epoch; ``hvd.DistributedOptimizer`` wraps the optax optimizer so
gradients are averaged across ranks inside the jitted train step (a host callback into hora's
engine), and both ranks hold identical parameters after every step:

* rank 0's initial parameters and optimizer state are broadcast to everyone
  (``hvd.broadcast_parameters`` / ``hvd.broadcast_optimizer_state`` return the root's tree);
* the learning rate is scaled by ``hvd.size()``;
* validation metrics are averaged with one ``hvd.allreduce`` of a dict of sums;
* at the end every rank's parameters are gathered and compared (printed by rank 0).

Run it::

    hora run -np 2 python examples/jax_digits.py
    python examples/jax_digits.py            # one process, no launcher (size 1)

It ends with lines like ``parameters identical on all 2 ranks: True`` and
``final validation accuracy 97.2% (2 ranks)``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

try:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
except ImportError:
    sys.exit("this example needs jax, optax and flax: pip install hora[jax]")

import hora.jax as hvd


def load_digits_split(seed: int, val_fraction: float
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Standardized train / validation arrays, identical on every rank (fixed ``seed``)."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        sys.exit("this example needs scikit-learn: pip install scikit-learn")
    x, y = load_digits(return_X_y=True)
    x_tr, x_va, y_tr, y_va = train_test_split(x, y, test_size=val_fraction, random_state=seed,
                                              stratify=y)
    mean, std = x_tr.mean(0), x_tr.std(0)
    std[std == 0] = 1.0
    return ((x_tr - mean) / std).astype(np.float32), y_tr, \
        ((x_va - mean) / std).astype(np.float32), y_va


class MLP(nnx.Module):
    """in -> hidden -> hidden -> classes, ReLU."""

    def __init__(self, n_in: int, n_out: int, hidden: int, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(n_in, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.l3 = nnx.Linear(hidden, n_out, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l3(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step, per rank")
    parser.add_argument("--lr", type=float, default=1e-3,
                        help="Adam learning rate for one rank; scaled by the number of ranks")
    parser.add_argument("--hidden", type=int, default=128, help="hidden units per layer")
    parser.add_argument("--seed", type=int, default=0, help="data split and initial weights")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x_tr, y_tr, x_va, y_va = load_digits_split(args.seed, 0.2)

    # every rank builds the model from its own seed: the broadcast makes them equal
    model = MLP(x_tr.shape[1], 10, args.hidden, nnx.Rngs(args.seed + rank))
    graphdef, params = nnx.split(model)
    tx = hvd.DistributedOptimizer(optax.adam(args.lr * size))
    params = hvd.broadcast_parameters(params, root_rank=0)
    opt_state = hvd.broadcast_optimizer_state(tx.init(params), root_rank=0)

    def loss_fn(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, p)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(p: Any, s: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        updates, s = tx.update(grads, s, p)  # gradients averaged across ranks here
        return optax.apply_updates(p, updates), s, loss

    @jax.jit
    def metric_sums(p: Any, x: jax.Array, y: jax.Array) -> dict[str, jax.Array]:
        logits = nnx.merge(graphdef, p)(x)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return {"loss": losses.sum(), "correct": (logits.argmax(-1) == y).sum(),
                "count": jnp.asarray(y.shape[0])}

    def evaluate() -> tuple[float, float]:
        mine = slice(rank, None, size)  # each rank scores its shard
        sums = hvd.allreduce(metric_sums(params, x_va[mine], y_va[mine]), op=hvd.Sum,
                             name="val_metrics")
        count = max(float(sums["count"]), 1.0)
        return float(sums["loss"]) / count, float(sums["correct"]) / count

    steps = len(x_tr) // (args.batch_size * size)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        epoch_start = time.perf_counter()
        order = np.random.default_rng(args.seed + epoch).permutation(len(x_tr))
        shard = order[rank::size]  # this rank's share of the epoch
        for i in range(steps):
            idx = shard[i * args.batch_size:(i + 1) * args.batch_size]
            params, opt_state, loss = train_step(params, opt_state, x_tr[idx], y_tr[idx])
        val_loss, val_acc = evaluate()
        if rank == 0:
            print(f"epoch {epoch + 1:2d}  train loss {float(loss):.4f}  val loss "
                  f"{val_loss:.4f}  val acc {100 * val_acc:.1f}%  "
                  f"({time.perf_counter() - epoch_start:.2f} s)", flush=True)
    trained = time.perf_counter() - start

    everyone = hvd.allgather_object([np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(
        params)])
    identical = all(all(np.array_equal(a, b) for a, b in zip(everyone[0], other))
                    for other in everyone[1:])
    _, val_acc = evaluate()
    if rank == 0:
        print(f"trained {args.epochs} epochs in {trained:.2f} s", flush=True)
        print(f"parameters identical on all {size} ranks: {identical}", flush=True)
        print(f"final validation accuracy {100 * val_acc:.1f}% ({size} ranks)", flush=True)
    hvd.shutdown()
    if not identical:
        sys.exit("parameters differ across ranks")


if __name__ == "__main__":
    main()
