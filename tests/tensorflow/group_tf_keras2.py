"""Case group: Keras 2 through tf-keras (``TF_USE_LEGACY_KERAS=1`` in the job's environment, so
``tf.keras`` is tf-keras) with ``hora.tensorflow.keras`` / ``hora.keras`` on 2 ranks.

Optimizer cases here (``model.fit`` with v2.11+ and legacy optimizers against one process
training on the union of the ranks' batches; ``backward_passes_per_step`` arithmetic against
numpy, eagerly and in ``tf.function``, with sparse and local gradients; partial / local
variables; config round trip; errors); callbacks, ``load_model`` and elastic states in
:mod:`tf_keras2_cases`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
from tf_fit_checks import epoch_check, interleaved
from tf_keras2_cases import (
    BATCH,
    STEPS,
    TfKerasOptimizer,
    callbacks_lr,
    callbacks_momentum,
    data,
    elastic_callbacks,
    elastic_state,
    keras,
    load_model,
    make_model,
    sync_batch_norm,
    weights,
)

import hora.keras as hkk
import hora.tensorflow.keras as hk
from hora.tensorflow.keras_flavor import is_keras2, legacy_keras

CASE_IDS = ["flavor", "fit-new", "fit-legacy", "fit-new-passes-sum", "fit-legacy-passes-avg",
            "aggregation-eager", "aggregation-function", "aggregation-legacy-function",
            "sparse-allgather", "partial-local", "graph-mode-fit", "config", "errors",
            "callbacks-lr", "callbacks-momentum", "load-model", "elastic-state",
            "elastic-callbacks", "sync-batch-norm"]


def init(hvd: Any) -> None:
    hvd.init()


def _sgd(kind: str, lr: float, **kwargs: Any) -> Any:
    return (keras.optimizers.legacy.SGD if kind == "legacy" else keras.optimizers.SGD)(
        learning_rate=lr, **kwargs)


def _flavor(hvd: Any) -> None:
    assert legacy_keras(), keras
    assert TfKerasOptimizer.__module__.startswith("tf_keras."), TfKerasOptimizer.__module__
    for cb in (hk.callbacks.BroadcastGlobalVariablesCallback, hk.callbacks.MetricAverageCallback,
               hk.callbacks.LearningRateScheduleCallback, hk.callbacks.LearningRateWarmupCallback,
               hk.elastic.CommitStateCallback, hk.elastic.UpdateBatchStateCallback,
               hk.elastic.UpdateEpochStateCallback):
        assert issubclass(cb, keras.callbacks.Callback), cb
    assert issubclass(hk.callbacks.BestModelCheckpoint, keras.callbacks.ModelCheckpoint)
    assert hkk.callbacks.MetricAverageCallback is hk.callbacks.MetricAverageCallback
    assert hkk.DistributedOptimizer is hk.DistributedOptimizer
    assert hkk.elastic.KerasState is hk.elastic.KerasState


def _fit_case(kind: str, passes: int, average: bool) -> Any:
    def case(hvd: Any) -> None:
        r, n = hvd.rank(), hvd.size()
        model = make_model(seed=r)  # different on each rank: the broadcast below unifies them
        hvd.broadcast_variables(model.variables, root_rank=0)
        start = [np.asarray(v.numpy()) for v in model.weights]
        opt = hk.DistributedOptimizer(_sgd(kind, 0.1), backward_passes_per_step=passes,
                                      average_aggregated_gradients=average)
        assert type(opt).__name__ == "SGD" and is_keras2(opt)
        model.compile(optimizer=opt, loss="mse")
        x, y = data(r)
        check = epoch_check(keras.callbacks.Callback, hk.allgather_object)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[check])
        assert check.epochs == 2
        assert int(opt.iterations.numpy()) == 2 * STEPS, opt.iterations.numpy()
        if passes > 1:
            assert int(opt._agg_helper.counter.numpy()) == (2 * STEPS) % passes
        # one process, plain SGD of the same kind, on the union of the batches: the
        # accumulated passes are summed (Horovod's default) or averaged
        ref = make_model(seed=0)
        for v, s in zip(ref.weights, start):
            v.assign(s)
        ref.compile(optimizer=_sgd(kind, 0.1 * (1 if average else passes)), loss="mse")
        rx, ry = interleaved(data, n, STEPS, BATCH, passes)
        ref.fit(rx, ry, batch_size=BATCH * n * passes, epochs=2, shuffle=False, verbose=0)
        assert np.allclose(weights(model), weights(ref), atol=1e-5), \
            f"distributed {weights(model)[:4]} != one process {weights(ref)[:4]}"
    return case


PASSES, TOTAL = 2, 5


def _pass_values(r: int, p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What rank r's pass p differentiates to: d/dw, the two gathered rows' d/de, d/dloc."""
    a = np.array([1.0, -2.0, 0.5], np.float32) * (r + 1) * (p + 1)
    b = np.array([[0.5, 1.0], [-1.0, 2.0]], np.float32) * (r + 2) + p
    c = np.array([3.0, -1.0], np.float32) * (r + 1) + p
    return a, b, c


def _rows(r: int) -> list[int]:
    return [r % 4, 2]


def _aggregation_case(kind: str, in_function: bool, average: bool) -> Any:
    """backward_passes_per_step=2 over 5 passes: dense, sparse-as-dense, local and unused
    variables, against numpy built from every rank's gradients."""
    def case(hvd: Any) -> None:
        r, n = hvd.rank(), hvd.size()
        w = tf.Variable(np.zeros(3, np.float32))
        e = tf.Variable(np.zeros((4, 2), np.float32))
        loc = tf.Variable(np.zeros(2, np.float32))
        unused = tf.Variable(np.zeros(1, np.float32))
        variables = [w, e, loc, unused]
        opt = hk.DistributedOptimizer(_sgd(kind, 1.0), backward_passes_per_step=PASSES,
                                      average_aggregated_gradients=average,
                                      sparse_as_dense=True)
        opt.register_local_var(loc)
        _ = opt.iterations
        step = tf.Variable(0)

        def loss() -> Any:
            p = tf.cast(step, tf.float32)
            a = tf.constant([1.0, -2.0, 0.5]) * (r + 1) * (p + 1)
            b = tf.constant([[0.5, 1.0], [-1.0, 2.0]]) * (r + 2) + p
            c = tf.constant([3.0, -1.0]) * (r + 1) + p
            return (tf.reduce_sum(w * a) + tf.reduce_sum(tf.gather(e, _rows(r)) * b)
                    + tf.reduce_sum(loc * c))

        def one_pass() -> None:
            pairs = opt._compute_gradients(loss, var_list=variables)
            opt.apply_gradients(pairs)
            step.assign_add(1)

        run = tf.function(one_pass) if in_function else one_pass
        want_w, want_e, want_loc = np.zeros(3), np.zeros((4, 2)), np.zeros(2)
        acc_w, acc_e, acc_loc = np.zeros(3), np.zeros((4, 2)), np.zeros(2)
        for p in range(TOTAL):
            run()
            for q in range(n):
                a, b, c = _pass_values(q, p)
                acc_w += a / n
                np.add.at(acc_e, _rows(q), b / n)
                if q == r:
                    acc_loc += c / n  # local: this rank's own gradient, scaled by 1/size
            if (p + 1) % PASSES == 0:
                div = PASSES if average else 1
                want_w -= acc_w / div
                want_e -= acc_e / div
                want_loc -= acc_loc / div
                acc_w, acc_e, acc_loc = np.zeros(3), np.zeros((4, 2)), np.zeros(2)
            for got, want, what in ((w, want_w, "w"), (e, want_e, "e"), (loc, want_loc, "loc")):
                assert np.allclose(got.numpy(), want, atol=1e-5), \
                    (p, what, got.numpy().tolist(), want.tolist())
            assert int(opt.iterations.numpy()) == p + 1, opt.iterations.numpy()
        assert int(opt._agg_helper.counter.numpy()) == TOTAL % PASSES
        assert float(unused.numpy()[0]) == 0.0
    return case


def _sparse_allgather(hvd: Any) -> None:
    """One pass per step, no sparse_as_dense: the IndexedSlices are allgathered and averaged."""
    r, n = hvd.rank(), hvd.size()
    e = tf.Variable(np.zeros((4, 2), np.float32))
    opt = hk.DistributedOptimizer(_sgd("new", 1.0))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(e, _rows(r)) * _pass_values(r, 0)[1])
    pairs = opt._compute_gradients(loss, [e], tape=tape)
    assert isinstance(pairs[0][0], tf.IndexedSlices), type(pairs[0][0])
    opt.apply_gradients(pairs)
    want = np.zeros((4, 2))
    for q in range(n):
        np.add.at(want, _rows(q), -_pass_values(q, 0)[1] / n)
    assert np.allclose(e.numpy(), want, atol=1e-6), (e.numpy().tolist(), want.tolist())


def _partial_local(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    model = make_model(seed=r)
    x, y = data(r)
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_mean((model(x[:BATCH], training=True) - y[:BATCH]) ** 2)
    own = [g.numpy() for g in tape.gradient(loss, model.trainable_weights)]
    opt = hkk.PartialDistributedOptimizer(keras.optimizers.Adam(0.01),
                                          local_layers=[model.layers[0]])
    pairs = opt._compute_gradients(loss, model.trainable_weights, tape=tape)
    everyone = hk.allgather_object(own)
    local = {id(v) for v in model.layers[0].trainable_weights}
    for i, (g, v) in enumerate(pairs):
        want = own[i] / n if id(v) in local else np.mean([e[i] for e in everyone], axis=0)
        assert np.allclose(g.numpy(), want, atol=1e-6), (v.name, g.numpy(), want)
    hvd.broadcast_variables(model.variables, root_rank=0)  # the same start, then fit
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    first = hk.allgather_object([w.numpy() for w in model.layers[0].weights])
    last = hk.allgather_object([w.numpy() for w in model.layers[1].weights])
    assert not np.array_equal(first[0][0], first[1][0]), "local layer was averaged"
    assert all(np.array_equal(a, b) for a, b in zip(last[0], last[1])), "global layer differs"


def _graph_mode_fit(hvd: Any) -> None:
    """TF1 graph-mode Keras (a model built in a tf.Graph trains through get_gradients / the
    session): a linear model, legacy SGD, one pass per step and 2 passes summed, against numpy
    from both ranks' batches."""
    r, n = hvd.rank(), hvd.size()
    xs = [data(q)[0] for q in range(n)]
    ys = [(x @ np.array([[1.0], [-2.0], [0.5], [3.0], [0.0]], np.float32)) for x in xs]
    for passes in (1, 2):
        with tf.Graph().as_default():
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(
                1, kernel_initializer="zeros", bias_initializer=keras.initializers.Constant(0.5))])
            opt = hk.DistributedOptimizer(keras.optimizers.legacy.SGD(0.1),
                                          backward_passes_per_step=passes)
            model.compile(optimizer=opt, loss="mse")
            model.fit(xs[r], ys[r], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            w, b = model.get_weights()
            assert int(keras.backend.get_value(opt.iterations)) == STEPS  # every pass counts
        want_w, want_b = np.zeros((5, 1)), np.array([0.5])
        gw, gb = np.zeros((5, 1)), np.zeros(1)
        for step in range(STEPS):
            rows = slice(step * BATCH, (step + 1) * BATCH)
            for q in range(n):
                err = xs[q][rows] @ want_w + want_b - ys[q][rows]
                gw += 2.0 * xs[q][rows].T @ err / BATCH / n
                gb += 2.0 * err.sum(0) / BATCH / n
            if (step + 1) % passes == 0:
                want_w, want_b = want_w - 0.1 * gw, want_b - 0.1 * gb
                gw, gb = np.zeros((5, 1)), np.zeros(1)
        assert np.allclose(w, want_w, atol=1e-5) and np.allclose(b, want_b, atol=1e-5), \
            (passes, w.ravel().tolist(), want_w.ravel().tolist())


def _config(hvd: Any) -> None:
    for base in (keras.optimizers.Adam(0.003), keras.optimizers.legacy.Adam(0.003)):
        opt = hk.DistributedOptimizer(base, backward_passes_per_step=3)
        cls = type(opt)
        assert cls.__name__ == type(base).__name__ and cls.__module__ == type(base).__module__
        assert isinstance(opt, type(base))
        cfg = opt.get_config()
        assert cfg == base.get_config(), (cfg, base.get_config())
        for copy in (opt.from_config(cfg), cls.from_config(cfg)):
            assert copy.get_config() == cfg
            assert copy._agg_helper is not None and copy._agg_helper.passes == 3
            assert copy._hora_reducer is not opt._hora_reducer  # its own local variables
        assert opt._hora_reducer.prefix == "DistributedAdam"
    # hora.tensorflow.DistributedOptimizer hands tf-keras optimizers to the Keras wrapper
    wrapped = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert type(wrapped).__name__ == "SGD" and hasattr(wrapped, "_hora_reducer")


def _errors(hvd: Any) -> None:
    for bad in ({"op": hk.Max}, {"op": hk.Adasum}, {"backward_passes_per_step": 0}):
        try:
            hk.DistributedOptimizer(keras.optimizers.SGD(0.1), **bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"DistributedOptimizer accepted {bad}")
    e = tf.Variable(np.zeros((4, 2), np.float32))
    opt = hk.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    try:
        opt._compute_gradients(lambda: tf.reduce_sum(tf.gather(e, [1])), [e])
    except ValueError as exc:
        assert "sparse_as_dense" in str(exc), exc
    else:
        raise AssertionError("sparse gradients with backward_passes_per_step > 1 accepted")
    try:
        hk.broadcast_global_variables(0)
    except RuntimeError as exc:
        assert "broadcast_variables" in str(exc)
    else:
        raise AssertionError("broadcast_global_variables must raise in TensorFlow 2")


def cases() -> list[tuple[str, Any]]:
    out = [("flavor", _flavor), ("fit-new", _fit_case("new", 1, False)),
           ("fit-legacy", _fit_case("legacy", 1, False)),
           ("fit-new-passes-sum", _fit_case("new", 2, False)),
           ("fit-legacy-passes-avg", _fit_case("legacy", 2, True)),
           ("aggregation-eager", _aggregation_case("new", False, False)),
           ("aggregation-function", _aggregation_case("new", True, True)),
           ("aggregation-legacy-function", _aggregation_case("legacy", True, False)),
           ("sparse-allgather", _sparse_allgather), ("partial-local", _partial_local),
           ("graph-mode-fit", _graph_mode_fit),
           ("config", _config), ("errors", _errors), ("callbacks-lr", callbacks_lr),
           ("callbacks-momentum", callbacks_momentum), ("load-model", load_model),
           ("elastic-state", elastic_state), ("elastic-callbacks", elastic_callbacks),
           ("sync-batch-norm", sync_batch_norm)]
    assert [c for c, _ in out] == CASE_IDS
    return out
