"""Cases of group_tf_api (2 ranks): the tape's ``get_local_and_global_gradients`` and
``hvd.elastic.TensorFlowState`` with a TF1 session, checked against numpy references built from
every rank's local values (exchanged with ``allgather_object``)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

v1 = tf.compat.v1


def _dense(g: Any) -> np.ndarray:
    return np.asarray(tf.convert_to_tensor(g).numpy(), np.float64)


# ---- get_local_and_global_gradients ------------------------------------------------------------
def tape_local_global(hvd: Any) -> None:
    """Both tapes, eagerly and in ``tf.function``: the local sources (a Keras layer given as
    ``local_layers`` or registered, and a registered variable) come back with this rank's own
    gradient (divided by the set size unless ``scale_local_gradients=False``), every other
    source with the average over the ranks, each list in the order of ``sources``."""
    r, n = hvd.rank(), hvd.size()
    x = np.random.RandomState(30 + r).randn(4, 3).astype("float32")
    shared, head = keras.layers.Dense(2), keras.layers.Dense(1)
    shared.build((None, 3))
    head.build((None, 2))
    emb = tf.Variable(np.ones((3, 2), "float32"))  # an IndexedSlices gradient, shared
    extra, unused = tf.Variable([1.0]), tf.Variable([0.0])
    lemb = tf.Variable(np.ones((3, 2), "float32"))  # an IndexedSlices gradient, local
    hvd.broadcast_variables(shared.weights + head.weights, root_rank=0)
    sources = [shared.kernel, extra, emb, lemb, head.kernel, shared.bias, head.bias, unused]
    local_ids = {id(head.kernel), id(head.bias), id(extra), id(lemb)}
    pos = {id(s): i for i, s in enumerate(sources)}

    def loss() -> tf.Tensor:
        h = shared(x) + tf.reduce_sum(tf.gather(emb, [r % 3, 2]))
        return (tf.reduce_sum(head(h) ** 2) + extra[0] * float(r + 1)
                + tf.reduce_sum(tf.gather(lemb, [r % 3])) * float(r + 2))

    with tf.GradientTape() as plain:
        value = loss()
    own = [None if g is None else _dense(g) for g in plain.gradient(value, sources)]
    everyone = hvd.allgather_object(own)
    assert not np.allclose(everyone[0][4], everyone[1][4]), "local gradients should differ"
    want = [g if g is None or id(s) in local_ids else np.mean([e[i] for e in everyone], axis=0)
            for i, (s, g) in enumerate(zip(sources, own))]  # local: this rank's; else the mean

    def split(partial: bool, scale: bool) -> Any:
        with tf.GradientTape() as tape:
            value = loss()
        if partial:
            tape = hvd.PartialDistributedGradientTape(tape, local_layers=head,
                                                      scale_local_gradients=scale)
        else:
            tape = hvd.DistributedGradientTape(tape, scale_local_gradients=scale)
            for v in head.trainable_weights:
                tape.register_local_source(v)
        tape.register_local_source(extra)
        tape.register_local_source(lemb)
        return tape.get_local_and_global_gradients(value, sources)

    traced = tf.function(lambda: [[g for _, g in part] for part in split(True, True)])
    for partial, scale in ((True, True), (False, False), (False, True)):
        local, shared_pairs = split(partial, scale)
        assert _same([s for s, _ in local], [extra, lemb, head.kernel, head.bias])  # in order
        assert _same([s for s, _ in shared_pairs], [shared.kernel, emb, shared.bias, unused])
        assert isinstance(shared_pairs[1][1], tf.IndexedSlices) and shared_pairs[3][1] is None
        assert isinstance(local[1][1], tf.IndexedSlices)
        runs = [[[g for _, g in local], [g for _, g in shared_pairs]]]
        if partial:
            runs.append(traced())
        for local_grads, shared_grads in runs:
            for s, g in zip([extra, lemb, head.kernel, head.bias], local_grads):
                ref = want[pos[id(s)]] / (n if scale else 1)
                np.testing.assert_allclose(_dense(g), ref, rtol=1e-5, atol=1e-6)
            for s, g in zip([shared.kernel, emb, shared.bias], shared_grads):
                np.testing.assert_allclose(_dense(g), want[pos[id(s)]], rtol=1e-5,
                                           atol=1e-6)


# ---- TensorFlowState with a TF1 session ----------------------------------------------------------
def elastic_session(hvd: Any) -> None:
    """``TensorFlowState(session=sess)`` in a ``tf.compat.v1`` graph: ``sync`` gives every rank
    rank 0's variables and attributes, ``restore`` undoes uncommitted steps, ``commit`` moves
    the restore point, none of them adds ops to the graph; the default session, the global
    variables default, ``hvd.elastic.run`` with the state, and the errors."""
    r, n = hvd.rank(), hvd.size()
    start = np.random.RandomState(40 + r).randn(2, 3).astype("float32")
    with tf.Graph().as_default() as graph:
        w = v1.get_variable("w", initializer=tf.constant(start))
        count = v1.get_variable("count", initializer=tf.constant([10 * r], tf.int64))
        step = tf.group(w.assign_add(tf.ones_like(w) * float(r + 1)), count.assign_add([1]))
        sess = v1.Session(graph=graph)  # not the default session
        try:
            sess.run(v1.global_variables_initializer())
            state = hvd.elastic.TensorFlowState(session=sess, epoch=r, batch=3 * r)
            assert state.session is sess and _same(state.variables, [w, count])
            ops = len(graph.get_operations())
            root = hvd.broadcast_object(start, 0)
            state.sync()  # rank 0's live variables and committed attributes
            assert np.array_equal(sess.run(w), root) and sess.run(count).tolist() == [0]
            assert (state.epoch, state.batch) == (0, 0)
            sess.run(step)
            state.epoch = 5
            state.restore()  # nothing committed since the sync
            assert np.array_equal(sess.run(w), root) and sess.run(count).tolist() == [0]
            assert state.epoch == 0
            sess.run(step)
            state.epoch = 1
            state.commit()
            committed = sess.run(w)
            np.testing.assert_allclose(committed, root + (r + 1), rtol=1e-6)
            sess.run(step)
            sess.run(step)
            state.restore()
            assert np.array_equal(sess.run(w), committed) and sess.run(count).tolist() == [1]
            assert state.epoch == 1
            # the ranks' committed values differ (each stepped by r + 1): sync gives rank 0's
            everyone = hvd.allgather_object(committed)
            assert not np.array_equal(everyone[0], everyone[-1])
            state.sync()
            assert np.array_equal(sess.run(w), everyone[0])
            assert len(graph.get_operations()) == ops, "the state grew the graph"

            @hvd.elastic.run
            def train(state: Any, steps: int) -> Any:
                for _ in range(steps):
                    sess.run(step)
                    state.batch += 1
                    state.commit()
                return sess.run(w)

            got = train(state, 2)
            np.testing.assert_allclose(got, everyone[0] + 2 * (r + 1), rtol=1e-6)
            assert state.batch == 2
            _errors(hvd, sess, w)  # before any default session exists
            with sess.as_default():  # the default session; one variable
                single = hvd.elastic.TensorFlowState(w)
            assert single.session is sess and _same(single.variables, [w])
            single.sync()
            assert hvd.allgather_object(sess.run(w).tolist()) == [sess.run(w).tolist()] * n
        finally:
            sess.close()


def _same(got: list[Any], want: list[Any]) -> bool:
    return len(got) == len(want) and all(a is b for a, b in zip(got, want))


def _errors(hvd: Any, sess: Any, w: Any) -> None:
    state_cls = hvd.elastic.TensorFlowState
    other_graph = tf.Graph()
    with other_graph.as_default():
        other = v1.get_variable("other", initializer=tf.constant([1.0]))
    empty = v1.Session(graph=tf.Graph())
    cases: list[tuple[Any, type[Exception], str]] = [
        (lambda: state_cls([w]), ValueError, "needs a session"),
        (lambda: state_cls([w], session=object()), TypeError, "tf.compat.v1.Session"),
        (lambda: state_cls([w, np.zeros(2)], session=sess), TypeError, "ndarray"),
        (lambda: state_cls([other], session=sess), ValueError, "not in the session's graph"),
        (lambda: state_cls(session=empty), ValueError, "no variables")]
    try:
        for make, exc_type, text in cases:
            try:
                make()
            except exc_type as exc:
                assert text in str(exc), exc
            else:
                raise AssertionError(f"no {exc_type.__name__} ({text})")
    finally:
        empty.close()
