"""Case group: ``op=Adasum`` through hora.tensorflow and hora.keras on 2 ranks, every result
checked against a numpy reference of the formula built from every rank's local values (which
the ranks exchange with ``allgather_object``).

* ``hvd.allreduce(x, op=hvd.Adasum)`` eagerly and inside ``tf.function``, three float dtypes;
* ``DistributedGradientTape(op=hvd.Adasum)``: the gradients combined with Adasum per variable;
* Keras ``DistributedOptimizer(op=hvd.Adasum)``: the delta optimizer (each rank updates with its
  own gradients, the weight changes combined with Adasum per variable), with SGD and with Adam,
  in a custom step and in ``model.fit``, and with ``backward_passes_per_step=2``;
* the errors (integers, sparse tensors, other ops, non-global process sets).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

import hora.keras as hk

CASE_IDS = ["allreduce-eager", "allreduce-function", "tape", "keras-sgd-step",
            "keras-adam-step", "keras-fit", "keras-backward-passes", "errors"]
LR = 0.1


def init(hvd: Any) -> None:
    hvd.init()


def adasum(vectors: list[np.ndarray]) -> np.ndarray:
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


def _allreduce(hvd: Any, function: bool) -> None:
    r = hvd.rank()
    for i, (dtype, tol) in enumerate([(tf.float16, 5e-3), (tf.float32, 1e-5),
                                      (tf.float64, 1e-12)]):
        values = [_local(q, (3, 17), seed=i) for q in range(hvd.size())]
        x = tf.constant(values[r], dtype=dtype)
        fn = tf.function(lambda t: hvd.allreduce(t, op=hvd.Adasum)) if function else (
            lambda t: hvd.allreduce(t, op=hvd.Adasum))
        got = fn(x)
        assert got.dtype == dtype and got.shape == (3, 17)
        want = adasum([np.asarray(tf.cast(tf.constant(v, dtype), tf.float64)) for v in values])
        np.testing.assert_allclose(got.numpy().astype(np.float64), want, rtol=tol, atol=tol)


def _tape(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    # float64: float32 gradients traced in a tf.function differ from eager ones by ~1e-4
    w = tf.Variable(np.ones((4, 3)), dtype=tf.float64)
    b = tf.Variable(np.zeros(3), dtype=tf.float64)
    x = tf.constant(_local(r, (5, 4)), tf.float64)

    def loss() -> tf.Tensor:
        return tf.reduce_sum(tf.tanh(x @ w + b) ** 2)

    with tf.GradientTape() as plain:
        value = loss()
    local = [g.numpy() for g in plain.gradient(value, [w, b])]
    everyone = hk.allgather_object(local)

    @tf.function
    def step() -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            value = loss()
        return hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(value, [w, b])

    with tf.GradientTape() as tape:
        value = loss()
    eager = hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(value, [w, b])
    for got in (eager, step()):
        for k, g in enumerate(got):
            want = adasum([everyone[q][k] for q in range(n)])
            np.testing.assert_allclose(g.numpy(), want, rtol=1e-10, atol=1e-12)


def _model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(1)])


def _data(rank: int, rows: int = 16) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(100 + rank)
    x = rng.randn(rows, 5).astype("float32")
    return x, (x @ np.arange(1.0, 6.0, dtype="float32")[:, None] > 0).astype("float32")


def _weights(model: keras.Model) -> list[np.ndarray]:
    return [np.asarray(v.numpy()) for v in model.trainable_variables]


def _grads(model: keras.Model, x: np.ndarray, y: np.ndarray) -> list[tf.Tensor]:
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x)))
    return tape.gradient(loss, model.trainable_variables)


def _keras_step(make: Any) -> Any:
    """One custom step with ``DistributedOptimizer(make(), op=Adasum)``: the new weights are
    the old ones plus the Adasum of every rank's local update, per variable (the local update
    of a fresh ``make()`` optimizer on a copy of the model, computed on each rank)."""

    def case(hvd: Any) -> None:
        r, n = hvd.rank(), hvd.size()
        model, twin = _model(seed=0), _model(seed=0)
        start = _weights(model)
        x, y = _data(r)
        twin_opt = make()
        twin_opt.apply_gradients(zip(_grads(twin, x, y), twin.trainable_variables))
        deltas = hk.allgather_object([w - s for w, s in zip(_weights(twin), start)])
        opt = hk.DistributedOptimizer(make(), op=hvd.Adasum)
        assert type(opt).__name__ == type(make()).__name__
        opt.apply_gradients(zip(_grads(model, x, y), model.trainable_variables))
        for k, (got, s) in enumerate(zip(_weights(model), start)):
            want = s + adasum([deltas[q][k] for q in range(n)])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"var {k}")
        assert not np.allclose(_weights(model)[0], _weights(twin)[0])  # not the local update

    return case


def _fit(hvd: Any) -> None:
    r = hvd.rank()
    model = _model(seed=r)  # different on each rank: the broadcast unifies them
    hvd.broadcast_variables(model.variables, root_rank=0)
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.Adam(0.01), op=hvd.Adasum),
                  loss="mse")
    x, y = _data(r, rows=64)
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    everyone = hk.allgather_object(np.concatenate([w.ravel() for w in _weights(model)]))
    assert np.array_equal(everyone[0], everyone[1]), "weights differ across ranks"
    losses = history.history["loss"]
    assert losses[-1] < losses[0], losses


def _backward_passes(hvd: Any) -> None:
    """SGD, 2 passes per update: the first pass leaves the weights alone, the second applies
    start + adasum(-lr * (g1 + g2)) per variable (accumulated gradients summed, Horovod's
    default)."""
    r, n = hvd.rank(), hvd.size()
    model = _model(seed=0)
    start = _weights(model)
    x, y = _data(r)
    opt = hk.DistributedOptimizer(keras.optimizers.SGD(LR), op=hvd.Adasum,
                                  backward_passes_per_step=2)
    halves = [(x[:8], y[:8]), (x[8:], y[8:])]
    local = [np.zeros_like(s) for s in start]
    for i, (xs, ys) in enumerate(halves):
        grads = _grads(model, xs, ys)
        local = [acc - LR * g.numpy() for acc, g in zip(local, grads)]
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if i == 0:
            assert all(np.array_equal(w, s) for w, s in zip(_weights(model), start))
    deltas = hk.allgather_object(local)
    for k, (got, s) in enumerate(zip(_weights(model), start)):
        want = s + adasum([deltas[q][k] for q in range(n)])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"var {k}")


def _raises(exc_type: type[BaseException], fragment: str, fn: Any) -> None:
    try:
        fn()
    except exc_type as exc:
        assert fragment in str(exc), exc
    else:
        raise AssertionError(f"no {exc_type.__name__} ({fragment})")


def _errors(hvd: Any) -> None:
    _raises(ValueError, "floating-point",
            lambda: hvd.allreduce(tf.constant([1, 2]), op=hvd.Adasum))
    _raises(ValueError, "floating-point",  # at trace time, as Horovod
            lambda: tf.function(lambda t: hvd.allreduce(t, op=hvd.Adasum))(tf.constant([1])))
    sparse = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([0]), tf.constant([3, 2]))
    _raises(NotImplementedError, "sparse_as_dense", lambda: hvd.allreduce(sparse, op=hvd.Adasum))
    one = hvd.ProcessSet([0])
    _raises(NotImplementedError, "non-global process sets",
            lambda: hk.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum,
                                            process_set=one))
    with tf.GradientTape() as tape:
        pass
    _raises(NotImplementedError, "non-global process sets",
            lambda: hvd.DistributedGradientTape(tape, op=hvd.Adasum, process_set=one))
    _raises(ValueError, "op=Average, op=Sum or op=Adasum",
            lambda: hk.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Max))


def cases() -> list[tuple[str, Any]]:
    out = [("allreduce-eager", lambda hvd: _allreduce(hvd, False)),
           ("allreduce-function", lambda hvd: _allreduce(hvd, True)),
           ("tape", _tape), ("keras-sgd-step", _keras_step(lambda: keras.optimizers.SGD(LR))),
           ("keras-adam-step", _keras_step(lambda: keras.optimizers.Adam(0.01))),
           ("keras-fit", _fit), ("keras-backward-passes", _backward_passes), ("errors", _errors)]
    assert [c for c, _ in out] == CASE_IDS
    return out
