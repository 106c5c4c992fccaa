"""Case group: the TensorFlow / Keras elastic API on one rank (``hora run -np 1``): what a commit
keeps and a restore brings back (model weights, optimizer slots and iterations after real
optimizer steps; no aliasing), ``sync``, the conversion of collective failures inside a graph,
the ``run`` loop, and the Keras callbacks inside ``model.fit``."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

import hora.keras
import hora.tensorflow.keras
from hora import errors
from hora.elastic import ObjectState
from hora.tensorflow import elastic as tfe
from hora.tensorflow.keras import elastic as ke

STEPS, BATCH = 4, 8
CASE_IDS = ["reachable", "keras-state-commit-restore", "keras-state-lazy-slots",
            "keras-state-sync", "keras-state-errors", "tensorflow-state", "error-conversion",
            "run-loop", "callbacks-in-fit", "callbacks-resume", "callback-errors"]


def init(hvd: Any) -> None:
    hvd.init()


def _data(seed: int = 0, steps: int = STEPS) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    x = rng.randn(steps * BATCH, 5).astype("float32")
    return x, (x @ np.arange(1.0, 6.0, dtype="float32")[:, None]).astype("float32")


def _model(compile_with: Any = None) -> keras.Model:
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    if compile_with is not None:
        model.compile(optimizer=compile_with, loss="mse")
    return model


def _values(model: keras.Model) -> list[np.ndarray]:
    """Model weights, then the optimizer's variables (iterations, learning rate, slots)."""
    return ([np.array(v.numpy()) for v in model.weights]
            + [np.array(v.numpy()) for v in model.optimizer.variables])


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def _fit(model: keras.Model, epochs: int = 1, seed: int = 0, **kwargs: Any) -> None:
    x, y = _data(seed)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, **kwargs)


def _reachable(hvd: Any) -> None:
    import hora.keras.elastic as keras_elastic  # the module file of Horovod's other path

    assert hvd.elastic is tfe
    assert hora.tensorflow.keras.elastic is ke
    assert hora.keras.elastic.KerasState is ke.KerasState
    for mod in (tfe, ke, keras_elastic):
        assert mod.run is tfe.run and mod.ObjectState is ObjectState
        assert mod.TensorFlowKerasState is tfe.TensorFlowKerasState
    for mod in (ke, keras_elastic):
        for name in ("KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
                     "UpdateEpochStateCallback"):
            assert getattr(mod, name) is getattr(ke, name), name
    assert issubclass(ke.KerasState, tfe.TensorFlowKerasState)
    assert hasattr(tfe, "TensorFlowState")
    # Horovod's Keras modules re-export the build/capability checks and the timeline
    for name in ("mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
                 "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
                 "rocm_built", "start_timeline", "stop_timeline"):
        for mod in (hora.keras, hora.tensorflow.keras):
            assert getattr(mod, name) is getattr(hvd, name) and name in mod.__all__, name
    assert hora.keras.gloo_enabled() is hvd.gloo_enabled()


def _commit_restore(hvd: Any) -> None:
    model = _model(hora.keras.DistributedOptimizer(keras.optimizers.Adam(0.05)))
    state = ke.KerasState(model, epoch=0, batch=0, notes=["a"])
    _fit(model, seed=1)  # real optimizer steps: moments and iterations move
    state.epoch, state.notes = 1, ["a", "b"]
    state.commit()
    committed = _values(model)
    assert int(model.optimizer.iterations.numpy()) == STEPS
    slots = [v for v in model.optimizer.variables if "momentum" in v.path or "velocity" in v.path]
    assert slots and all(np.any(v.numpy() != 0) for v in slots), "Adam slots did not move"

    _fit(model, seed=2)  # uncommitted steps
    state.epoch, state.batch = 5, 3
    state.notes.append("c")
    moved = _values(model)
    assert not _same(moved, committed)
    state.restore()
    assert _same(_values(model), committed), "restore did not bring back weights and slots"
    assert (state.epoch, state.batch, state.notes) == (1, 0, ["a", "b"])

    # no aliasing: training after a restore leaves the snapshot alone, so a second failure
    # rolls back to the same commit
    _fit(model, seed=3)
    state.notes.append("d")
    state.restore()
    assert _same(_values(model), committed), "the snapshot changed after restore + training"
    assert state.notes == ["a", "b"]

    # a later commit is the new restore point
    _fit(model, seed=4)
    state.commit()
    second = _values(model)
    _fit(model, seed=5)
    state.restore()
    assert _same(_values(model), second)


def _lazy_slots(hvd: Any) -> None:
    # Keras 3 creates an optimizer's slots on its first update; the state builds them at once,
    # so a failure before the first commit rolls the slots back too
    model = _model(keras.optimizers.Adam(0.05))
    assert not model.optimizer.built
    state = ke.KerasState(model)
    assert model.optimizer.built and len(model.optimizer.variables) > 2
    initial = _values(model)
    assert all(not np.any(v) for v in initial[len(model.weights) + 2:]), "slots start at zero"
    _fit(model, seed=1)
    assert not _same(_values(model), initial)
    state.restore()
    assert _same(_values(model), initial)
    # a separate optimizer, not the compiled one
    other = keras.optimizers.SGD(0.1, momentum=0.9)
    plain = _model()
    state2 = tfe.TensorFlowKerasState(plain, other, step=0)
    assert state2.optimizer is other and other.built
    assert any("momentum" in v.path for v in other.variables)


def _sync(hvd: Any) -> None:
    # one rank: sync broadcasts the live values (rank 0's own) and makes them the restore point
    model = _model(keras.optimizers.SGD(0.1))
    state = ke.KerasState(model, epoch=0)
    _fit(model, seed=1)
    state.epoch = 4  # plain data: sync broadcasts the committed value (0)
    live = _values(model)
    state.sync()
    assert _same(_values(model), live) and state.epoch == 0
    _fit(model, seed=2)
    state.restore()
    assert _same(_values(model), live)


def _state_errors(hvd: Any) -> None:
    unbuilt = keras.Sequential([keras.layers.Dense(1)])
    try:
        ke.KerasState(unbuilt)
    except ValueError as exc:
        assert "model.build" in str(exc)
    else:
        raise AssertionError("an unbuilt model was accepted")

    @tf.function
    def inside() -> None:
        tfe.TensorFlowState([tf.Variable(1.0)])

    try:
        inside()
    except RuntimeError as exc:
        assert "eager" in str(exc)
    else:
        raise AssertionError("a state was created inside tf.function")


def _tensorflow_state(hvd: Any) -> None:
    w, b = tf.Variable(tf.ones([3, 2])), tf.Variable(tf.zeros([2]))
    opt = keras.optimizers.Adam(0.1)
    opt.build([w, b])

    @tf.function
    def step(seed: tf.Tensor) -> None:
        x = tf.random.stateless_normal([4, 3], seed=tf.stack([seed, 0]))
        with tf.GradientTape() as tape:
            tape = hvd.DistributedGradientTape(tape)
            loss = tf.reduce_sum((x @ w + b) ** 2)
        grads = tape.gradient(loss, [w, b])
        opt.apply_gradients(zip(grads, [w, b]))

    variables = [w, b, *opt.variables]
    state = tfe.TensorFlowState(variables, step=0)
    assert all(a is b for a, b in zip(state.variables, variables)) and state.session is None
    step(tf.constant(1))
    state.step = 1
    state.commit()
    committed = [v.numpy().copy() for v in variables]
    step(tf.constant(2))
    step(tf.constant(3))
    state.step = 3
    state.restore()
    assert all(np.array_equal(v.numpy(), c) for v, c in zip(variables, committed))
    assert state.step == 1
    step(tf.constant(4))
    state.restore()
    assert all(np.array_equal(v.numpy(), c) for v, c in zip(variables, committed))
    single = tfe.TensorFlowState(w)
    assert len(single.variables) == 1 and single.variables[0] is w

    bad: list[tuple[dict[str, Any], type[Exception], str]] = [
            ({"variables": [w], "session": object()}, TypeError, "tf.compat.v1.Session"),
            ({}, ValueError, "variables=[...]"),
            ({"variables": [w, np.zeros(3)]}, TypeError, "ndarray")]
    for kwargs, exc_type, text in bad:
        try:
            tfe.TensorFlowState(**kwargs)
        except exc_type as exc:
            assert text in str(exc), exc
        else:
            raise AssertionError(f"TensorFlowState({kwargs}) was accepted")


def _graph_failure(exc: BaseException) -> Any:
    """A tf.function whose collective-like op raises ``exc`` in Python (how a hora collective
    fails inside a graph: the numpy_function of hora.tensorflow.bridge.host_call)."""
    def fail(x: np.ndarray) -> np.ndarray:
        raise exc

    @tf.function
    def fn() -> tf.Tensor:
        return tf.numpy_function(fail, [tf.constant(1.0)], tf.float32, stateful=True,
                                 name="HoraAllreduce")
    return fn


def _error_conversion(hvd: Any) -> None:
    cases = [errors.PeerLostError("rank 1 on localhost closed its connection", peer=1),
             errors.HoraTimeoutError("the allreduce of grad waited 30 s"),
             errors.MismatchError("tensor grad: shape [2] on rank 0, [3] on rank 1"),
             errors.DeadlockError("every rank waits:\n  rank 0: allreduce a\n  rank 1: b"),
             errors.ShutdownError()]
    for original in cases:
        fn = _graph_failure(original)
        try:
            fn()
        except tf.errors.UnknownError as exc:
            converted = tfe._internal_error(exc)
        else:
            raise AssertionError("the graph op did not fail")
        assert isinstance(converted, errors.HorovodInternalError)
        assert type(converted) is type(original), (type(converted), type(original))
        if str(original):
            assert str(converted) == str(original), (str(converted), str(original))

        def train(state: Any, fn: Any = fn) -> None:
            fn()

        try:
            tfe._converting(train)(None)
        except errors.HorovodInternalError as exc:
            assert isinstance(exc.__cause__, tf.errors.UnknownError)
        else:
            raise AssertionError("no error")

    # other errors pass unchanged: a plain RuntimeError in a py_func, a TF error of its own,
    # a hora error that is no collective failure, a Python error
    others: list[Any] = [_graph_failure(RuntimeError("MismatchError: only mentioned")),
                         _graph_failure(errors.NotInitializedError("allreduce")),
                         lambda: tf.reshape(tf.zeros([3]), [2]),
                         lambda: [][1]]
    for fn in others:
        try:
            tfe._converting(lambda state, fn=fn: fn())(None)
        except errors.HorovodInternalError as exc:
            raise AssertionError(f"converted an unrelated error: {exc!r}") from exc
        except (tf.errors.OpError, IndexError):
            pass
        else:
            raise AssertionError("no error")


def _run_loop(hvd: Any) -> None:
    # a collective fails inside a graph after uncommitted steps: run converts the error, the
    # loop restores the commit, rebuilds the world (shutdown + init: one rank here), calls the
    # reset callbacks and the function again, which then finishes
    model = _model(hora.keras.DistributedOptimizer(keras.optimizers.Adam(0.05)))
    state = ke.KerasState(model, epoch=0)
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    _fit(model)
    assert model.train_function is not None
    state.commit()
    committed = _values(model)
    fail = _graph_failure(errors.PeerLostError("rank 1 on localhost closed its connection"))
    seen: list[list[np.ndarray]] = []

    @hvd.elastic.run
    def train(state: Any, tag: str) -> str:
        seen.append(_values(model))
        if len(seen) == 1:
            _fit(model, seed=9)  # uncommitted
            state.epoch = 3
            fail()
        return f"{tag} after {len(seen)} calls, epoch {state.epoch}"

    assert train(state, "done") == "done after 2 calls, epoch 0"
    assert resets == [1]
    assert _same(seen[0], committed) and _same(seen[1], committed)
    assert model.train_function is None, "reset() kept the step traced for the old world"
    assert hvd.is_initialized() and hvd.size() == 1
    try:
        hvd.elastic.run(lambda s: None)(object())
    except TypeError as exc:
        assert "elastic State" in str(exc)
    else:
        raise AssertionError("run accepted a non-state")


class _Recorder(keras.callbacks.Callback):
    """After the elastic callbacks: ``state.batch`` after every batch."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.batches: list[int] = []

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches.append(self.state.batch)


class _CountingState(ke.KerasState):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commits: list[tuple[int, int, int]] = []

    def commit(self) -> None:
        super().commit()
        self.commits.append((self.epoch, self.batch,
                             int(self.model.optimizer.iterations.numpy())))


def _callbacks(hvd: Any) -> None:
    model = _model(hora.keras.DistributedOptimizer(keras.optimizers.SGD(0.05)))
    state = _CountingState(model, epoch=0, batch=0)
    recorder = _Recorder(state)
    callbacks = [ke.UpdateEpochStateCallback(state), ke.UpdateBatchStateCallback(state),
                 recorder, ke.CommitStateCallback(state, batches_per_commit=3)]
    _fit(model, epochs=2, callbacks=callbacks)
    assert recorder.batches == [1, 2, 3, 4] * 2, recorder.batches
    # every 3 batches (the count restarts after the epoch-end commit) and at every epoch end,
    # with epoch / batch already updated
    assert state.commits == [(0, 3, 3), (1, 0, 4), (1, 3, 7), (2, 0, 8)], state.commits
    assert (state.epoch, state.batch) == (2, 0)
    # Horovod's way of resuming: fit(epochs=total - state.epoch)
    _fit(model, epochs=1, callbacks=callbacks)
    assert state.epoch == 3
    # the other way: fit(initial_epoch=state.epoch, epochs=total)
    _fit(model, epochs=5, initial_epoch=3, callbacks=callbacks)
    assert state.epoch == 5
    every = ke.CommitStateCallback(state)
    state.commits.clear()
    _fit(model, epochs=1, callbacks=[every])
    assert len(state.commits) == STEPS + 1


def _callbacks_resume(hvd: Any) -> None:
    # a resumed epoch: state.batch = 2 of 4 batches done; fit gets the remaining 2 batches and
    # the count goes on from 2
    model = _model(keras.optimizers.SGD(0.05))
    state = _CountingState(model, epoch=1, batch=2)
    recorder = _Recorder(state)
    callbacks = [ke.UpdateEpochStateCallback(state), ke.UpdateBatchStateCallback(state),
                 recorder, ke.CommitStateCallback(state, batches_per_commit=2)]
    x, y = _data()
    done = state.batch * BATCH
    model.fit(x[done:], y[done:], batch_size=BATCH, initial_epoch=state.epoch,
              epochs=state.epoch + 1, shuffle=False, verbose=0, callbacks=callbacks)
    assert recorder.batches == [3, 4], recorder.batches
    assert state.commits == [(1, 4, 2), (2, 0, 2)], state.commits
    model.fit(x, y, batch_size=BATCH, initial_epoch=state.epoch, epochs=state.epoch + 1,
              shuffle=False, verbose=0, callbacks=callbacks)
    assert recorder.batches[2:] == [1, 2, 3, 4] and state.epoch == 3


def _callback_errors(hvd: Any) -> None:
    model = _model(keras.optimizers.SGD(0.05))
    state = ke.KerasState(model)
    for make, text in [(lambda: ke.CommitStateCallback(state, batches_per_commit=0),
                        "batches_per_commit"),
                       (lambda: ke.UpdateBatchStateCallback(state), "batch=0"),
                       (lambda: ke.UpdateEpochStateCallback(state), "epoch=0")]:
        try:
            make()
        except ValueError as exc:
            assert text in str(exc), exc
        else:
            raise AssertionError(f"accepted: {text}")


def cases() -> list[tuple[str, Any]]:
    out = [("reachable", _reachable), ("keras-state-commit-restore", _commit_restore),
           ("keras-state-lazy-slots", _lazy_slots), ("keras-state-sync", _sync),
           ("keras-state-errors", _state_errors), ("tensorflow-state", _tensorflow_state),
           ("error-conversion", _error_conversion), ("run-loop", _run_loop),
           ("callbacks-in-fit", _callbacks), ("callbacks-resume", _callbacks_resume),
           ("callback-errors", _callback_errors)]
    assert [c for c, _ in out] == CASE_IDS
    return out
