"""Case group: the rest of ``horovod.tensorflow``'s API on 2 ranks, every value checked against a
numpy reference built from every rank's inputs (exchanged with ``allgather_object``):

* ``rank_op`` / ``local_rank_op`` / ``size_op`` / ``local_size_op`` / ``process_set_included_op``
  eagerly, in a TF1 session, and in a ``tf.function`` traced once whose values follow process
  sets added and removed after the trace;
* ``SyncBatchNormalization``: outputs, moving statistics and gradients (inputs, gamma, beta)
  equal to batch normalization over the concatenated batch of both ranks, with uneven batch
  sizes, eagerly, in ``tf.function`` with a mask, and in ``model.fit``;
* ``DistributedOptimizer`` for ``tf.compat.v1.train`` optimizers: in a TF1 session (dense and
  sparse gradients together), eagerly and in ``tf.function``, with its options, with
  ``backward_passes_per_step=2``, and with ``op=Adasum`` (the delta optimizer); Keras optimizers
  delegated to ``hora.tensorflow.keras``;
* ``broadcast_global_variables`` and ``BroadcastGlobalVariablesHook`` in a session and a
  ``MonitoredTrainingSession``; the errors;
* the tape's ``get_local_and_global_gradients`` and ``hvd.elastic.TensorFlowState`` with a TF1
  session (:mod:`tf_split_state_cases`).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf
from group_tf_adasum import adasum
from tf_split_state_cases import elastic_session, tape_local_global

import hora.keras as hk
import hora.tensorflow.keras as htk

v1 = tf.compat.v1
CASE_IDS = ["graph-ops", "sync-bn-eager", "sync-bn-function-mask", "sync-bn-fit",
            "v1-session", "v1-hook", "v1-eager", "v1-options", "v1-backward-passes",
            "v1-adasum", "dispatch-errors", "tape-local-global", "elastic-session"]
LR = 0.5
EPS = 1e-3


def init(hvd: Any) -> None:
    hvd.init(process_sets="dynamic")


def _raises(exc_type: type[BaseException], fragment: str, fn: Any) -> None:
    try:
        fn()
    except exc_type as exc:
        assert fragment in str(exc), exc
    else:
        raise AssertionError(f"no {exc_type.__name__} ({fragment})")


# ---- graph ops ---------------------------------------------------------------------------------
def _graph_ops(hvd: Any) -> None:
    r = hvd.rank()
    eager = [hvd.rank_op(), hvd.local_rank_op(), hvd.size_op(), hvd.local_size_op(),
             hvd.process_set_included_op()]
    assert all(t.dtype == tf.int32 and t.shape == () for t in eager)
    assert [int(t) for t in eager] == [r, hvd.local_rank(), hvd.size(), hvd.local_size(), 1]
    with tf.Graph().as_default():
        ops = [hvd.rank_op(name="my_rank"), hvd.size_op(), hvd.local_size_op()]
        assert "my_rank" in ops[0].op.name
        with v1.Session() as sess:
            assert sess.run(ops) == [r, hvd.size(), hvd.local_size()]

    next_id = max(hvd.global_process_set.process_set_id, 0) + 1  # the id add_process_set gives

    @tf.function
    def query() -> tuple[tf.Tensor, tf.Tensor]:
        return hvd.size_op(process_set_id=next_id), hvd.process_set_included_op(next_id)

    assert [int(t) for t in query()] == [-3, -3]  # unknown set: Horovod's error code
    first = hvd.add_process_set([0])
    assert first.process_set_id == next_id
    assert [int(t) for t in query()] == [1, int(r == 0)]  # read at run time, not trace time
    hvd.remove_process_set(first)
    assert [int(t) for t in query()] == [-3, -3]
    assert query.experimental_get_tracing_count() == 1


# ---- SyncBatchNormalization --------------------------------------------------------------------
def _bn_reference(x: np.ndarray, dy: np.ndarray, gamma: np.ndarray, beta: np.ndarray,
                  axes: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Batch normalization of ``x`` (float64) and its gradients for the cotangent ``dy``."""
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    inv = 1.0 / np.sqrt(var + EPS)
    xhat = (x - mean) * inv
    return {"y": gamma * xhat + beta, "mean": mean, "var": var,
            "dx": gamma * inv * (dy - dy.mean(axis=axes) - xhat * (dy * xhat).mean(axis=axes)),
            "dgamma": (dy * xhat).sum(axis=axes), "dbeta": dy.sum(axis=axes)}


def _bn_layer(hvd: Any, channels: int, shape: tuple[int, ...]) -> Any:
    layer = hvd.SyncBatchNormalization(momentum=0.9, epsilon=EPS)
    layer.build(shape)
    rng = np.random.RandomState(7)
    layer.gamma.assign(rng.rand(channels) + 0.5)
    layer.beta.assign(rng.randn(channels))
    return layer


def _check_bn(hvd: Any, layer: Any, ref: dict[str, np.ndarray], y: Any, grads: list[Any],
              rows: slice) -> None:
    np.testing.assert_allclose(y.numpy(), ref["y"][rows], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(layer.moving_mean.numpy(), 0.1 * ref["mean"], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(), 0.9 + 0.1 * ref["var"],
                               rtol=1e-5, atol=1e-5)
    dx, dgamma, dbeta = (g.numpy() for g in grads)
    np.testing.assert_allclose(dx, ref["dx"][rows], rtol=1e-3, atol=1e-4)
    total = hk.allgather_object([dgamma, dbeta])  # each rank holds its batch's share
    np.testing.assert_allclose(sum(t[0] for t in total), ref["dgamma"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(sum(t[1] for t in total), ref["dbeta"], rtol=1e-4, atol=1e-4)


def _sync_bn_eager(hvd: Any) -> None:
    r = hvd.rank()
    rng = np.random.RandomState(20 + r)
    n = 3 + 2 * r  # uneven batches: 3 and 5 rows
    x = (rng.randn(n, 2, 3, 4) * (1 + np.arange(4)) + 50.0).astype("float32")  # far from 0
    dy = rng.randn(n, 2, 3, 4).astype("float32")
    layer = _bn_layer(hvd, 4, (None, 2, 3, 4))
    assert layer.name.startswith("sync_batch_normalization")
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = layer(xt, training=True)
        loss = tf.reduce_sum(y * dy)
    grads = tape.gradient(loss, [xt, layer.gamma, layer.beta])
    everyone = hk.allgather_object((x, dy))
    big_x = np.concatenate([e[0] for e in everyone]).astype(np.float64)
    big_dy = np.concatenate([e[1] for e in everyone]).astype(np.float64)
    ref = _bn_reference(big_x, big_dy, layer.gamma.numpy(), layer.beta.numpy(), (0, 1, 2))
    _check_bn(hvd, layer, ref, y, grads, slice(3 * r, 3 * r + n))
    inference = layer(xt, training=False).numpy()  # moving statistics, no collective
    moving = (x - layer.moving_mean.numpy()) / np.sqrt(layer.moving_variance.numpy() + EPS)
    np.testing.assert_allclose(inference, moving * layer.gamma.numpy() + layer.beta.numpy(),
                               rtol=1e-4, atol=1e-4)


def _sync_bn_function_mask(hvd: Any) -> None:
    r = hvd.rank()
    rng = np.random.RandomState(40 + r)
    n = 4 + 3 * r
    x = rng.randn(n, 5, 3).astype("float32")
    mask = rng.rand(n, 5) > 0.3
    dy = rng.randn(n, 5, 3).astype("float32") * mask[..., None]
    layer = _bn_layer(hvd, 3, (None, 5, 3))

    @tf.function
    def step(xt: tf.Tensor, m: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor]]:
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = layer(xt, training=True, mask=m)
            loss = tf.reduce_sum(y * dy)
        return y, tape.gradient(loss, [xt, layer.gamma, layer.beta])

    y, grads = step(tf.constant(x), tf.constant(mask))
    everyone = hk.allgather_object((x, dy, mask))
    keep = np.concatenate([e[2] for e in everyone]).ravel()
    big_x = np.concatenate([e[0] for e in everyone]).reshape(-1, 3)[keep].astype(np.float64)
    big_dy = np.concatenate([e[1] for e in everyone]).reshape(-1, 3)[keep].astype(np.float64)
    ref = _bn_reference(big_x, big_dy, layer.gamma.numpy(), layer.beta.numpy(), (0,))
    start = int(sum(e[2].sum() for e in everyone[:r]))  # this rank's kept positions
    grads = [tf.constant(grads[0].numpy()[mask]), grads[1], grads[2]]
    _check_bn(hvd, layer, ref, tf.constant(y.numpy()[mask]), grads,
              slice(start, start + int(mask.sum())))
    _raises(ValueError, "does not support fused=True",
            lambda: hvd.SyncBatchNormalization(fused=True))
    layer2 = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(layer2) is hvd.SyncBatchNormalization and layer2.momentum == 0.9


def _sync_bn_fit(hvd: Any) -> None:
    """One full-batch step of ``fit`` per rank (6 and 10 rows): the moving statistics are
    those of the concatenated batch's hidden activations, and the weights agree."""
    r = hvd.rank()
    rng = np.random.RandomState(60 + r)
    x = rng.randn(6 + 4 * r, 3).astype("float32")
    y = rng.randn(6 + 4 * r, 1).astype("float32")
    keras.utils.set_random_seed(r)  # different initial weights: the broadcast unifies them
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              hvd.SyncBatchNormalization(momentum=0.5), keras.layers.Dense(1)])
    hvd.broadcast_variables(model.variables, root_rank=0)
    kernel, bias = (v.numpy() for v in model.layers[0].weights)
    model.compile(optimizer=htk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    big_x = np.concatenate(hk.allgather_object(x)).astype(np.float64)
    hidden = big_x @ kernel + bias
    bn = model.layers[1]
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.5 * hidden.mean(0), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), 0.5 + 0.5 * hidden.var(0),
                               rtol=1e-5, atol=1e-5)
    weights = np.concatenate([v.numpy().ravel() for v in model.weights])
    everyone = hk.allgather_object(weights)
    np.testing.assert_array_equal(everyone[0], everyone[1])


# ---- tf.compat.v1 optimizers -------------------------------------------------------------------
def _linear(rank: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(80 + 10 * seed + rank)
    return rng.randn(6, 3).astype("float32"), rng.randn(6, 1).astype("float32")


def _mse_grad(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return 2 * x.T.astype(np.float64) @ (x @ w - y)


def _v1_session(hvd: Any) -> None:
    """A TF1 graph: dense and sparse gradients averaged, broadcast_global_variables."""
    r, n = hvd.rank(), hvd.size()
    x, y = _linear(r)
    ids = np.array([0, 2, 2] if r == 0 else [1, 2], np.int32)
    with tf.Graph().as_default():
        w = v1.get_variable("w", initializer=tf.constant(np.full((3, 1), r + 1.0, "float32")))
        emb = v1.get_variable("emb", initializer=tf.constant(np.ones((4, 2), "float32")))
        loss = tf.reduce_sum(tf.square(x @ w - y)) + tf.reduce_sum(tf.gather(emb, ids) * 3.0)
        opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(LR))
        pairs = opt.compute_gradients(loss)
        assert isinstance(pairs[1][0], tf.IndexedSlices)
        train = opt.apply_gradients(pairs)
        bcast = hvd.broadcast_global_variables(0)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(bcast)
            w0 = sess.run(w)
            np.testing.assert_array_equal(w0, np.ones((3, 1)))  # rank 0's
            sess.run(train)
            got_w, got_emb = sess.run([w, emb])
    data = hk.allgather_object((x, y, ids))
    grad = sum(_mse_grad(w0, dx, dy) for dx, dy, _ in data) / n
    np.testing.assert_allclose(got_w, w0 - LR * grad, rtol=1e-5, atol=1e-5)
    want = np.ones((4, 2))
    for _, _, i in data:
        np.subtract.at(want, i, LR * 3.0 / n)
    np.testing.assert_allclose(got_emb, want, rtol=1e-6)
    _raises(RuntimeError, "does not support eager execution",
            lambda: hvd.broadcast_global_variables(0))


def _v1_hook(hvd: Any) -> None:
    r = hvd.rank()
    with tf.Graph().as_default():
        w = v1.get_variable("w", initializer=tf.constant([r + 1.0, 10.0 * r]))
        step = v1.train.get_or_create_global_step()
        train = v1.assign_add(step, 1)
        hook = hvd.BroadcastGlobalVariablesHook(0)
        assert isinstance(hook, v1.train.SessionRunHook)
        with v1.train.MonitoredTrainingSession(hooks=[hook]) as sess:
            sess.run(train)
            got = sess.run(w)
    np.testing.assert_array_equal(got, [1.0, 0.0])  # rank 0's initial values on every rank


def _v1_eager(hvd: Any) -> None:
    """Eagerly and in tf.function: averaged gradients; Adam's state stays identical."""
    r, n = hvd.rank(), hvd.size()
    x, y = _linear(r)
    data = hk.allgather_object((x, y))
    for traced in (False, True):
        w = tf.Variable(np.ones((3, 1), "float32"))
        opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(LR))

        def step(opt: Any = opt, w: Any = w) -> None:
            opt.minimize(lambda: tf.reduce_sum(tf.square(x @ w - y)), var_list=[w])
        (tf.function(step) if traced else step)()
        want = 1.0 - LR * sum(_mse_grad(np.ones((3, 1)), dx, dy) for dx, dy in data) / n
        np.testing.assert_allclose(w.numpy(), want, rtol=1e-5, atol=1e-5)
    w = tf.Variable(np.full((3, 1), r + 1.0, "float32"))
    hvd.broadcast_variables([w], 0)
    adam = hvd.DistributedOptimizer(v1.train.AdamOptimizer(0.1))
    for _ in range(3):
        adam.minimize(lambda: tf.reduce_sum(tf.square(x @ w - y)), var_list=[w])
    everyone = hk.allgather_object((w.numpy(), adam.get_slot(w, "m").numpy()))
    np.testing.assert_array_equal(everyone[0][0], everyone[1][0])
    np.testing.assert_array_equal(everyone[0][1], everyone[1][1])


def _v1_options(hvd: Any) -> None:
    """op=Sum, the predivide factor, fp16 compression, groups, a local variable."""
    r, n = hvd.rank(), hvd.size()
    x, y = _linear(r)
    data = hk.allgather_object((x, y))
    ones = np.ones((3, 1))
    mean = sum(_mse_grad(ones, dx, dy) for dx, dy in data) / n
    local = _mse_grad(ones, x, y)
    variants = [({"op": hvd.Sum}, mean * n, 1e-5), ({"gradient_predivide_factor": 2.0}, mean,
                                                    1e-5),
                ({"compression": hvd.Compression.fp16}, mean, 2e-2), ({"groups": 1}, mean, 1e-5)]
    for kwargs, want, tol in variants:
        w = tf.Variable(np.ones((3, 1), "float32"))
        b = tf.Variable(np.zeros((1,), "float32"))
        opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(LR), **kwargs)
        pairs = opt.compute_gradients(
            lambda w=w, b=b: tf.reduce_sum(tf.square(x @ w + b - y)), var_list=[w, b])
        np.testing.assert_allclose(pairs[0][0].numpy(), want, rtol=tol, atol=tol,
                                   err_msg=str(kwargs))
    w = tf.Variable(np.ones((3, 1), "float32"))
    opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(LR))
    opt.register_local_var(w)
    pairs = opt.compute_gradients(lambda: tf.reduce_sum(tf.square(x @ w - y)), var_list=[w])
    np.testing.assert_allclose(pairs[0][0].numpy(), local / n, rtol=1e-5, atol=1e-5)


def _v1_backward_passes(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    passes = [_linear(r, seed=s) for s in (1, 2)]
    data = hk.allgather_object(passes)
    for average in (False, True):
        with tf.Graph().as_default():
            xp = v1.placeholder(tf.float32, (6, 3))
            yp = v1.placeholder(tf.float32, (6, 1))
            w = v1.get_variable("w", initializer=tf.constant(np.ones((3, 1), "float32")))
            step = v1.train.get_or_create_global_step()
            opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(LR),
                                           backward_passes_per_step=2,
                                           average_aggregated_gradients=average)
            train = opt.minimize(tf.reduce_sum(tf.square(xp @ w - yp)), global_step=step)
            with v1.Session() as sess:
                sess.run([v1.global_variables_initializer(), v1.local_variables_initializer()])
                sess.run(train, {xp: passes[0][0], yp: passes[0][1]})
                after_one = sess.run([w, step])
                sess.run(train, {xp: passes[1][0], yp: passes[1][1]})
                after_two = sess.run([w, step])
        np.testing.assert_array_equal(after_one[0], np.ones((3, 1)))
        assert after_one[1] == 1 and after_two[1] == 2, (after_one[1], after_two[1])
        ones = np.ones((3, 1))
        total = sum(_mse_grad(ones, dx, dy) for rank_passes in data for dx, dy in rank_passes)
        want = 1.0 - LR * total / n / (2 if average else 1)
        np.testing.assert_allclose(after_two[0], want, rtol=1e-5, atol=1e-5)


def _v1_adasum(hvd: Any) -> None:
    """The delta optimizer: every rank's SGD change combined with Adasum; with 2 passes per
    combination the first pass stays local."""
    r = hvd.rank()
    rng = np.random.RandomState(90 + r)
    a = [rng.randn(4).astype("float32") + 1.0 for _ in range(2)]  # linear loss: grad = a
    everyone = hk.allgather_object(a)
    w = tf.Variable(np.ones(4, "float32"))
    opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(LR), op=hvd.Adasum)
    opt.minimize(lambda: tf.reduce_sum(w * a[0]), var_list=[w])
    want = 1.0 + adasum([-LR * e[0] for e in everyone])
    np.testing.assert_allclose(w.numpy(), want, rtol=1e-5, atol=1e-5)
    with tf.Graph().as_default():
        wg = v1.get_variable("w", initializer=tf.constant(np.ones(4, "float32")))
        ap = v1.placeholder(tf.float32, (4,))
        opt = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(LR), op=hvd.Adasum,
                                       backward_passes_per_step=2)
        train = opt.minimize(tf.reduce_sum(wg * ap))
        assert "delta_start" in opt.get_slot_names()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train, {ap: a[0]})
            local = sess.run(wg)
            sess.run(train, {ap: a[1]})
            got = sess.run(wg)
    np.testing.assert_allclose(local, 1.0 - LR * a[0], rtol=1e-6)
    want = 1.0 + adasum([-LR * (e[0] + e[1]) for e in everyone])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _dispatch_errors(hvd: Any) -> None:
    wrapped = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert type(wrapped).__name__ == "SGD" and hasattr(wrapped, "_hora_reducer")
    _raises(ValueError, "doesn't inherit from either legacy TensorFlow or Keras optimizer",
            lambda: hvd.DistributedOptimizer(object()))
    sgd = v1.train.GradientDescentOptimizer(0.1)
    _raises(ValueError, "average_aggregated_gradients == True",
            lambda: hvd.DistributedOptimizer(sgd, op=hvd.Adasum, backward_passes_per_step=2,
                                             average_aggregated_gradients=True))
    _raises(ValueError, "gradient_predivide_factor not supported with op != Average",
            lambda: hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2.0))
    _raises(ValueError, "not yet supported for _LegacyOptimizer with eager execution",
            lambda: hvd.DistributedOptimizer(sgd, backward_passes_per_step=2))
    with tf.Graph().as_default():
        emb = v1.get_variable("emb", initializer=tf.constant(np.ones((3, 2), "float32")))
        opt = hvd.DistributedOptimizer(sgd, backward_passes_per_step=2)
        _raises(ValueError, "`sparse_as_dense` is False",
                lambda: opt.minimize(tf.reduce_sum(tf.gather(emb, [0]))))


def cases() -> list[tuple[str, Any]]:
    out = [("graph-ops", _graph_ops), ("sync-bn-eager", _sync_bn_eager),
           ("sync-bn-function-mask", _sync_bn_function_mask), ("sync-bn-fit", _sync_bn_fit),
           ("v1-session", _v1_session), ("v1-hook", _v1_hook), ("v1-eager", _v1_eager),
           ("v1-options", _v1_options), ("v1-backward-passes", _v1_backward_passes),
           ("v1-adasum", _v1_adasum), ("dispatch-errors", _dispatch_errors),
           ("tape-local-global", tape_local_global), ("elastic-session", elastic_session)]
    assert [c for c, _ in out] == CASE_IDS
    return out
