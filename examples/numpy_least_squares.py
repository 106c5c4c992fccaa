"""Distributed linear regression with hora's numpy API: a real data-parallel training loop.

Each rank trains on its own shard of scikit-learn's diabetes dataset (shipped inside the package,
no download); every step the ranks average their gradients with ``hora.allreduce``, so all ranks
hold identical weights. At the end rank 0 compares the result with the closed-form least-squares
solution over the full dataset.

    hora run -np 2 python examples/numpy_least_squares.py
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import hora


def load_data() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_diabetes
    except ImportError:
        sys.exit("this demo needs scikit-learn: pip install scikit-learn")
    x, y = load_diabetes(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    x = np.hstack([x, np.ones((len(x), 1))])  # bias column
    return x.astype(np.float64), ((y - y.mean()) / y.std()).astype(np.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    hora.init()
    rank, size = hora.rank(), hora.size()
    x, y = load_data()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))  # same permutation on every rank
    shard = order[rank::size]
    xs, ys = x[shard], y[shard]
    counts = hora.allgather_object(len(shard))
    if rank == 0:
        print(f"{size} ranks, samples per rank {counts}, {x.shape[1]} features")

    # Rank 0 initialises; everyone starts from its weights.
    w = hora.broadcast(rng.normal(0, 0.1, x.shape[1]), root_rank=0, name="init_weights")
    steps = int(np.ceil(len(xs) / args.batch_size))
    for epoch in range(args.epochs):
        perm = np.random.default_rng(epoch * size + rank).permutation(len(xs))
        for step in range(steps):
            idx = perm[step * args.batch_size:(step + 1) * args.batch_size]
            if len(idx) == 0:
                idx = perm[:args.batch_size]
            err = xs[idx] @ w - ys[idx]
            grad = xs[idx].T @ err / len(idx)
            grad = hora.allreduce(grad, name=f"grad.{step}")  # Average across ranks
            w -= args.lr * grad
        local = np.array([np.sum((xs @ w - ys) ** 2), len(xs)])
        sse, n = hora.allreduce(local, op=hora.Sum, name="train_mse")
        if rank == 0 and (epoch % 10 == 0 or epoch == args.epochs - 1):
            print(f"epoch {epoch:3d}  train MSE {sse / n:.4f}")

    same = hora.allgather(w[None, :], name="final_weights")
    assert np.array_equal(same.min(0), same.max(0)), "ranks disagree on the weights"
    if rank == 0:
        best, *_ = np.linalg.lstsq(x, y, rcond=None)
        opt = np.mean((x @ best - y) ** 2)
        final = np.mean((x @ w - y) ** 2)
        print(f"final train MSE {final:.4f}; closed-form optimum {opt:.4f} "
              f"(gap {100 * (final - opt) / opt:.2f}%); weights identical on all {size} ranks")
    hora.shutdown()


if __name__ == "__main__":
    main()
