"""Case group: ``op=Adasum`` through hora.jax on 2 ranks, every result checked against a numpy
reference of the formula built from every rank's local values (exchanged with
``allgather_object``).

* ``hvd.allreduce(x, op=hvd.Adasum)`` eagerly and inside ``jax.jit``, float32 and float64;
  a pytree is combined leaf by leaf (never packed into one vector);
* ``hvd.DistributedOptimizer(tx, op=hvd.Adasum)``: the delta optimizer (``tx`` on this rank's
  gradients, its updates combined with Adasum per leaf) with sgd and adam in a jitted step, and
  with ``backward_passes_per_step=2``;
* the errors (integers, a process set other than the global one).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax_case_ids import ADASUM

LR = 0.1


def init(hvd: Any) -> None:
    hvd.init()


def adasum(vectors: list[Any]) -> np.ndarray:
    """The recursive pairwise Adasum (float64) of one tensor's values on every rank."""
    level = [np.asarray(v, np.float64) for v in vectors]
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[0::2], level[1::2]):
            dot, an, bn = np.vdot(a, b), np.vdot(a, a), np.vdot(b, b)
            nxt.append((1 - dot / (2 * an)) * a + (1 - dot / (2 * bn)) * b)
        level = nxt
    return level[0]


def _local(rank: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.RandomState(10 * seed + rank)
    return rng.randn(*shape) + 1.0  # a shared direction: neither the sum nor the mean


def _close(got: Any, want: np.ndarray, tol: float, what: str) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol,
                               err_msg=what)


def _allreduce(hvd: Any, jit: bool) -> None:
    r, n = hvd.rank(), hvd.size()
    fn = jax.jit(lambda t: hvd.allreduce(t, op=hvd.Adasum)) if jit else (
        lambda t: hvd.allreduce(t, op=hvd.Adasum))
    for i, (dtype, tol) in enumerate([(np.float32, 1e-5), (np.float64, 1e-12)]):
        values = [_local(q, (3, 7), seed=i).astype(dtype) for q in range(n)]
        got = fn(jnp.asarray(values[r]))
        assert got.dtype == dtype and got.shape == (3, 7)
        _close(got, adasum(values), tol, f"{dtype.__name__} jit={jit}")


def _tree(hvd: Any) -> None:
    """Two leaves with different directions: one packed vector would mix their coefficients."""
    r, n = hvd.rank(), hvd.size()
    trees = [{"a": _local(q, (5,), 1), "b": _local(q, (2, 2), 2) * (1 + 3 * q)}
             for q in range(n)]
    want = {k: adasum([t[k] for t in trees]) for k in ("a", "b")}
    mixed = adasum([np.concatenate([t["a"], t["b"].ravel()]) for t in trees])
    assert not np.allclose(mixed[:5], want["a"], atol=1e-3)  # the test can tell them apart
    tree = jax.tree_util.tree_map(jnp.asarray, trees[r])
    for fn in (lambda t: hvd.allreduce(t, op=hvd.Adasum),
               jax.jit(lambda t: hvd.allreduce(t, op=hvd.Adasum)),
               lambda t: hvd.grouped_allreduce(t, op=hvd.Adasum)):
        got = fn(tree)
        for k in ("a", "b"):
            _close(got[k], want[k], 1e-12, f"leaf {k}")


def _loss(params: Any, xb: Any, yb: Any) -> Any:
    return ((xb @ params["w"] + params["b"] - yb) ** 2).mean()


def _batch(rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 * step + rank)
    xb = rng.normal(size=(16, 3))
    return xb, xb @ np.array([1.0, -2.0, 0.5]) + 0.3


def _optimizer(make: Any, passes: int) -> Any:
    """``passes`` jitted steps of ``DistributedOptimizer(make(), op=Adasum)``; after the last,
    params = start + adasum(local updates) per leaf, where each rank's local update is what
    ``make()`` alone gives for the mean of its gradients over the passes."""

    def case(hvd: Any) -> None:
        r, n = hvd.rank(), hvd.size()
        start = {"w": jnp.asarray([0.5, 0.1, -0.3]), "b": jnp.asarray(0.2)}
        tx = hvd.DistributedOptimizer(make(), op=hvd.Adasum, backward_passes_per_step=passes,
                                      name=f"ada{passes}")
        state = tx.init(start)

        @jax.jit
        def step(p: Any, s: Any, xb: Any, yb: Any) -> Any:
            g = jax.grad(_loss)(p, xb, yb)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        params, grads = start, []
        for k in range(passes):
            xb, yb = _batch(r, k)
            grads.append(jax.grad(_loss)(start, xb, yb))
            params, state = step(params, state, xb, yb)
            if k < passes - 1:  # accumulating: nothing applied yet
                assert all(np.array_equal(a, b) for a, b in zip(
                    jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(start)))
        mean = jax.tree_util.tree_map(lambda *gs: sum(gs) / len(gs), *grads)
        plain = make()
        local, _ = plain.update(mean, plain.init(start), start)
        everyone = hvd.allgather_object(jax.tree_util.tree_map(np.asarray, local))
        for key in ("w", "b"):
            want = np.asarray(start[key]) + adasum([everyone[q][key] for q in range(n)])
            _close(params[key], want, 1e-7, f"{key}")  # MultiSteps' running mean rounds
        assert not np.allclose(np.asarray(params["w"]),
                               np.asarray(start["w"]) + np.asarray(local["w"]))

    return case


def _errors(hvd: Any) -> None:
    for fn, pattern, kind in [
        (lambda: hvd.allreduce(jnp.arange(3), op=hvd.Adasum), "floating-point", ValueError),
        (lambda: jax.jit(lambda t: hvd.allreduce(t, op=hvd.Adasum))(jnp.arange(3)),
         "floating-point", ValueError),
        (lambda: hvd.DistributedOptimizer(optax.sgd(0.1), op=hvd.Adasum,
                                          process_set=hvd.ProcessSet([0])),
         "non-global process sets", NotImplementedError),
    ]:
        try:
            fn()
        except kind as exc:
            assert pattern in str(exc), exc
        else:
            raise AssertionError(f"no {kind.__name__} ({pattern})")


def cases() -> list[tuple[str, Any]]:
    out = [("adasum-allreduce-eager", lambda hvd: _allreduce(hvd, False)),
           ("adasum-allreduce-jit", lambda hvd: _allreduce(hvd, True)),
           ("adasum-tree", _tree),
           ("adasum-optimizer-sgd", _optimizer(lambda: optax.sgd(LR), 1)),
           ("adasum-optimizer-adam", _optimizer(lambda: optax.adam(0.05), 1)),
           ("adasum-optimizer-passes", _optimizer(lambda: optax.sgd(LR), 2)),
           ("adasum-errors", _errors)]
    assert [c for c, _ in out] == ADASUM
    return out
