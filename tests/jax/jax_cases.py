"""JAX-only cases: pytrees, jit, vmap, gradients checked against Horovod's rules, optax, and
mismatches across ranks. Each ``fn(hvd)`` runs on every rank of a 2-rank job and asserts on
its own rank; expected values are computed here with numpy from every rank's inputs."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax_case_ids import JAX_ONLY


def _x(rank: int, shape: tuple[int, ...], salt: int = 0) -> np.ndarray:
    n = int(np.prod(shape))
    return ((np.arange(n) + 3 * rank + salt) % 5 + 1).astype(np.float32).reshape(shape)


def _tree(rank: int) -> dict[str, Any]:
    return {"w": _x(rank, (2, 3)), "b": [_x(rank, (3,), 1), _x(rank, (4, 1), 2)]}


def _eq(got: Any, want: Any, what: str, tol: float = 1e-5) -> None:
    g, w = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want), what
    for a, b in zip(g, w):
        assert np.shape(a) == np.shape(b), f"{what}: shape {np.shape(a)} != {np.shape(b)}"
        assert np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=tol), \
            f"{what}: got {np.asarray(a).ravel()[:6]} want {np.asarray(b).ravel()[:6]}"


def _all(fn: Callable[[int], Any], n: int) -> list[Any]:
    return [fn(q) for q in range(n)]


def _ops(hvd: Any, t: Any) -> dict[str, Any]:
    """Every op on ``t`` (a pytree), with the numpy reference of each."""
    return {"sum": hvd.allreduce(t, op=hvd.Sum), "avg": hvd.allreduce(t),
            "gather": hvd.allgather(t), "bcast": hvd.broadcast(t, 1),
            "rs": hvd.reducescatter(t, op=hvd.Sum), "grouped": hvd.grouped_allreduce(
                jax.tree_util.tree_leaves(t), op=hvd.Max)}


def _ops_want(r: int, n: int) -> dict[str, Any]:
    trees = _all(_tree, n)
    stack = lambda f: jax.tree_util.tree_map(lambda *xs: f(np.stack(xs)), *trees)  # noqa: E731
    total = stack(lambda s: s.sum(0))
    return {"sum": total, "avg": stack(lambda s: s.mean(0)),
            "gather": jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), *trees),
            "bcast": trees[1], "rs": jax.tree_util.tree_map(
                lambda x: np.array_split(x, n)[r], total),
            "grouped": jax.tree_util.tree_leaves(stack(lambda s: s.max(0)))}


def tree_ops(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    t = jax.tree_util.tree_map(jnp.asarray, _tree(r))
    _eq(_ops(hvd, t), _ops_want(r, n), "pytree ops (eager)")
    _eq(t, _tree(r), "inputs untouched")


def tree_async(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    t = jax.tree_util.tree_map(jnp.asarray, _tree(r))
    want = _ops_want(r, n)
    h = [hvd.allreduce_async(t, op=hvd.Sum), hvd.allgather_async(t),
         hvd.reducescatter_async(t, op=hvd.Sum), hvd.broadcast_async(t["w"], 1),
         hvd.grouped_allreduce_async(jax.tree_util.tree_leaves(t), op=hvd.Max),
         hvd.allreduce_async(t["w"], op=hvd.Sum, name="tree_async.one")]
    got = [hvd.synchronize(x) for x in h]
    _eq(got, [want["sum"], want["gather"], want["rs"], want["bcast"]["w"], want["grouped"],
              want["sum"]["w"]], "async forms")
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(got))


def metrics_dict(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    got = hvd.allreduce({"loss": jnp.float32(r), "acc": 0.5 + r, "count": jnp.int32(2 + r)})
    assert np.isclose(float(got["loss"]), (n - 1) / 2)
    assert np.isclose(float(got["acc"]), 0.5 + (n - 1) / 2)
    assert int(got["count"]) == int(sum(2 + q for q in range(n)) // n)


def _packable(rank: int, salt: int) -> dict[str, Any]:
    """Many small leaves of two dtypes, one large leaf (>= 128 KiB: not packed), a numpy
    leaf and a Python scalar."""
    return {"small": [jnp.asarray(_x(rank, (i % 3 + 1, 2), salt + i)) for i in range(12)],
            "ints": [jnp.asarray(_x(rank, (4,), salt + i).astype(np.int32)) for i in range(3)],
            "big": jnp.asarray(_x(rank, (300, 128), salt)), "np": _x(rank, (5,), salt + 7),
            "scalar": 1.5 + rank + salt}


def _packable_sum(n: int, salt: int) -> Any:
    return jax.tree_util.tree_map(lambda *xs: sum(np.asarray(x) for x in xs),
                                  *[_packable(q, salt) for q in range(n)])


def tree_packed(hvd: Any) -> None:
    """A tree packed into one buffer per dtype: eager twice (the cached plan; the first
    results must survive the second call), from two threads at once, inside jit, with
    Average, and differentiated."""
    r, n = hvd.rank(), hvd.size()
    first = hvd.allreduce(_packable(r, 0), op=hvd.Sum)
    second = hvd.allreduce(_packable(r, 1), op=hvd.Sum)
    _eq(first, _packable_sum(n, 0), "packed tree (eager, first call)")
    _eq(second, _packable_sum(n, 1), "packed tree (eager, cached plan)")
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(second))
    got: dict[int, Any] = {}

    def run(k: int) -> None:
        got[k] = hvd.allreduce(_packable(r, 2 + k), op=hvd.Sum, name=f"packed.thread{k}")
    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for k in range(2):
        _eq(got[k], _packable_sum(n, 2 + k), f"packed tree (thread {k})")
    # every leaf packed: the buffers are hora's own and reduced in place, eagerly and in jit
    def small(salt: int, tree: Any = None) -> Any:
        return {k: v for k, v in (tree or _packable(r, salt)).items() if k != "big"}
    for _ in range(2):
        inputs = small(6)
        _eq(hvd.allreduce(inputs, op=hvd.Sum), small(6, _packable_sum(n, 6)),
            "every leaf packed (eager, in place)")
        _eq(inputs, small(6), "inputs untouched (eager, in place)")
    reuse = jax.jit(lambda t: (hvd.allreduce(t, op=hvd.Sum), t["small"][0] * 1, t["np"] * 1))
    got_t, first, np_leaf = reuse(inputs := small(7))
    _eq(got_t, small(7, _packable_sum(n, 7)), "every leaf packed (jit, in place)")
    _eq([inputs, first, np_leaf], [small(7), small(7)["small"][0], small(7)["np"]],
        "inputs and leaves used after the op keep their values (jit, in place)")
    f = jax.jit(lambda t: hvd.allreduce(t, op=hvd.Sum))
    _eq(f(_packable(r, 4)), _packable_sum(n, 4), "packed tree (jit)")
    _eq(f(_packable(r, 5)), _packable_sum(n, 5), "packed tree (jit, again)")
    avg = hvd.allreduce({"a": jnp.asarray(_x(r, (3,))), "b": jnp.asarray(_x(r, (2, 2), 1))})
    _eq(avg, jax.tree_util.tree_map(lambda *xs: sum(xs) / n, *[
        {"a": _x(q, (3,)), "b": _x(q, (2, 2), 1)} for q in range(n)]), "packed tree (Average)")
    odd = {"empty": jnp.zeros((0, 3)), "bf16": jnp.asarray(_x(r, (5,)), jnp.bfloat16),
           "f16": [jnp.asarray(_x(r, (2,), i), jnp.float16) for i in range(2)]}
    for how, fn in (("eager", lambda t: hvd.allreduce(t, op=hvd.Sum)),
                    ("jit", jax.jit(lambda t: hvd.allreduce(t, op=hvd.Sum)))):
        got_odd = fn(odd)
        assert got_odd["empty"].shape == (0, 3) and got_odd["bf16"].dtype == jnp.bfloat16
        _eq(got_odd, jax.tree_util.tree_map(lambda *xs: sum(np.asarray(x, np.float32)
                                                            for x in xs), *[
            {"empty": np.zeros((0, 3)), "bf16": _x(q, (5,)),
             "f16": [_x(q, (2,), i) for i in range(2)]} for q in range(n)]),
            f"empty, bfloat16 and float16 leaves ({how})", tol=1e-2)
    _eq(jax.jit(lambda v: hvd.allreduce(v, op=hvd.Sum))(jnp.zeros(0)), np.zeros(0),
        "an empty array inside jit")
    floats = {"small": _packable(r, 0)["small"], "big": _packable(r, 0)["big"]}
    leaves, treedef = jax.tree_util.tree_flatten(floats)
    g = jax.jit(jax.grad(lambda t: sum((a * (i + 1)).sum() for i, a in enumerate(
        jax.tree_util.tree_leaves(hvd.allreduce(t, op=hvd.Sum))))))(floats)
    _eq(g, jax.tree_util.tree_unflatten(treedef, [np.full(np.shape(a), n * (i + 1.0))
                                                  for i, a in enumerate(leaves)]),
        "d packed tree (Horovod's rule: the Sum-allreduce of the cotangents)")


def pure_callback_fallback(hvd: Any) -> None:
    """Where the FFI host call is not available (another backend, another jaxlib), the same
    ops run through jax.pure_callback: packed trees eager and jitted, a gradient, a gather."""
    from hora.jax import host_call
    r, n = hvd.rank(), hvd.size()
    saved = host_call.available
    host_call.available = lambda: False
    try:
        tree = {"a": [jnp.asarray(_x(r, (3, 2), i)) for i in range(3)],
                "big": jnp.asarray(_x(r, (260, 128))), "i": jnp.asarray(_x(r, (7,)), jnp.int32)}
        want = jax.tree_util.tree_map(lambda *xs: sum(np.asarray(x) for x in xs), *[
            {"a": [_x(q, (3, 2), i) for i in range(3)], "big": _x(q, (260, 128)),
             "i": _x(q, (7,)).astype(np.int32)} for q in range(n)])
        _eq(hvd.allreduce(tree, op=hvd.Sum), want, "fallback: packed tree (eager)")
        _eq(jax.jit(lambda t: hvd.allreduce(t, op=hvd.Sum))(tree), want,
            "fallback: packed tree (jit)")
        g = jax.jit(jax.grad(lambda t: sum((a * 2).sum() for a in hvd.allreduce(
            t, op=hvd.Sum))))([jnp.asarray(_x(r, (4,))), jnp.asarray(_x(r, (2, 2)))])
        _eq(g, [np.full((4,), 2.0 * n), np.full((2, 2), 2.0 * n)], "fallback: gradient")
        _eq(jax.jit(lambda v: hvd.allgather(v))(jnp.asarray(_x(r, (2,)))),
            np.concatenate([_x(q, (2,)) for q in range(n)]), "fallback: allgather (jit)")
    finally:
        host_call.available = saved


def jit_ops(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    t = jax.tree_util.tree_map(jnp.asarray, _tree(r))
    f = jax.jit(lambda t: _ops(hvd, t))
    want = _ops_want(r, n)
    _eq(f(t), want, "pytree ops (jit)")
    _eq(f(t), want, "pytree ops (jit, second call)")
    a2a = jax.jit(lambda x: hvd.alltoall(x))(jnp.arange(2.0 * n) + 10 * r)
    _eq(a2a, np.concatenate([np.arange(2.0 * r, 2.0 * r + 2) + 10 * q for q in range(n)]),
        "alltoall (jit)")


def jit_steady_names(hvd: Any) -> None:
    """A compiled step keeps its op names: many executions, interleaved with eager ops."""
    r, n = hvd.rank(), hvd.size()
    step = jax.jit(lambda x: hvd.allreduce(x, op=hvd.Sum) + 1)
    x = jnp.full(4, float(r))
    want = float(sum(range(n))) + 1
    for _ in range(20):
        x = step(x)
        hvd.allreduce(jnp.ones(1))
    for _ in range(19):
        want = n * want + 1
    assert np.allclose(np.asarray(x), want, rtol=1e-6), (np.asarray(x), want)


def vmap_case(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    xs = jnp.asarray(np.stack([_x(r, (3,), k) for k in range(4)]))
    got = jax.jit(jax.vmap(lambda v: hvd.allreduce(v, op=hvd.Sum)))(xs)
    want = sum(np.stack([_x(q, (3,), k) for k in range(4)]) for q in range(n))
    _eq(got, want, "vmap(allreduce)")
    gathered = jax.vmap(lambda v: hvd.allgather(v))(xs)
    _eq(gathered, np.stack([np.concatenate([_x(q, (3,), k) for q in range(n)])
                            for k in range(4)]), "vmap(allgather): one gather per element")


def jit_into_results(hvd: Any) -> None:
    """Inside jit the core writes a lone leaf's and a single array's result straight into
    XLA's result buffer: the values, the input used after the op, under vmap, and a tree with
    a large leaf differentiated."""
    r, n = hvd.rank(), hvd.size()
    big = jnp.asarray(_x(r, (300, 128)))
    want_big = sum(_x(q, (300, 128)) for q in range(n))
    tree = {"big": big, "small": jnp.asarray(_x(r, (3,), 1))}
    f = jax.jit(lambda t: (hvd.allreduce(t, op=hvd.Sum, name="into.tree"), t["big"] + 0))
    for _ in range(2):  # twice: XLA may hand the second call other result buffers
        got, same = f(tree)
        _eq(got, {"big": want_big, "small": sum(_x(q, (3,), 1) for q in range(n))},
            "tree with a lone leaf (jit)")
        _eq(same, _x(r, (300, 128)), "the lone leaf's input used after the op")
    one = jax.jit(lambda a: (hvd.allreduce(a, op=hvd.Sum, name="into.one") * 1, a * 1))
    got_one, kept = one(big)
    _eq([got_one, kept], [want_big, _x(r, (300, 128))], "single array (jit)")
    batched = jax.jit(jax.vmap(lambda a: hvd.allreduce(a, op=hvd.Sum, name="into.vmap")))(
        jnp.stack([big, big * 2]))
    _eq(batched, np.stack([want_big, 2 * want_big]), "single array (jit, vmap)")
    grad = jax.jit(jax.grad(lambda t: jnp.sum(hvd.allreduce(t, name="into.grad")["big"] ** 2)))
    _eq(grad(tree)["big"], 2 * want_big / n, "gradient of a tree with a lone leaf")


def jit_inplace_computed(hvd: Any) -> None:
    """Inside jit a lone (large) leaf the function computes is aliased to its own result and
    reduced in place; an argument leaf is not (XLA would copy it first): the program's
    aliasing, the values, the computed leaf used after the op (XLA copies it then), under
    vmap, and differentiated."""
    r, n = hvd.rank(), hvd.size()
    x = jnp.asarray(_x(r, (300, 128)))
    want = sum(_x(q, (300, 128)) * 3 for q in range(n))

    def reduce(a: Any, name: str) -> Any:
        return hvd.allreduce({"big": a * 3, "arg": a, "small": a[0, :3], "small2": a[1, :2]},
                             op=hvd.Sum, name=name)
    f = jax.jit(lambda a: reduce(a, "inplace.tree"))
    text = f.lower(x).compile().as_text()
    call = next(line for line in text.splitlines() if "hora_host_call" in line
                and "custom-call(" in line)
    aliasing = set(re.findall(r"\{(\d+)\}: \((\d+),", call))  # (result, operand)
    # operands: the packed smalls' concatenation, then "arg" and "big" (the leaves' order);
    # results: the leaves in order (arg, big, small, small2), then the concatenation's
    assert aliasing == {("1", "2"), ("4", "0")}, call
    for _ in range(2):  # twice: XLA may hand the second call other result buffers
        got = f(x)
        _eq(got, {"big": want, "arg": want / 3, "small": want[0, :3] / 3,
                  "small2": want[1, :2] / 3},
            "tree with a computed lone leaf (jit, in place)")
    kept = jax.jit(lambda a: (reduce(a, "inplace.kept"), (a * 3) + 0))
    got, same = kept(x)
    _eq([got["big"], same], [want, _x(r, (300, 128)) * 3],
        "a computed lone leaf used after the op keeps its value (jit)")
    twice = jax.jit(lambda a: hvd.allreduce({"p": a * 3, "q": a * 3, "r": (a * 3)[::-1]},
                                            op=hvd.Sum, name="inplace.twice"))
    got = twice(x)  # one computed value (CSE'd) aliased to two results: XLA copies one first
    _eq(got, {"p": want, "q": want, "r": want[::-1]}, "one computed value as two lone leaves")
    batched = jax.jit(jax.vmap(lambda a: reduce(a, "inplace.vmap")["big"]))(
        jnp.stack([x, x * 2]))
    _eq(batched, np.stack([want, 2 * want]), "a computed lone leaf (jit, vmap)")
    grad = jax.jit(jax.grad(lambda a: jnp.sum(reduce(a, "inplace.grad")["big"] ** 2)))
    _eq(grad(x), 2 * 3 * n * want, "gradient through a computed lone leaf")


def _weights(rank: int, shape: tuple[int, ...]) -> np.ndarray:
    return _x(rank, shape, 7) * (rank + 1)


def _grad(fn: Callable[[Any], Any], x: np.ndarray) -> np.ndarray:
    return np.asarray(jax.jit(jax.grad(fn))(jnp.asarray(x)))


def grad_allreduce(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    x, w = _x(r, (2, 3)), _weights(r, (2, 3))
    ws = _all(lambda q: _weights(q, (2, 3)), n)
    for op, want in ((hvd.Sum, sum(ws)), (hvd.Average, sum(ws) / n), (hvd.Max, np.max(ws, 0))):
        g = _grad(lambda v, op=op: (w * hvd.allreduce(v, op=op)).sum(), x)
        _eq(g, want, f"d allreduce(op={op})")
    g = _grad(lambda v: (w * hvd.allreduce(v, op=hvd.Sum, prescale_factor=2.0,
                                           postscale_factor=0.5)).sum(), x)
    _eq(g, sum(ws), "d allreduce with factors (same factors on the gradient)")


def grad_allreduce_tree(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    t = _tree(r)
    wt = jax.tree_util.tree_map(lambda a: a * (r + 2), t)

    def loss(tree: Any) -> Any:
        out = hvd.allreduce(tree, op=hvd.Sum)
        return sum((a * b).sum() for a, b in zip(jax.tree_util.tree_leaves(out),
                                                  jax.tree_util.tree_leaves(wt)))
    g = jax.jit(jax.grad(loss))(jax.tree_util.tree_map(jnp.asarray, t))
    want = jax.tree_util.tree_map(lambda *a: sum(a), *[
        jax.tree_util.tree_map(lambda a, q=q: a * (q + 2), _tree(q)) for q in range(n)])
    _eq(g, want, "d allreduce(pytree)")


def grad_allgather(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    x, w = _x(r, (2, 3)), _weights(r, (2 * n, 3))
    g = _grad(lambda v: (w * hvd.allgather(v)).sum(), x)
    avg = sum(_all(lambda q: _weights(q, (2 * n, 3)), n)) / n
    _eq(g, avg[2 * r:2 * r + 2], "d allgather: average, then this rank's rows")


def grad_broadcast(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    x, w = _x(r, (3,)), _weights(r, (3,))
    g = _grad(lambda v: (w * hvd.broadcast(v, 1)).sum(), x)
    avg = sum(_all(lambda q: _weights(q, (3,)), n)) / n
    _eq(g, avg if r == 1 else np.zeros(3), "d broadcast: average at the root, zero elsewhere")


def grad_reducescatter(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    x = _x(r, (2 * n + 1, 2))
    share = (2 * n + 1) // n + (1 if r < (2 * n + 1) % n else 0)
    w = _weights(r, (share, 2))
    for op, scale in ((hvd.Sum, n), (hvd.Average, 1)):
        g = _grad(lambda v, op=op: (w * hvd.reducescatter(v, op=op)).sum(), x)
        want = np.concatenate([_weights(q, ((2 * n + 1) // n + (1 if q < (2 * n + 1) % n
                                                                  else 0), 2))
                               for q in range(n)]) * scale
        _eq(g, want, f"d reducescatter(op={op}): gradient * scale, allgathered")


def grad_alltoall(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    x, w = _x(r, (2 * n, 2)), _weights(r, (2 * n, 2))
    g = _grad(lambda v: (w * hvd.alltoall(v)).sum(), x)
    want = np.concatenate([_weights(q, (2 * n, 2))[2 * r:2 * r + 2] for q in range(n)])
    _eq(g, want, "d alltoall: gradients travel back")


def grad_eager_equals_jit(hvd: Any) -> None:
    r = hvd.rank()
    x, w = _x(r, (4,)), _weights(r, (4 * hvd.size(),))

    def loss(v: Any) -> Any:
        return (w * hvd.allgather(hvd.allreduce(v * v, op=hvd.Sum))).sum()
    eager = np.asarray(jax.grad(loss)(jnp.asarray(x)))
    _eq(eager, _grad(loss, x), "grad without jit == grad under jit")


def _train(hvd: Any, tx: Any, steps: int) -> tuple[Any, list[float]]:
    r = hvd.rank()
    rng = np.random.default_rng(100 + r)  # each rank its own data
    true_w = np.array([1.0, -2.0, 0.5], np.float32)
    params = {"w": jnp.asarray(rng.normal(size=3).astype(np.float32)), "b": jnp.float32(r)}
    params = hvd.broadcast_parameters(params, root_rank=0)
    opt_state = hvd.broadcast_optimizer_state(tx.init(params), root_rank=0)

    @jax.jit
    def step(p: Any, s: Any, xb: Any, yb: Any) -> Any:
        loss, g = jax.value_and_grad(
            lambda p: ((xb @ p["w"] + p["b"] - yb) ** 2).mean())(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, hvd.allreduce(loss)

    losses = []
    for _ in range(steps):
        xb = rng.normal(size=(16, 3)).astype(np.float32)
        params, opt_state, loss = step(params, opt_state, xb, xb @ true_w + 0.3)
        losses.append(float(loss))
    return params, losses


def _identical(hvd: Any, params: Any) -> None:
    everyone = hvd.allgather_object(jax.tree_util.tree_map(np.asarray, params))
    for other in everyone[1:]:
        for a, b in zip(jax.tree_util.tree_leaves(everyone[0]),
                        jax.tree_util.tree_leaves(other)):
            assert np.array_equal(a, b), "parameters differ across ranks"


def optimizer_identical(hvd: Any) -> None:
    params, losses = _train(hvd, hvd.DistributedOptimizer(optax.adam(0.05)), 60)
    _identical(hvd, params)
    assert losses[-1] < 0.1 * losses[0], losses[::10]


def optimizer_passes_fp16(hvd: Any) -> None:
    tx = hvd.DistributedOptimizer(optax.sgd(0.05), compression=hvd.Compression.fp16,
                                  backward_passes_per_step=2, name="opt2", groups=2)
    params, losses = _train(hvd, tx, 40)
    _identical(hvd, params)
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def broadcast_state(hvd: Any) -> None:
    r = hvd.rank()
    tx = optax.adam(0.1)
    params = {"w": jnp.full(3, float(r)), "k": jnp.int32(r)}
    state = tx.update(jax.tree_util.tree_map(jnp.ones_like, {"w": params["w"]}),
                      tx.init({"w": params["w"]}))[1]
    state = jax.tree_util.tree_map(lambda a: a * (r + 1), state)
    got_p = hvd.broadcast_parameters(params, root_rank=1)
    got_s = hvd.broadcast_optimizer_state(state, root_rank=1)
    _eq(got_p, {"w": np.full(3, 1.0), "k": 1}, "broadcast_parameters")
    root_state = jax.tree_util.tree_map(lambda a: np.asarray(a) / (r + 1) * 2, state)
    _eq(got_s, root_state, "broadcast_optimizer_state")
    assert hvd.broadcast_object({"r": r}, root_rank=1) == {"r": 1}


def _expect(fn: Callable[[], Any], pattern: str) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        assert re.search(pattern, str(exc)), f"error {type(exc).__name__}: {exc}"
        return
    raise AssertionError(f"no error raised (expected /{pattern}/)")


def mismatch_tree_structure(hvd: Any) -> None:
    r = hvd.rank()
    t = {"a": jnp.ones(2), ("b" if r == 0 else "c"): jnp.ones(3)}
    _expect(lambda: hvd.allreduce(t),
            r"ranks passed different pytrees: leaf \['(b|c)'\] is .* on rank 0, .* on rank 1")
    assert float(hvd.allreduce(jnp.ones(1))[0]) == 1.0  # the job goes on


def mismatch_tree_structure_jit(hvd: Any) -> None:
    r = hvd.rank()
    t = {"a": jnp.ones(2), "extra": [jnp.ones(1)] * (r + 1)}
    _expect(lambda: jax.block_until_ready(jax.jit(lambda t: hvd.allreduce(t))(t)),
            r"leaf \['extra'\]\[1\] is missing on rank 0, float(32|64)\[1\] on rank 1")


def mismatch_tree_shape(hvd: Any) -> None:
    r = hvd.rank()
    t = {"a": jnp.ones(2), "w": jnp.ones(3 + r)}
    _expect(lambda: hvd.allreduce(t),
            r"leaf \['w'\] is float(32|64)\[3\] on rank 0, float(32|64)\[4\] on rank 1")


def mismatch_shape(hvd: Any) -> None:
    r = hvd.rank()
    _expect(lambda: hvd.allreduce(jnp.ones(3 + r), name="mismatch.one"), r"shape")
    _expect(lambda: jax.jit(lambda x: hvd.allreduce(x, name="mismatch.jit"))(jnp.ones(3 + r)),
            r"shape")


def traced_errors(hvd: Any) -> None:
    x = jnp.ones((hvd.size(), 2))
    _expect(lambda: jax.jit(lambda v: hvd.synchronize(hvd.allreduce_async(v)))(x),
            r"cannot be called inside jax.jit")
    _expect(lambda: jax.jit(lambda v: hvd.alltoall(v, splits=[1, 1]))(x), r"splits=None")
    _expect(lambda: hvd.allreduce(jnp.ones(2, jnp.uint32)), r"Tensor type uint32 is not "
            r"supported")
    _expect(lambda: hvd.allgather(jnp.float32(1.0)), r"0-d arrays")


def results_adopted(hvd: Any) -> None:
    """Eager results are the core's 64-byte-aligned arrays, adopted by XLA without a copy, and
    each call's result stays its own (a later call does not write into an earlier result)."""
    from hora.core.data import aligned
    from hora.core.frontend.api import allreduce_async
    from hora.jax.bridge import to_jax

    r, n = hvd.rank(), hvd.size()
    host = allreduce_async(_x(r, (16384,)), name="adopted.core").wait()
    assert host.ctypes.data % aligned.ALIGN == 0, "core result not 64-byte aligned"
    adopted = to_jax(host)
    assert adopted.unsafe_buffer_pointer() == host.ctypes.data, "result copied, not adopted"
    first = hvd.allreduce(jnp.asarray(_x(r, (16384,))), op=hvd.Sum, name="adopted")
    second = hvd.allreduce(jnp.asarray(_x(r, (16384,), salt=1)), op=hvd.Sum, name="adopted")
    gathered = hvd.allgather(jnp.asarray(_x(r, (64, 8))), name="adopted.gather")
    _eq([first, second, gathered],
        [sum(_all(lambda q: _x(q, (16384,)), n)), sum(_all(lambda q: _x(q, (16384,), 1), n)),
         np.concatenate(_all(lambda q: _x(q, (64, 8)), n))], "adopted results")


CASES = {
    "results-adopted": results_adopted, "tree-ops": tree_ops, "tree-async": tree_async,
    "metrics-dict": metrics_dict,
    "tree-packed": tree_packed, "pure-callback-fallback": pure_callback_fallback,
    "jit-ops": jit_ops, "jit-steady-names": jit_steady_names,
    "vmap": vmap_case,
    "jit-into-results": jit_into_results, "jit-inplace-computed": jit_inplace_computed,
    "grad-allreduce": grad_allreduce, "grad-allreduce-tree": grad_allreduce_tree,
    "grad-allgather": grad_allgather, "grad-broadcast": grad_broadcast,
    "grad-reducescatter": grad_reducescatter, "grad-alltoall": grad_alltoall,
    "grad-eager-equals-jit": grad_eager_equals_jit, "optimizer-identical": optimizer_identical,
    "optimizer-passes-fp16": optimizer_passes_fp16, "broadcast-state": broadcast_state,
    "mismatch-tree-structure": mismatch_tree_structure,
    "mismatch-tree-structure-jit": mismatch_tree_structure_jit,
    "mismatch-tree-shape": mismatch_tree_shape, "mismatch-shape": mismatch_shape,
    "traced-errors": traced_errors,
}


def cases() -> list[tuple[str, Any]]:
    return [(case_id, CASES[case_id]) for case_id in JAX_ONLY]
