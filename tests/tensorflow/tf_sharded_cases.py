"""Cases for the Keras ShardedOptimizer (hora-only), shared by group_tf_keras_sharded (Keras 3)
and group_tf_keras2_sharded (tf-keras, ``TF_USE_LEGACY_KERAS=1``): ``tf.keras`` is whichever
Keras the job runs. 2 ranks; process sets [0] and [1] registered at init (a one-rank set is
"another size" for the full-state round trip).

The reference is ``DistributedOptimizer`` wrapping the same optimizer, fit in the same job on the
same per-rank data. Tolerance: the issue's target, max weight difference <= 1e-5 after 20
steps (float32).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import hora.keras as hk

keras = tf.keras
TOL = 1e-5
STEPS, BATCH = 20, 8
SETS: dict[str, Any] = {}


def init(hvd: Any) -> None:
    SETS["solo0"], SETS["solo1"] = hvd.ProcessSet([0]), hvd.ProcessSet([1])
    hvd.init(process_sets=[SETS["solo0"], SETS["solo1"]])


def _data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(100 + rank)
    x = rng.randn(STEPS * BATCH, 6).astype("float32")
    return x, np.tanh(x @ rng.randn(6, 3).astype("float32"))


def _model() -> Any:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(12, activation="tanh"), keras.layers.Dense(3)])


def _weights(model: Any) -> np.ndarray:
    return np.concatenate([np.asarray(v.numpy()).ravel() for v in model.weights])


def _fit(hvd: Any, opt: Any, steps: int = STEPS) -> Any:
    model = _model()
    start = hvd.broadcast_object([np.asarray(v.numpy()) for v in model.weights], 0)
    for v, s in zip(model.weights, start):
        v.assign(s)
    model.compile(optimizer=opt, loss="mse")
    x, y = _data(hvd.rank())
    model.fit(x[:steps * BATCH], y[:steps * BATCH], batch_size=BATCH, epochs=1, shuffle=False,
              verbose=0)
    return model


def _opt_vars(opt: Any, model: Any) -> list[Any]:
    """The optimizer's slot variables (not its scalars; not the model's variables, which
    Keras 3's attribute tracker lists among DistributedOptimizer's variables)."""
    found = opt.variables() if callable(opt.variables) else opt.variables
    weights = {id(w) for w in model.weights}
    return [v for v in found if len(v.shape) > 0 and id(v) not in weights]


def fit_equivalence(hvd: Any) -> None:
    """Adam and SGD+momentum: 20 fit steps equal DistributedOptimizer's (<= 1e-5); weights
    agree on both ranks; the slots' bytes on a rank are <= 1/size + 10% of the unsharded."""
    for label, make in (("adam", lambda: keras.optimizers.Adam(0.01)),
                        ("sgd", lambda: keras.optimizers.SGD(0.05, momentum=0.9))):
        sharded = hk.ShardedOptimizer(make(), name=f"sh_{label}")
        assert type(sharded).__name__ == type(make()).__name__
        got = _fit(hvd, sharded)
        ref = hk.DistributedOptimizer(make(), name=f"ref_{label}")
        want = _fit(hvd, ref)
        diff = float(np.max(np.abs(_weights(got) - _weights(want))))
        assert diff <= TOL, (label, diff)
        everyone = hk.allgather_object(_weights(got))
        assert np.array_equal(everyone[0], everyone[1]), label
        print(f"[sharded-keras] {label} max diff {diff:.3g}", flush=True)


def state_bytes(hvd: Any) -> None:
    """Adam's slots on a rank <= (1/size + 10%) of the unsharded slots, on 12 equal layers."""
    counts: list[int] = []
    for opt in (hk.ShardedOptimizer(keras.optimizers.Adam(0.01), name="sh_bytes"),
                hk.DistributedOptimizer(keras.optimizers.Adam(0.01), name="ref_bytes")):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((32,))]
                                 + [keras.layers.Dense(32) for _ in range(12)])
        model.compile(optimizer=opt, loss="mse")
        x = np.ones((8, 32), "float32")
        model.fit(x, x, batch_size=8, epochs=1, verbose=0)
        counts.append(sum(int(np.prod(v.shape)) for v in _opt_vars(opt, model)))
    ratio = counts[0] / counts[1]
    print(f"[sharded-keras] slot bytes ratio {ratio:.4f}", flush=True)
    assert ratio <= 1 / hvd.size() + 0.1, ratio


def predivide_and_sum(hvd: Any) -> None:
    """op=Sum and gradient_predivide_factor equal DistributedOptimizer with the same."""
    for i, kw in enumerate(({"op": hk.Sum}, {"gradient_predivide_factor": 2.0})):
        got = _fit(hvd, hk.ShardedOptimizer(keras.optimizers.Adam(0.01), name=f"sh_o{i}", **kw),
                   steps=6)
        want = _fit(hvd, hk.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                                 name=f"ref_o{i}", **kw), steps=6)
        diff = float(np.max(np.abs(_weights(got) - _weights(want))))
        assert diff <= TOL, (kw, diff)


def passes(hvd: Any) -> None:
    """backward_passes_per_step=2 (sum, Horovod's default) and 3 (averaged): 6 fit passes equal
    DistributedOptimizer with the same settings (<= 1e-5), iterations included."""
    for i, kw in enumerate(({"backward_passes_per_step": 2},
                            {"backward_passes_per_step": 3,
                             "average_aggregated_gradients": True})):
        sharded = hk.ShardedOptimizer(keras.optimizers.Adam(0.01), name=f"sh_p{i}", **kw)
        got = _fit(hvd, sharded, steps=6)
        ref = hk.DistributedOptimizer(keras.optimizers.Adam(0.01), name=f"ref_p{i}", **kw)
        want = _fit(hvd, ref, steps=6)
        diff = float(np.max(np.abs(_weights(got) - _weights(want))))
        assert diff <= TOL, (kw, diff)
        assert int(sharded.iterations.numpy()) == int(ref.iterations.numpy()), kw
        moved = float(np.max(np.abs(_weights(got) - _weights(_start(hvd)))))
        assert moved > 1e-3, (kw, moved)
        everyone = hk.allgather_object(_weights(got))
        assert np.array_equal(everyone[0], everyone[1]), kw
        print(f"[sharded-keras] passes {kw} max diff {diff:.3g} iterations "
              f"{int(sharded.iterations.numpy())}", flush=True)


def _start(hvd: Any) -> Any:
    model = _model()
    start = hvd.broadcast_object([np.asarray(v.numpy()) for v in model.weights], 0)
    for v, s in zip(model.weights, start):
        v.assign(s)
    return model


def full_state(hvd: Any) -> None:
    """Keras 3: gather_state gives every variable's slots (equal to DistributedOptimizer's);
    scatter_state loads it at another size (a one-rank set: every slot) and at 2 ranks (this
    rank's shard), and a further step on the one-rank set equals plain Adam's."""
    opt = hk.ShardedOptimizer(keras.optimizers.Adam(0.01), name="sh_full")
    model = _fit(hvd, opt, steps=5)
    ref = hk.DistributedOptimizer(keras.optimizers.Adam(0.01), name="ref_full")
    ref_model = _fit(hvd, ref, steps=5)
    full = opt.gather_state()
    assert sorted(full["slots"]) == list(range(len(model.trainable_variables)))
    assert full["iterations"] == 5
    ref_slots = {v.name: np.asarray(v.numpy()) for v in _opt_vars(ref, ref_model)}
    for i, slots in full["slots"].items():
        prefix = ref_model.trainable_variables[i].path.replace("/", "_") + "_"
        for name, value in slots.items():
            want = ref_slots.get(prefix + name)
            assert want is not None and np.allclose(value, want, atol=TOL), (i, name)
    solo = SETS["solo0"] if hvd.rank() == 0 else SETS["solo1"]
    one = hk.ShardedOptimizer(keras.optimizers.Adam(0.01), process_set=solo, name="sh_solo")
    one.scatter_state(full, model.trainable_variables)
    assert sum(int(np.prod(v.shape)) for v in _opt_vars(one, model)) == \
        sum(int(np.prod(v.shape)) for v in _opt_vars(ref, ref_model))
    again = one.gather_state()
    for i, slots in full["slots"].items():
        for name, value in slots.items():
            assert np.array_equal(again["slots"][i][name], value), (i, name)
    twin = _model()
    for a, b in zip(twin.trainable_variables, model.trainable_variables):
        a.assign(b)
    plain = keras.optimizers.Adam(0.01)
    plain.build(twin.trainable_variables)
    for v in plain.variables:
        for i, var in enumerate(twin.trainable_variables):
            prefix = var.path.replace("/", "_") + "_"
            if v.name.startswith(prefix):
                v.assign(full["slots"][i][v.name[len(prefix):]])
    plain.iterations.assign(full["iterations"])
    grads = [tf.ones_like(v) for v in model.trainable_variables]
    one.apply_gradients(zip(grads, model.trainable_variables))
    plain.apply_gradients(zip(grads, twin.trainable_variables))
    diff = float(np.max(np.abs(_weights(model) - _weights(twin))))
    assert diff <= 1e-6, diff


def elastic_state(hvd: Any) -> None:
    """Keras 3: KerasState(model, ShardedOptimizer) commits the full state and restores,
    syncs and (after a change of plan) re-shards it; training on equals DistributedOptimizer
    under the same commit / restore / sync."""
    import hora.keras.elastic as hke

    got = _fit(hvd, hk.ShardedOptimizer(keras.optimizers.Adam(0.01), name="sh_el"), steps=3)
    want = _fit(hvd, hk.DistributedOptimizer(keras.optimizers.Adam(0.01), name="ref_el"),
                steps=3)
    states = [hke.KerasState(m, m.optimizer, epoch=0) for m in (got, want)]
    assert states[0]._sharded is not None and states[1]._sharded is None
    x, y = _data(hvd.rank())
    for st in states:
        st.commit()
    committed = got.optimizer.gather_state()
    for m in (got, want):
        m.fit(x[:3 * BATCH], y[:3 * BATCH], batch_size=BATCH, epochs=1, shuffle=False,
              verbose=0)
    for st in states:
        st.restore()
    again = got.optimizer.gather_state()
    assert again["iterations"] == committed["iterations"] == 3, again["iterations"]
    for st in states:
        st.sync()
    # a new plan (a one-rank set: this rank owns every variable), re-sharded from the commit
    solo = SETS["solo0"] if hvd.rank() == 0 else SETS["solo1"]
    got.optimizer._hora.process_set = solo
    states[0].on_reset()
    whole = got.optimizer.gather_state()
    assert sorted(whole["slots"]) == list(range(len(got.trainable_variables)))
    for i, slots in committed["slots"].items():
        for name, value in slots.items():
            assert np.array_equal(whole["slots"][i][name], value), (i, name)
    got.optimizer._hora.process_set = hvd.global_process_set
    states[0].on_reset()
    for m in (got, want):
        m.fit(x[3 * BATCH:7 * BATCH], y[3 * BATCH:7 * BATCH], batch_size=BATCH, epochs=1,
              shuffle=False, verbose=0)
    diff = float(np.max(np.abs(_weights(got) - _weights(want))))
    assert diff <= TOL, diff
    print(f"[sharded-keras] elastic max diff {diff:.3g}", flush=True)


def clipping(hvd: Any) -> None:
    """clipnorm (per variable, exact under sharding) that bites equals DistributedOptimizer with
    the same clipnorm (<= 1e-5); global_clipnorm is refused at construction by name."""
    def sgd(**kw: Any) -> Any:
        return keras.optimizers.SGD(0.5, momentum=0.9, **kw)

    got = _fit(hvd, hk.ShardedOptimizer(sgd(clipnorm=0.01), name="sh_clip"), steps=6)
    want = _fit(hvd, hk.DistributedOptimizer(sgd(clipnorm=0.01), name="ref_clip"), steps=6)
    free = _fit(hvd, hk.DistributedOptimizer(sgd(), name="ref_free"), steps=6)
    diff = float(np.max(np.abs(_weights(got) - _weights(want))))
    unclipped = float(np.max(np.abs(_weights(free) - _weights(want))))
    print(f"[sharded-keras] clipnorm max diff {diff:.3g}, unclipped {unclipped:.3g}", flush=True)
    assert diff <= TOL, diff
    assert unclipped > 1e-2, unclipped
    with pytest.raises(ValueError, match=r"global_clipnorm=0\.5.*clipnorm="):
        hk.ShardedOptimizer(sgd(global_clipnorm=0.5))


def keras3_cases() -> list[tuple[str, Any]]:
    return [("sharded-fit", fit_equivalence), ("sharded-state-bytes", state_bytes),
            ("sharded-sum-predivide", predivide_and_sum), ("sharded-passes", passes),
            ("sharded-full-state", full_state), ("sharded-elastic", elastic_state),
            ("sharded-clip", clipping)]


def keras2_cases() -> list[tuple[str, Any]]:
    return [("sharded-fit", fit_equivalence), ("sharded-state-bytes", state_bytes),
            ("sharded-sum-predivide", predivide_and_sum), ("sharded-passes", passes),
            ("sharded-clip", clipping)]
