"""Case group: Keras 3 ``model.fit`` with ``hora.keras`` on 2 ranks: identical weights on every
rank after every epoch and equal to one process training on the union of the ranks' batches,
``backward_passes_per_step``, ``PartialDistributedOptimizer``, the callbacks, ``load_model``."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import keras
import numpy as np
from tf_fit_checks import epoch_check, interleaved, weights

import hora.keras as hk

STEPS, BATCH = 4, 8
CASE_IDS = ["fit-identical-and-exact", "fit-backward-passes", "fit-partial", "callbacks",
            "load-model", "errors"]


def init(hvd: Any) -> None:
    hvd.init()


def _data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(100 + rank)
    x = rng.randn(STEPS * BATCH, 5).astype("float32")
    return x, (x @ np.arange(1.0, 6.0, dtype="float32")[:, None] > 0).astype("float32")


def _model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(1)])


def _fit_case(backward_passes: int) -> Any:
    def case(hvd: Any) -> None:
        r, n = hvd.rank(), hvd.size()
        model = _model(seed=r)  # different on each rank: the broadcast below unifies them
        hvd.broadcast_variables(model.variables, root_rank=0)
        start = [np.asarray(v.numpy()) for v in model.weights]
        opt = hk.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                      backward_passes_per_step=backward_passes)
        assert type(opt).__name__ == "SGD" and isinstance(opt, keras.optimizers.SGD)
        model.compile(optimizer=opt, loss="mse")
        x, y = _data(r)
        check = epoch_check(keras.callbacks.Callback, hk.allgather_object)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[check])
        assert check.epochs == 2
        # the optimizer's variables are its own (its checkpoints load into a plain optimizer)
        own = {v.path for v in opt.variables} & {w.path for w in model.weights}
        assert not own, f"model weights among the optimizer's variables: {sorted(own)}"
        # one process, plain SGD, on the union of the batches; Horovod's default for
        # accumulated gradients is their sum (average_aggregated_gradients=False): lr * passes
        ref = _model(seed=0)
        for v, s in zip(ref.weights, start):
            v.assign(s)
        ref.compile(optimizer=keras.optimizers.SGD(0.1 * backward_passes), loss="mse")
        rx, ry = interleaved(_data, n, STEPS, BATCH, backward_passes)
        ref.fit(rx, ry, batch_size=BATCH * n * backward_passes, epochs=2, shuffle=False,
                verbose=0)
        assert np.allclose(weights(model), weights(ref), atol=1e-5), \
            f"distributed {weights(model)[:4]} != one process {weights(ref)[:4]}"
    return case


def _partial(hvd: Any) -> None:
    r = hvd.rank()
    model = _model(seed=0)
    opt = hk.PartialDistributedOptimizer(keras.optimizers.SGD(0.1),
                                         local_layers=[model.layers[0]])
    model.compile(optimizer=opt, loss="mse")
    x, y = _data(r)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    first = hk.allgather_object(weights(keras.Sequential([model.layers[0]])))
    last = hk.allgather_object(np.asarray(model.layers[1].kernel.numpy()))
    assert not np.array_equal(first[0], first[1]), "local layer was averaged"
    assert np.array_equal(last[0], last[1]), "global layer differs"


class _Seen(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.lrs: list[float] = []
        self.logs: list[dict[str, float]] = []

    def on_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.lrs.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.logs.append(dict(logs or {}))


def _callbacks(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    model = _model(seed=r)
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  metrics=["mae"])
    x, y = _data(r)
    local, averaged = _Seen(), _Seen()
    warm = hk.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1, verbose=0)
    sched = hk.callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=1)
    with tempfile.TemporaryDirectory() as tmp:
        best = hk.callbacks.BestModelCheckpoint(monitor="loss")
        best.filepath = os.path.join(tmp, "best.keras")
        callbacks = [hk.callbacks.BroadcastGlobalVariablesCallback(0), warm, sched, local,
                     hk.callbacks.MetricAverageCallback(), averaged]
        if r == 0:
            callbacks.append(best)
        model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                  callbacks=callbacks)
        assert r != 0 or os.path.exists(best.filepath)
    everyone = hk.allgather_object(local.logs)
    for epoch, logs in enumerate(averaged.logs):
        for key in ("loss", "mae"):
            want = np.mean([everyone[q][epoch][key] for q in range(n)])
            assert abs(logs[key] - want) < 1e-6, (epoch, key, logs[key], want)
    # warmup: lr/size -> lr over epoch 0, per batch; then 0.1 * 0.5 ** (epoch - 1)
    expected0 = [0.1 / n * ((b + 1) / STEPS * (n - 1) + 1) for b in range(STEPS)]
    assert np.allclose(local.lrs[:STEPS], expected0, rtol=1e-5), local.lrs[:STEPS]
    assert np.allclose(local.lrs[STEPS:], [0.1] * STEPS + [0.05] * STEPS, rtol=1e-5), \
        local.lrs[STEPS:]
    assert abs(averaged.logs[-1]["lr"] - 0.05) < 1e-6


def _load_model(hvd: Any) -> None:
    model = _model(seed=0)
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    x, y = _data(hvd.rank())
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.keras")
        model.save(path)
        plain = keras.models.load_model(path)  # saved models load without hora
        assert type(plain.optimizer).__name__ == "Adam"
        assert not hasattr(plain.optimizer, "_hora_reducer")
        loaded = hk.load_model(path)
        assert type(loaded.optimizer).__name__ == "Adam"
        assert hasattr(loaded.optimizer, "_hora_reducer"), "load_model did not wrap"
        loaded.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        everyone = hk.allgather_object(weights(loaded))
        assert np.array_equal(everyone[0], everyone[1])


def _errors(hvd: Any) -> None:
    for bad in ({"op": hk.Max}, {"backward_passes_per_step": 0}):
        try:
            hk.DistributedOptimizer(keras.optimizers.SGD(0.1), **bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"DistributedOptimizer accepted {bad}")
    try:
        hk.broadcast_global_variables(0)
    except RuntimeError as exc:
        assert "broadcast_variables" in str(exc)
    else:
        raise AssertionError("broadcast_global_variables must raise in TensorFlow 2")


def cases() -> list[tuple[str, Any]]:
    out = [("fit-identical-and-exact", _fit_case(1)), ("fit-backward-passes", _fit_case(2)),
           ("fit-partial", _partial), ("callbacks", _callbacks), ("load-model", _load_model),
           ("errors", _errors)]
    assert [c for c, _ in out] == CASE_IDS
    return out
