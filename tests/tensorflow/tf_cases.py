"""TensorFlow-only cases: every op in ``tf.function`` (values and static shapes), the gradient
of each op eagerly and in ``tf.function`` against its definition, ``DistributedGradientTape``,
variables, sparse allreduce, and mismatches across ranks in eager and graph mode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf
import tf_v1_cases
from tf_case_ids import GRAPH_DTYPES, TF_ONLY

Case = Callable[[Any], None]


def _data(shape: tuple[int, ...], rank: int, salt: int = 0) -> np.ndarray:
    n = int(np.prod(shape))
    return ((np.arange(n) + rank + salt) % 3 + 1).astype(np.float64).reshape(shape)


def _eq(got: Any, want: np.ndarray, what: str, tol: float = 1e-6) -> None:
    values = np.asarray(tf.convert_to_tensor(got).numpy()).astype(np.float64)
    assert values.shape == want.shape, f"{what}: shape {values.shape} != {want.shape}"
    assert np.allclose(values, want, rtol=tol, atol=tol), f"{what}: {values} != {want}"


# ---- every op inside tf.function ---------------------------------------------------------------
def _graph(dtype: str) -> Case:
    def case(hvd: Any) -> None:
        r, n = hvd.rank(), hvd.size()
        dt = tf.as_dtype(dtype)
        x = tf.constant(_data((2, 3), r), dt)
        rows = tf.constant(_data((r + 1, 2), r), dt)
        splits = [(r + j) % 2 + 1 for j in range(n)]
        send = tf.constant(np.repeat(np.arange(n, dtype=np.float64), splits)[:, None] * 10 + r,
                           dt)
        tall = tf.constant(_data((2 * n + 1, 2), r), dt)

        @tf.function
        def step(x: tf.Tensor, rows: tf.Tensor, send: tf.Tensor, tall: tf.Tensor) -> Any:
            return {
                "sum": hvd.allreduce(x, op=hvd.Sum, name="graph.sum"),
                "max": hvd.allreduce(x, op=hvd.Max),
                "grouped": hvd.grouped_allreduce([x, rows[:1]], op=hvd.Sum),
                "gather": hvd.allgather(rows),
                "ggather": hvd.grouped_allgather([rows, x]),
                "bcast": hvd.broadcast(x, n - 1),
                "a2a": hvd.alltoall(send, splits=splits),
                "even": hvd.alltoall(tf.tile(x[:1], [2 * n, 1])),
                "rs": hvd.reducescatter(tall, op=hvd.Sum),
                "grs": hvd.grouped_reducescatter([tall, tall], op=hvd.Sum),
            }

        specs = [tf.TensorSpec(None if i == 1 else t.shape, dt)
                 for i, t in enumerate((x, rows, send, tall))]
        out = step.get_concrete_function(*specs).structured_outputs
        assert out["sum"].shape.as_list() == [2, 3], out["sum"].shape
        assert out["bcast"].shape.as_list() == [2, 3], out["bcast"].shape
        assert out["gather"].shape.rank is None  # unknown input rank: unknown output
        assert out["ggather"][1].shape.as_list() == [None, 3], out["ggather"][1].shape
        assert out["a2a"][0].shape.as_list() == [None, 1], out["a2a"][0].shape
        assert out["rs"].shape.as_list() == [None, 2], out["rs"].shape
        parts = [_data((2, 3), q) for q in range(n)]
        gathered = np.concatenate([_data((q + 1, 2), q) for q in range(n)])
        full = np.sum([_data((2 * n + 1, 2), q) for q in range(n)], 0)
        counts = [(2 * n + 1) // n + (1 if q < (2 * n + 1) % n else 0) for q in range(n)]
        mine = full[sum(counts[:r]):sum(counts[:r + 1])]
        for _ in range(2):  # the second run reuses the trace (and the names)
            got = step(x, rows, send, tall)
            _eq(got["sum"], np.sum(parts, 0), "graph allreduce Sum")
            _eq(got["max"], np.max(parts, 0), "graph allreduce Max")
            _eq(got["grouped"][0], np.sum(parts, 0), "graph grouped_allreduce[0]")
            _eq(got["grouped"][1], np.sum([_data((q + 1, 2), q)[:1] for q in range(n)], 0),
                "graph grouped_allreduce[1]")
            _eq(got["gather"], gathered, "graph allgather")
            _eq(got["ggather"][0], gathered, "graph grouped_allgather[0]")
            _eq(got["ggather"][1], np.concatenate(parts), "graph grouped_allgather[1]")
            _eq(got["bcast"], parts[n - 1], "graph broadcast")
            recv = [(q + r) % 2 + 1 for q in range(n)]
            _eq(got["a2a"][0], np.concatenate([np.full((c, 1), r * 10 + q, np.float64)
                                               for q, c in enumerate(recv)]), "graph alltoall")
            _eq(got["a2a"][1], np.array(recv, np.float64), "graph received_splits")
            _eq(got["even"], np.concatenate([np.tile(_data((2, 3), q)[:1], (2, 1))
                                             for q in range(n)]), "graph alltoall even")
            _eq(got["rs"], mine, "graph reducescatter")
            for share in got["grs"]:
                _eq(share, mine, "graph grouped_reducescatter")
    return case


# ---- gradients against their definition, eager and in tf.function -----------------------------
def _weights(shape: tuple[int, ...], rank: int) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) + 10 * rank + 1


def _grad(forward: Callable[[tf.Tensor], tf.Tensor], x: np.ndarray, w: np.ndarray,
          graph: bool) -> np.ndarray:
    def g(x: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(forward(x) * tf.constant(w))
        return tape.gradient(loss, x)
    fn = tf.function(g) if graph else g
    return np.asarray(fn(tf.constant(x)).numpy())


def _gradients(graph: bool) -> Case:
    def case(hvd: Any) -> None:
        r, n = hvd.rank(), hvd.size()
        mode = "graph" if graph else "eager"
        x = _data((2, 3), r)
        ws = [_weights((2, 3), q) for q in range(n)]
        # allreduce: d/dx_r of every rank's w_q . y is Horovod's allreduce of the w_q
        got = _grad(lambda t: hvd.allreduce(t, op=hvd.Sum), x, ws[r], graph)
        _eq(got, np.sum(ws, 0), f"{mode} allreduce Sum grad")
        got = _grad(lambda t: hvd.allreduce(t, op=hvd.Average, prescale_factor=2.0), x, ws[r],
                    graph)
        _eq(got, 2.0 * np.mean(ws, 0), f"{mode} allreduce Average*2 grad")
        got = _grad(lambda t: hvd.grouped_allreduce([t, 3.0 * t], op=hvd.Sum)[1], x, ws[r],
                    graph)
        _eq(got, 3.0 * np.sum(ws, 0), f"{mode} grouped_allreduce grad")
        # allgather: mean of the ranks' weights, this rank's rows
        xr = _data((r + 1, 3), r)
        wg = [_weights((n * (n + 1) // 2, 3), q) for q in range(n)]
        start = r * (r + 1) // 2
        got = _grad(lambda t: hvd.allgather(t), xr, wg[r], graph)
        _eq(got, np.mean(wg, 0)[start:start + r + 1], f"{mode} allgather grad")
        got = _grad(lambda t: hvd.grouped_allgather([t])[0], xr, wg[r], graph)
        _eq(got, np.mean(wg, 0)[start:start + r + 1], f"{mode} grouped_allgather grad")
        # broadcast: mean of the weights on the root, zero elsewhere
        got = _grad(lambda t: hvd.broadcast(t, 1), x, ws[r], graph)
        _eq(got, np.mean(ws, 0) if r == 1 else np.zeros((2, 3)), f"{mode} broadcast grad")
        # alltoall: the weights travel back along the received splits
        xa = _data((n, 3), r)
        got = _grad(lambda t: hvd.alltoall(t, splits=[1] * n)[0], xa, ws[r][:1].repeat(n, 0)
                    if n != 2 else _weights((2, 3), r), graph)
        want = np.stack([_weights((2, 3), q)[r] for q in range(n)]) if n == 2 else None
        if want is not None:
            _eq(got, want, f"{mode} alltoall grad")
        # reducescatter Sum: the shares' weights gathered, times the set size
        xs = _data((n, 3), r)
        wr = [_weights((1, 3), q) for q in range(n)]
        got = _grad(lambda t: hvd.reducescatter(t, op=hvd.Sum), xs, wr[r], graph)
        _eq(got, n * np.concatenate(wr), f"{mode} reducescatter Sum grad")
        got = _grad(lambda t: hvd.grouped_reducescatter([t], op=hvd.Average)[0], xs, wr[r],
                    graph)
        _eq(got, np.concatenate(wr), f"{mode} grouped_reducescatter Average grad")
    return case


# ---- the tape, variables, sparse -----------------------------------------------------------------
def _tape(graph: bool) -> Case:
    def case(hvd: Any) -> None:
        r, n = hvd.rank(), hvd.size()
        w = tf.Variable([1.0, 2.0, 3.0])
        emb = tf.Variable(np.ones((4, 2)), dtype=tf.float32)
        local = tf.Variable([5.0])
        unused = tf.Variable([0.0])

        def grads(**options: Any) -> Any:
            with tf.GradientTape() as tape:
                rows = tf.gather(emb, [r, 3])  # an IndexedSlices gradient
                loss = (tf.reduce_sum(w * float(r + 1)) + tf.reduce_sum(rows) * float(r + 1)
                        + local[0] * float(r + 1))
            tape = hvd.DistributedGradientTape(tape, **options)
            tape.register_local_source(local)
            return tape.gradient(loss, [w, emb, local, unused])

        run = tf.function(grads) if graph else grads
        mean = np.mean([q + 1.0 for q in range(n)])
        for options in ({}, {"sparse_as_dense": True, "groups": 1},
                        {"compression": hvd.Compression.fp16}):
            gw, gemb, glocal, gunused = (tf.function(lambda o=options: grads(**o))()
                                         if graph else run(**options))
            _eq(gw, np.full(3, mean), f"tape {options} dense")
            dense = np.zeros((4, 2))
            for q in range(n):
                dense[q] += (q + 1.0) / n
                dense[3] += (q + 1.0) / n
            _eq(tf.convert_to_tensor(gemb), dense, f"tape {options} sparse")
            assert isinstance(gemb, tf.IndexedSlices) != bool(options.get("sparse_as_dense"))
            _eq(glocal, np.array([(r + 1.0) / n]), f"tape {options} local source")
            assert gunused is None
    return case


def _tape_results(hvd: Any) -> None:
    """Inside ``tf.function`` gradients are reduced in place, in the buffers TensorFlow hands
    over, and come back without a copy; a gradient whose buffer something else holds (a
    variable's value, a folded constant, a tensor the function returns or reads again, one
    tensor twice) is copied first, so nothing but the result changes. Results the caller
    keeps stay intact while later steps run. Eagerly the results go to pooled arrays."""
    from hora.tensorflow.gradients import GradientReducer

    r, n = hvd.rank(), hvd.size()
    w = tf.Variable(tf.zeros(4096))
    reducer = GradientReducer("results", hvd.Compression.none, False, hvd.Average, 1.0, None,
                              hvd.global_process_set, True)
    inputs: list[int] = []  # where the host call's input arrays live
    singles = reducer._singles

    def recorded(arrays: Any, names: list[str]) -> Any:
        inputs.extend(a.ctypes.data for a in arrays)
        return singles(arrays, names)
    reducer._singles = recorded  # type: ignore[method-assign]

    @tf.function
    def step(scale: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * scale)
        g = reducer([tape.gradient(loss, w)], [w])[0]
        # where the result lives, as the graph sees it (returning a tensor copies it)
        return g, tf.numpy_function(lambda a: np.int64(a.ctypes.data), [g], tf.int64)

    def scale(k: int) -> tf.Tensor:
        return tf.fill([4096], float((r + 1) * k))

    mean = np.mean([q + 1.0 for q in range(n)])
    kept = [step(scale(k))[0] for k in range(1, 8)]
    for k, g in enumerate(kept, 1):
        _eq(g, np.full(4096, mean * k), f"kept result of call {k}")
    del kept
    inputs.clear()
    for k in range(1, 4):
        g, address = step(scale(k))
        _eq(g, np.full(4096, mean * k), f"result of call {k}")
        assert int(address) == inputs[-1], f"result {int(address)} is a copy of {inputs[-1]}"
    assert not reducer.outputs.arrays(), "in-place results used the output pool"

    # buffers held elsewhere: Sum, so that a result written into a held buffer would grow
    # call after call
    total = GradientReducer("held", hvd.Compression.none, False, hvd.Sum, 1.0, None,
                            hvd.global_process_set, True)
    v = tf.Variable(tf.fill([8], r + 1.0))
    c = tf.Variable(tf.zeros([8]))
    vs = [tf.Variable(tf.zeros([8])) for _ in range(5)]

    @tf.function
    def held() -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(c * (r + 1.0))  # its gradient is a constant, folded
        const = tape.gradient(loss, c)
        shared = tf.ones([8]) * v  # also returned, and read again below
        out = total([v.read_value(), const, shared, shared, tf.zeros([8]) + 0.0 * shared],
                    vs)
        return out, shared, tf.reduce_sum(shared)

    want = sum(q + 1.0 for q in range(n))
    for call in range(3):
        out, shared, summed = held()
        for i in range(4):
            _eq(out[i], np.full(8, want), f"held buffer {i}, call {call}")
        _eq(out[4], np.zeros(8), f"zeros, call {call}")
        _eq(shared, np.full(8, r + 1.0), f"returned input, call {call}")
        _eq(summed, np.array(8 * (r + 1.0)), f"input read again, call {call}")
        _eq(v, np.full(8, r + 1.0), f"variable whose value was reduced, call {call}")

    # eagerly: the caller's tensors are left alone, results in pooled arrays
    eager = GradientReducer("eager", hvd.Compression.none, False, hvd.Average, 1.0, None,
                            hvd.global_process_set, True)
    x = tf.fill([256], r + 1.0)
    kept = [eager([x * k], [w])[0] for k in range(1, 5)]
    for k, g in enumerate(kept, 1):
        _eq(g, np.full(256, mean * k), f"eager result {k}")
    _eq(x, np.full(256, r + 1.0), "eager input")
    assert eager.outputs.arrays(), "eager results not pooled"


def _variables(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    a, b = tf.Variable(np.full(3, float(r))), tf.Variable(np.full((2, 2), r, np.int32))
    hvd.broadcast_variables([a, b], root_rank=n - 1)
    _eq(a, np.full(3, n - 1.0), "broadcast_variables float")
    _eq(b, np.full((2, 2), n - 1.0), "broadcast_variables int")
    c = tf.Variable([float(r)])
    _eq(hvd.broadcast_(c, 0, name="bcast_inplace"), np.array([0.0]), "broadcast_ result")
    _eq(c, np.array([0.0]), "broadcast_")
    assert hvd.broadcast_object({"r": r} if r == 1 else None, 1) == {"r": 1}
    assert hvd.allgather_object(r * 2) == [q * 2 for q in range(n)]
    slices = tf.IndexedSlices(tf.constant([[1.0, 2.0]]) * (r + 1), tf.constant([r]),
                              tf.constant([n, 2]))
    for op, scale in ((hvd.Average, 1.0 / n), (hvd.Sum, 1.0)):
        out = hvd.allreduce(slices, op=op)
        assert isinstance(out, tf.IndexedSlices)
        _eq(tf.convert_to_tensor(out), np.array([[q + 1.0, 2 * (q + 1.0)] for q in range(n)])
            * scale, f"sparse allreduce {op}")
    with tf.name_scope("scope"):
        _eq(hvd.allreduce(tf.constant([1.0]), name="scoped", op=hvd.Sum), np.array([n * 1.0]),
            "named op in a name scope")


# ---- mismatches across ranks ---------------------------------------------------------------------
def _mismatch(graph: bool) -> Case:
    def case(hvd: Any) -> None:
        r = hvd.rank()
        name = f"mismatch.{'graph' if graph else 'eager'}"
        x = tf.ones([2 + r])

        def op(x: tf.Tensor) -> tf.Tensor:
            return hvd.allreduce(x, name=name)

        fn = tf.function(op) if graph else op
        try:
            fn(x)
        except (hvd.HorovodInternalError, tf.errors.OpError) as exc:
            text = str(exc)
            assert name in text and "shape" in text.lower(), text
            # Horovod's type in both modes (a tf.function's stays the UnknownError carrying it)
            assert isinstance(exc, tf.errors.OpError), type(exc)
            assert graph or isinstance(exc, tf.errors.FailedPreconditionError), type(exc)
        else:
            raise AssertionError(f"{name}: mismatched shapes did not raise")
        # the job goes on: the next op agrees
        _eq(hvd.allreduce(tf.ones([2]), op=hvd.Sum), np.full(2, float(hvd.size())),
            "after mismatch")
    return case


def _host_call_in_place(hvd: Any) -> None:
    """host_call_in_place (the gradients' in-place host call): results written into the
    inputs' own memory come back as TensorFlow's own buffers (no copy, and a later kernel
    may write its output there), other results are converted, errors keep TensorFlow's
    mapping (ValueError -> InvalidArgumentError)."""
    from hora.tensorflow.bridge import host_call_in_place
    from hora.tensorflow.gradients import unshared

    seen: list[int] = []

    def address(t: Any) -> Any:
        return tf.numpy_function(lambda a: np.int64(a.ctypes.data), [t], tf.int64)

    def double(a: np.ndarray, b: np.ndarray) -> list[np.ndarray]:
        seen.extend([a.ctypes.data, b.ctypes.data])
        assert a.flags.writeable and b.flags.writeable
        a *= 2.0
        b += 1
        return [a, b]

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor) -> tuple[Any, ...]:
        a, b = host_call_in_place(double, [unshared(x * 1.0), unshared(y + 0)])
        return a + 0.0, b, address(a)

    @tf.function
    def then(x: tf.Tensor, y: tf.Tensor) -> Any:
        a, _ = host_call_in_place(double, [unshared(x * 1.0), unshared(y + 0)])
        return address(a * 3.0)  # a's only reader: its kernel may write into a's buffer

    x, y = tf.range(4096, dtype=tf.float32), tf.range(8, dtype=tf.int32)
    for _ in range(3):
        seen.clear()
        a, b, where = step(x, y)
        _eq(a, 2.0 * np.arange(4096), "in-place result")
        _eq(b, np.arange(8) + 1.0, "in-place int result")
        assert int(where) == seen[0], "the result is a copy of the input buffer"
        seen.clear()
        assert int(then(x, y)) == seen[0], "a later kernel could not reuse the result's buffer"
    _eq(x, np.arange(4096), "the caller's tensor")

    @tf.function
    def fresh(x: tf.Tensor) -> tf.Tensor:
        return host_call_in_place(lambda a: [a + 1.0], [unshared(x * 1.0)])[0]

    _eq(fresh(tf.ones([16])), np.full(16, 2.0), "a converted result")

    def bad(a: np.ndarray) -> list[np.ndarray]:
        raise ValueError("bad argument")

    @tf.function
    def failing(x: tf.Tensor) -> tf.Tensor:
        return host_call_in_place(bad, [unshared(x * 1.0)])[0]

    try:
        failing(tf.ones([4]))
    except tf.errors.InvalidArgumentError as exc:
        assert "bad argument" in str(exc), str(exc)
    else:
        raise AssertionError("the host call's ValueError was not raised")


def cases() -> list[tuple[str, Case]]:
    out: list[tuple[str, Case]] = [(f"graph-{d}", _graph(d)) for d in GRAPH_DTYPES]
    out += [("grad-eager", _gradients(False)), ("grad-graph", _gradients(True)),
            ("tape-eager", _tape(False)), ("tape-graph", _tape(True)),
            ("tape-results", _tape_results), ("host-call-in-place", _host_call_in_place),
            ("variables-sparse", _variables),
            ("mismatch-eager", _mismatch(False)), ("mismatch-graph", _mismatch(True))]
    out += tf_v1_cases.cases()
    assert [case_id for case_id, _ in out] == TF_ONLY, "update tf_case_ids.TF_ONLY"
    return out
