"""tf-keras (Keras 2) cases of :mod:`group_tf_keras2`: the callbacks (learning rates per batch
read through ``optimizer.lr``, momentum correction of a legacy optimizer, averaged metrics, the
broadcast with local variables), ``load_model`` (saved formats, plain Keras vs hora, legacy and
v2.11+ optimizers, a custom optimizer) and the elastic states and callbacks; and the helpers the
group shares. Imported only by the ranks of a job started with ``TF_USE_LEGACY_KERAS=1``."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np
import tensorflow as tf

# imported before hora.tensorflow.keras, as Horovod's scripts do: tf.keras is then a module
# named "tensorflow.keras" whichever Keras it is, and hora must still see tf-keras
from tensorflow.keras.optimizers import Optimizer as TfKerasOptimizer  # noqa: F401
from tf_fit_checks import weights

import hora.tensorflow.keras as hk

keras: Any = tf.keras  # tf-keras in these jobs
STEPS, BATCH = 4, 8


def data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(100 + rank)
    x = rng.randn(STEPS * BATCH, 5).astype("float32")
    return x, (x @ np.arange(1.0, 6.0, dtype="float32")[:, None] > 0).astype("float32")


def make_model(seed: int) -> Any:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(1)])


class _Seen(keras.callbacks.Callback):
    """Per batch: the learning rate (``optimizer.lr``, Horovod's Keras 2 attribute) and the
    momentum at batch begin and end; per epoch: the logs."""

    def __init__(self) -> None:
        super().__init__()
        self.lrs: list[float] = []
        self.momenta: list[tuple[float, float]] = []
        self.logs: list[dict[str, float]] = []

    def _momentum(self) -> float:
        m = getattr(self.model.optimizer, "momentum", 0.0)
        return float(keras.backend.get_value(m))

    def on_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.lrs.append(float(keras.backend.get_value(self.model.optimizer.lr)))
        self.momenta.append((self._momentum(), 0.0))

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.momenta[-1] = (self.momenta[-1][0], self._momentum())

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.logs.append(dict(logs or {}))


def _warmup(n: int, lr: float) -> list[float]:
    return [lr / n * ((b + 1) / STEPS * (n - 1) + 1) for b in range(STEPS)]


def callbacks_lr(hvd: Any) -> None:
    """v2.11+ SGD: warmup then schedule per batch, averaged metrics, the broadcast leaving a
    local layer alone."""
    r, n = hvd.rank(), hvd.size()
    model = make_model(seed=r)  # different per rank: the callback broadcasts from the root
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  metrics=["mae"])
    x, y = data(r)
    local_vars = list(model.layers[0].variables)
    local, averaged = _Seen(), _Seen()
    root = n - 1
    callbacks = [hk.callbacks.BroadcastGlobalVariablesCallback(root, local_variables=local_vars),
                 hk.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1, verbose=0),
                 hk.callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=1), local,
                 hk.callbacks.MetricAverageCallback(), averaged]
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    everyone = hk.allgather_object([v.numpy() for v in model.variables])
    first = {id(v) for v in local_vars}
    for i, v in enumerate(model.variables):  # the local kernel keeps each rank's init
        same = all(np.array_equal(everyone[0][i], e[i]) for e in everyone)
        if id(v) not in first:
            assert same, (v.name, "differs across ranks")
        elif v is model.layers[0].kernel:
            assert not same, (v.name, "local variable was broadcast")
    logs = hk.allgather_object(local.logs)
    for epoch, got in enumerate(averaged.logs):
        for key in ("loss", "mae"):
            want = np.mean([logs[q][epoch][key] for q in range(n)])
            assert abs(got[key] - want) < 1e-6, (epoch, key, got[key], want)
    assert np.allclose(local.lrs[:STEPS], _warmup(n, 0.1), rtol=1e-5), local.lrs[:STEPS]
    assert np.allclose(local.lrs[STEPS:], [0.1] * STEPS + [0.05] * STEPS, rtol=1e-5), \
        local.lrs[STEPS:]
    assert abs(averaged.logs[-1]["lr"] - 0.05) < 1e-6


def callbacks_momentum(hvd: Any) -> None:
    """A legacy SGD with momentum (a variable): during each warmup batch the momentum is
    scaled by new_lr / old_lr, and restored at the batch end."""
    r, n = hvd.rank(), hvd.size()
    model = make_model(seed=0)
    opt = keras.optimizers.legacy.SGD(learning_rate=0.4, momentum=0.9)
    model.compile(optimizer=hk.DistributedOptimizer(opt), loss="mse")
    seen = _Seen()
    x, y = data(r)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[hk.callbacks.LearningRateWarmupCallback(0.2, warmup_epochs=1), seen])
    lrs = _warmup(n, 0.2)
    assert np.allclose(seen.lrs, lrs, rtol=1e-5), seen.lrs
    for b, (during, after) in enumerate(seen.momenta):
        old = 0.4 if b == 0 else lrs[b - 1]
        assert abs(during - 0.9 * lrs[b] / old) < 1e-5, (b, during, 0.9 * lrs[b] / old)
        assert abs(after - 0.9) < 1e-6, (b, after)


class MySGD(keras.optimizers.SGD):
    """A user's optimizer class, for ``custom_optimizers``."""


def _loaded(path: Any, kind: str, opt_class: Any, custom: list[Any]) -> None:
    plain = keras.models.load_model(path, custom_objects={"MySGD": MySGD})
    assert type(plain.optimizer).__name__ == opt_class.__name__
    assert not hasattr(plain.optimizer, "_hora_reducer"), "saved models must load without hora"
    loaded = hk.load_model(path, custom_optimizers=custom)
    opt = loaded.optimizer
    assert hasattr(opt, "_hora_reducer"), f"{path}: load_model did not wrap"
    assert isinstance(opt, opt_class), (type(opt).__mro__, opt_class)
    assert (kind == "legacy") == isinstance(opt, keras.optimizers.legacy.Optimizer), kind
    # as plain tf-keras loads it (a legacy optimizer's state is not restored from .keras)
    steps = int(opt.iterations.numpy())
    assert steps == int(plain.optimizer.iterations.numpy()), (path, steps)
    assert steps == STEPS or (kind == "legacy" and str(path).endswith(".keras")), (path, steps)
    r = hk.rank()
    x, y = data(r)
    loaded.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    everyone = hk.allgather_object(weights(loaded))
    assert np.array_equal(everyone[0], everyone[1]), f"{path}: weights differ after fit"


def load_model(hvd: Any) -> None:
    """Save with a distributed optimizer (.keras and .h5; v2.11+, legacy and a custom class),
    load with plain tf-keras (not wrapped) and with hk.load_model (wrapped, state kept)."""
    x, y = data(hvd.rank())
    makers = [("new", keras.optimizers.Adam, []), ("legacy", keras.optimizers.legacy.Adam, []),
              ("new", MySGD, [MySGD])]
    with tempfile.TemporaryDirectory() as tmp:
        for kind, opt_class, custom in makers:
            model = make_model(seed=0)
            model.compile(optimizer=hk.DistributedOptimizer(opt_class(learning_rate=0.01)),
                          loss="mse")
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
            for ext in ("keras", "h5"):
                path = os.path.join(tmp, f"{kind}-{opt_class.__name__}-{hvd.rank()}.{ext}")
                model.save(path)
                _loaded(path, kind, opt_class, custom)


def elastic_state(hvd: Any) -> None:
    """KerasState of a tf-keras model with a v2.11+ and a legacy optimizer not yet used: the
    optimizer's slots are built now, sync gives every rank rank 0's values, restore / commit."""
    r = hvd.rank()
    for opt in (keras.optimizers.Adam(0.001), keras.optimizers.legacy.Adam(0.001)):
        model = make_model(seed=r)
        state = hk.elastic.KerasState(model, opt, batch=20 + r, epoch=10 + r)
        opt_vars = opt.variables
        opt_vars = list(opt_vars() if callable(opt_vars) else opt_vars)
        assert len(opt_vars) >= 1 + 2 * len(model.trainable_weights), len(opt_vars)
        for v in opt_vars:  # give each rank different optimizer values
            if v.dtype.is_floating:
                v.assign(tf.fill(v.shape, tf.cast(r + 1, v.dtype)))
        state.sync()
        everyone = hk.allgather_object([v.numpy() for v in model.weights + opt_vars])
        assert all(np.array_equal(a, b) for a, b in zip(everyone[0], everyone[1]))
        assert state.batch == 20 and state.epoch == 10
        synced = [v.numpy() for v in model.weights]
        for v in model.weights:
            v.assign(tf.zeros_like(v))
        state.batch = 21
        state.restore()
        assert all(np.array_equal(v.numpy(), s) for v, s in zip(model.weights, synced))
        assert state.batch == 20
        for v in model.weights:
            v.assign(tf.ones_like(v))
        state.epoch = 11
        state.commit()
        state.restore()
        assert all(np.all(v.numpy() == 1) for v in model.weights) and state.epoch == 11


class _CountingState(hk.elastic.KerasState):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commits: list[tuple[int, int]] = []

    def commit(self) -> None:
        super().commit()
        self.commits.append((self.epoch, self.batch))


def elastic_callbacks(hvd: Any) -> None:
    """The elastic callbacks in a tf-keras fit: epoch / batch counts and commits every 2
    batches and at every epoch end."""
    model = make_model(seed=0)
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.legacy.SGD(0.1)),
                  loss="mse")
    state = _CountingState(model, batch=0, epoch=0)
    x, y = data(hvd.rank())
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[hk.elastic.UpdateEpochStateCallback(state),
                         hk.elastic.UpdateBatchStateCallback(state),
                         hk.elastic.CommitStateCallback(state, batches_per_commit=2)])
    assert (state.epoch, state.batch) == (2, 0), (state.epoch, state.batch)
    assert state.commits == [(0, 2), (0, 4), (1, 0), (1, 2), (1, 4), (2, 0)], state.commits


def sync_batch_norm(hvd: Any) -> None:
    """``hvd.SyncBatchNormalization`` on tf-keras is a tf-keras layer (as Horovod's subclasses
    ``tf.keras.layers.BatchNormalization``): training statistics of both ranks' uneven batches
    eagerly, and in a TF1 graph whose session fetches its moving mean."""
    r = hvd.rank()
    rng = np.random.RandomState(60 + r)
    x = (rng.randn(3 + 2 * r, 4) * 3.0 + 10.0).astype(np.float32)
    everyone = np.concatenate(hvd.allgather_object(x)).astype(np.float64)
    mean, var = everyone.mean(axis=0), everyone.var(axis=0)
    layer = hvd.SyncBatchNormalization(epsilon=1e-3, momentum=0.5)
    assert isinstance(layer, keras.layers.BatchNormalization), type(layer).__mro__
    y = layer(tf.constant(x), training=True).numpy()
    np.testing.assert_allclose(y, (x - mean) / np.sqrt(var + 1e-3), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(layer.moving_mean.numpy(), 0.5 * mean, rtol=1e-5)
    v1 = tf.compat.v1
    with tf.Graph().as_default():
        graph_layer = hvd.SyncBatchNormalization(epsilon=1e-3, momentum=0.5)
        out = graph_layer(v1.constant(x), training=True)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            got = sess.run(out)
            updates = [u for u in graph_layer.updates]
            sess.run(updates)
            moving = sess.run(graph_layer.moving_mean)
    np.testing.assert_allclose(got, (x - mean) / np.sqrt(var + 1e-3), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(moving, 0.5 * mean, rtol=1e-5)
