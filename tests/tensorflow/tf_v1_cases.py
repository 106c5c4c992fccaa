"""TensorFlow cases for Horovod's rules that hora once broke: TF1 graphs pair collectives by
name whatever order a rank's executor runs them in (and never starve the session's threads),
``broadcast_`` returns values read after the broadcast, Horovod's ``tf.errors`` types for
mismatches and bad arguments, sparse (IndexedSlices) rules, and ``hvd._executing_eagerly``.
Every value is checked against a numpy reference built from every rank's inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1
Case = Callable[[Any], None]
V1_IDS = ["v1-unordered", "v1-unordered-kinds", "v1-grouped-grad", "v1-names",
          "v1-broadcast-inplace", "error-types", "sparse-rules", "util"]


def _raises(exc_types: Any, fn: Callable[[], Any], fragment: str = "") -> BaseException:
    try:
        fn()
    except exc_types as exc:
        assert fragment in str(exc), f"{fragment!r} not in {exc}"
        return exc
    raise AssertionError(f"no {exc_types} ({fragment})")


def _unordered(hvd: Any) -> None:
    """24 independent unnamed allreduces in one Session.run, run 4 times in one session: each
    rank's executor runs them in its own order on 2 inter-op threads (the job's setting is 1:
    this case asks for more, as a default session would have)."""
    r, n, count = hvd.rank(), hvd.size(), 24
    config = v1.ConfigProto(inter_op_parallelism_threads=2)
    with tf.Graph().as_default():
        feed = v1.placeholder(tf.float32, [3])
        xs = [feed * float(i + 1) for i in range(count)]
        outs = [hvd.allreduce(x, op=hvd.Sum) for x in xs]
        with v1.Session(config=config) as sess:
            for step in range(4):
                got = sess.run(outs, {feed: np.full(3, 10.0 ** r + step, np.float32)})
                base = sum(10.0 ** q + step for q in range(n))
                for i, g in enumerate(got):
                    assert np.allclose(g, np.full(3, base * (i + 1))), (step, i, g)


def _unordered_kinds(hvd: Any) -> None:
    """Independent allgather / broadcast / alltoall / reducescatter / allreduce ops of the same
    shapes in one run: each pairs with its own op on the other ranks."""
    r, n = hvd.rank(), hvd.size()
    config = v1.ConfigProto(inter_op_parallelism_threads=2)
    with tf.Graph().as_default():
        xs = [tf.constant(np.full((2 * n, 2), 100.0 * i + r, np.float32)) for i in range(4)]
        outs = ([hvd.allgather(x) for x in xs] + [hvd.broadcast(x, n - 1) for x in xs]
                + [hvd.alltoall(x) for x in xs] + [hvd.reducescatter(x, op=hvd.Sum) for x in xs])
        with v1.Session(config=config) as sess:
            got = sess.run(outs)
    for i in range(4):
        gathered, bcast, a2a, rs = got[i], got[4 + i], got[8 + i], got[12 + i]
        want = np.concatenate([np.full((2 * n, 2), 100.0 * i + q) for q in range(n)])
        assert np.array_equal(gathered, want), (i, gathered)
        assert np.array_equal(bcast, np.full((2 * n, 2), 100.0 * i + n - 1)), (i, bcast)
        assert np.array_equal(a2a, np.concatenate([np.full((2, 2), 100.0 * i + q)
                                                   for q in range(n)])), (i, a2a)
        assert np.array_equal(rs, np.full((2, 2), sum(100.0 * i + q for q in range(n)))), rs


def _grouped_grad(hvd: Any) -> None:
    """Gradients of grouped allreduces built in a TF1 graph, evaluated together: rows of
    different ops never mix (the gradient ops are named from their tensors too)."""
    r, n = hvd.rank(), hvd.size()
    config = v1.ConfigProto(inter_op_parallelism_threads=2)
    with tf.Graph().as_default():
        groups = [[tf.constant(np.full((3, 2), float(k + j + 1), np.float32)) for j in range(3)]
                  for k in range(4)]
        grads = []
        for k, xs in enumerate(groups):
            ys = hvd.grouped_allreduce(xs, op=hvd.Sum)
            loss = sum(tf.reduce_sum(y * float((k + 1) * (r + 1) * (j + 1)))
                       for j, y in enumerate(ys))
            grads.append(v1.gradients(loss, xs))
        with v1.Session(config=config) as sess:
            got = sess.run(grads)
    for k, gs in enumerate(got):
        for j, g in enumerate(gs):  # d/dx of sum_q (k+1)(q+1)(j+1) * allreduce(x)
            want = sum((k + 1) * (q + 1) * (j + 1) for q in range(n))
            assert np.allclose(g, np.full((3, 2), want)), (k, j, g)


def _names(hvd: Any) -> None:
    """Two ops given the same name in one graph are different ops (node names are made unique,
    as Horovod's are); a name scope and ignore_name_scope keep working."""
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default():
        with tf.name_scope("layer"):
            a = hvd.allreduce(tf.constant([1.0 + r]), name="same", op=hvd.Sum)
            b = hvd.allreduce(tf.constant([10.0 * (r + 1)]), name="same", op=hvd.Sum)
            c = hvd.allreduce(tf.constant([5.0]), name="free", op=hvd.Sum,
                              ignore_name_scope=True)
        with v1.Session() as sess:
            got = sess.run([b, a, c])
    assert np.allclose(got[1], [sum(1.0 + q for q in range(n))]), got
    assert np.allclose(got[0], [sum(10.0 * (q + 1) for q in range(n))]), got
    assert np.allclose(got[2], [5.0 * n]), got


def _broadcast_inplace(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default():
        a = v1.Variable(np.full(3, float(r), np.float32))
        b = v1.Variable(np.full((2, 2), r, np.int32))
        values = hvd.broadcast_([a, b], root_rank=n - 1)
        single = hvd.broadcast_(a, root_rank=0)
        assert isinstance(values, list) and len(values) == 2
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            got = sess.run(values)  # only the results: the broadcast must run first
            assert np.array_equal(got[0], np.full(3, n - 1.0)), got
            assert np.array_equal(got[1], np.full((2, 2), n - 1)), got
            assert np.array_equal(sess.run(a), np.full(3, n - 1.0))
            sess.run(a.assign(np.full(3, float(r), np.float32)))
            assert np.array_equal(sess.run(single), np.zeros(3))
    c = tf.Variable([float(r)])  # eagerly: the value after the broadcast
    out = hvd.broadcast_(c, 0)
    assert isinstance(out, tf.Tensor) and float(out[0]) == 0.0 and float(c[0]) == 0.0, out


def _error_types(hvd: Any) -> None:
    """Ranks that disagree: tf.errors.FailedPreconditionError (also HorovodInternalError)
    eagerly and in a TF1 session; an alltoall with rows not divisible by the set size:
    InvalidArgumentError in both. The job goes on after each."""
    r, n = hvd.rank(), hvd.size()
    exc = _raises(tf.errors.FailedPreconditionError,
                  lambda: hvd.allreduce(tf.ones([2 + r]), name="types.eager"), "types.eager")
    assert isinstance(exc, hvd.HorovodInternalError), type(exc).__mro__
    _raises(hvd.HorovodInternalError, lambda: hvd.allgather(tf.ones([1, 1 + r]), name="t.g"))
    with tf.Graph().as_default():
        bad_dtype = hvd.allreduce(tf.ones([2], tf.float32 if r else tf.float64), name="types.v1")
        bad_rows = hvd.alltoall(tf.ones([n + 1]))
        with v1.Session() as sess:
            _raises(tf.errors.FailedPreconditionError, lambda: sess.run(bad_dtype), "dtype")
            _raises(tf.errors.InvalidArgumentError, lambda: sess.run(bad_rows))
    exc = _raises(tf.errors.InvalidArgumentError, lambda: hvd.alltoall(tf.ones([n + 1])))
    assert isinstance(exc, ValueError), type(exc).__mro__
    got = hvd.allreduce(tf.ones([2]), op=hvd.Sum)
    assert np.allclose(got.numpy(), np.full(2, float(n)))


def _sparse_rules(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()

    def slices(k: int, dtype: tf.DType = tf.float32) -> tf.IndexedSlices:
        return tf.IndexedSlices(tf.constant([[k * (r + 1), 2 * k]], dtype), tf.constant([r]),
                                tf.constant([n, 2]))

    dense = tf.constant([float(r), 1.0])
    out = hvd.grouped_allreduce([slices(1), dense, slices(3)], op=hvd.Sum)
    assert isinstance(out[0], tf.IndexedSlices) and isinstance(out[2], tf.IndexedSlices)
    for k, got in ((1, out[0]), (3, out[2])):
        want = np.array([[k * (q + 1.0), 2.0 * k] for q in range(n)])
        assert np.allclose(tf.convert_to_tensor(got).numpy(), want), (k, got)
    assert np.allclose(out[1].numpy(), [sum(range(n)), float(n)]), out[1]
    average = hvd.allreduce(slices(3, tf.int32), op=hvd.Average)
    assert average.values.dtype == tf.float64, average.values.dtype  # int / int: true division
    assert np.allclose(average.values.numpy(), [[3.0 * (q + 1) / n, 6.0 / n] for q in range(n)])
    for op in (hvd.Min, hvd.Max, hvd.Product, hvd.Adasum):
        _raises(NotImplementedError, lambda op=op: hvd.allreduce(slices(1), op=op))
        _raises(NotImplementedError, lambda op=op: hvd.grouped_allreduce([dense, slices(1)],
                                                                         op=op))
    for factor in ({"prescale_factor": 0.5}, {"postscale_factor": 2.0}):
        _raises(NotImplementedError, lambda f=factor: hvd.allreduce(slices(1), op=hvd.Sum, **f))


def _util(hvd: Any) -> None:
    import hora.tensorflow.util as util

    assert hvd._executing_eagerly() is True
    assert tf.function(lambda: tf.constant(hvd._executing_eagerly()))().numpy() == False  # noqa: E712
    calls = []
    cached = util._cache(lambda k: calls.append(k) or len(calls))
    assert cached(1) == cached(1) == 1 and cached(2) == 2 and calls == [1, 2]
    v = tf.Variable(1.0)
    assert util.refs_to_vars(util.vars_to_refs([v]))[0] is v


def cases() -> list[tuple[str, Case]]:
    out: list[tuple[str, Case]] = [
        ("v1-unordered", _unordered), ("v1-unordered-kinds", _unordered_kinds),
        ("v1-grouped-grad", _grouped_grad), ("v1-names", _names),
        ("v1-broadcast-inplace", _broadcast_inplace), ("error-types", _error_types),
        ("sparse-rules", _sparse_rules), ("util", _util)]
    assert [case_id for case_id, _ in out] == V1_IDS
    return out
