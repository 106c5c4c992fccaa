"""JAX training step: hora.jax's DistributedOptimizer vs jax.distributed + lax.psum (gloo) vs no
gradient sync, in one job; then a 100-leaf pytree allreduce vs one array of the same bytes.

    python benchmarks/jax_step.py                              # 2 ranks, MLP 784-1024-1024-10
    python benchmarks/jax_step.py --rounds 3 --steps 3 --hidden 128   # smoke test
    python benchmarks/jax_step.py --step-rounds 0 --rounds 5   # the pytree part only
    python benchmarks/jax_step.py --rounds 0 --step-rounds 5   # the training step only
    hora run -np 2 python benchmarks/jax_step.py --worker      # what the first line launches

The same 2 processes (started by ``hora run -np 2``) also join a ``jax.distributed`` job (its
coordinator on 127.0.0.1, CPU collectives through gloo, one CPU device per process) and train
three copies of one MLP on a fixed synthetic batch per rank, plain SGD, each step one jitted
function:

* ``hora``: ``value_and_grad``, ``hvd.DistributedOptimizer(optax.sgd)`` (the gradient pytree is
  one fused allreduce through a host callback), ``apply_updates``;
* ``psum``: the same step under ``jax.shard_map`` over a 2-device global mesh, the gradients
  averaged with ``jax.lax.psum`` (XLA's gloo collectives);
* ``nosync``: the step without any gradient exchange (the compute-only floor).

Variants are interleaved in rounds (order rotated per round) and medians over rounds are
reported; samples/s counts both ranks (the slower rank's time). The pytree part allreduces a
dict of 100 float32 leaves and one array of the same total bytes, interleaved: eagerly; as a
jitted function taking and returning the tree; "in-step" (the tree made from one input and
summed inside one jitted function, as a training step's gradients are); and, for scale, what
JAX and XLA alone charge for each jitted form ("JAX alone": a jitted ``x * 2`` of the tree and
of the array; the in-step function without its allreduce). It reports median microseconds per
op and the tree/array ratio (of the medians, and the median and range of the per-round
ratios); for the in-step form also the allreduce's own time (with minus without, round by
round).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any

VARIANTS = ("hora", "psum", "nosync")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--np", type=int, default=2, help="ranks")
    p.add_argument("--hidden", type=int, default=1024, help="hidden units (two layers)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    p.add_argument("--rounds", type=int, default=9,
                   help="interleaved rounds (x4 for the pytree part; 0 skips it)")
    p.add_argument("--step-rounds", type=int, default=None,
                   help="rounds of the training step (default --rounds; 0 skips it)")
    p.add_argument("--leaves", type=int, default=100, help="leaves of the pytree allreduce")
    p.add_argument("--leaf-kib", type=int, default=16, help="KiB per leaf")
    p.add_argument("--worker", action="store_true", help="run as a rank (inside hora run)")
    args = p.parse_args(argv)
    if args.step_rounds is None:
        args.step_rounds = args.rounds
    return args


def worker(args: argparse.Namespace) -> None:  # noqa: C901 - one benchmark, read top to bottom
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import hora.jax as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    port = hvd.broadcast_object(20000 + os.getpid() % 20000, 0)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=size, process_id=rank,
                               initialization_timeout=60)
    mesh = Mesh(np.array(jax.devices()), ("p",))
    dims = [784, args.hidden, args.hidden, 10]
    rng = np.random.default_rng(0)
    params0 = [{"w": jnp.asarray(rng.normal(0, 0.05, (a, b)).astype(np.float32)),
                "b": jnp.zeros(b, jnp.float32)} for a, b in zip(dims[:-1], dims[1:])]
    local = np.random.default_rng(1 + rank)
    xb = jnp.asarray(local.normal(size=(args.batch, 784)).astype(np.float32))
    yb = jnp.asarray(local.integers(0, 10, args.batch))

    def loss_fn(p: Any, x: Any, y: Any) -> Any:
        for layer in p[:-1]:
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        logits = x @ p[-1]["w"] + p[-1]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def make_step(tx: Any) -> Any:
        @jax.jit
        def step(p: Any, s: Any, x: Any, y: Any) -> Any:
            g = jax.grad(loss_fn)(p, x, y)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s
        return step

    hora_tx = hvd.DistributedOptimizer(optax.sgd(0.01), name="bench")
    plain_tx = optax.sgd(0.01)

    def psum_body(p: Any, x: Any, y: Any) -> Any:
        g = jax.grad(loss_fn)(p, x, y)
        g = jax.tree_util.tree_map(lambda a: jax.lax.psum(a, "p") / size, g)
        return jax.tree_util.tree_map(lambda a, b: a - 0.01 * b, p, g)

    psum_step = jax.jit(jax.shard_map(psum_body, mesh=mesh, in_specs=(P(), P("p"), P("p")),
                                      out_specs=P()))
    shard = NamedSharding(mesh, P("p"))
    repl = NamedSharding(mesh, P())

    def global_batch(a: Any) -> Any:
        return jax.make_array_from_single_device_arrays(
            (size * a.shape[0],) + a.shape[1:], shard, [jax.device_put(a, jax.local_devices()[0])])

    def replicated(tree: Any) -> Any:
        return jax.tree_util.tree_map(lambda a: jax.make_array_from_single_device_arrays(
            a.shape, repl, [jax.device_put(a, jax.local_devices()[0])]), tree)

    gx, gy = global_batch(xb), global_batch(yb)
    state: dict[str, Any] = {
        "hora": [params0, hora_tx.init(params0), make_step(hora_tx)],
        "nosync": [params0, plain_tx.init(params0), make_step(plain_tx)],
        "psum": [replicated(params0)],
    }

    def run(variant: str, steps: int) -> float:
        hvd.barrier()
        start = time.perf_counter()
        st = state[variant]
        for _ in range(steps):
            if variant == "psum":
                st[0] = psum_step(st[0], gx, gy)
            else:
                st[0], st[1] = st[2](st[0], st[1], xb, yb)
        jax.block_until_ready(st[0])
        mine = time.perf_counter() - start
        return float(hvd.allreduce(jnp.float32(mine), op=hvd.Max, name="bench.time"))

    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for v in VARIANTS if args.step_rounds else ():  # compile and warm up
        run(v, 2)
    for r in range(args.step_rounds):
        for v in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
            rates[v].append(size * args.batch * args.steps / run(v, args.steps))

    # pytree of many leaves vs one array of the same bytes, interleaved
    times = tree_vs_array(args, hvd, rank) if args.rounds else {}

    # replicas must agree (hora and psum keep ranks identical)
    same = {v: hvd.allgather_object(float(sum(jnp.sum(a) for a in jax.tree_util.tree_leaves(
        state[v][0] if v != "psum" else [s.addressable_shards[0].data
                                         for s in jax.tree_util.tree_leaves(state[v][0])]))))
            for v in ("hora", "psum") if args.step_rounds}
    if rank == 0 and args.step_rounds:
        med = {v: statistics.median(rates[v]) for v in VARIANTS}
        n_params = sum(a.size for a in jax.tree_util.tree_leaves(params0))
        print(f"\njax train step, {size} ranks, MLP {'-'.join(map(str, dims))} "
              f"({n_params / 1e6:.2f} M params), batch {args.batch}/rank, SGD; "
              f"{args.step_rounds} rounds x {args.steps} steps; jax {jax.__version__}")
        print(f"\n{'variant':>7} | {'samples/s':>10} {'min':>8} {'max':>8} | {'ms/step':>8}")
        for v in VARIANTS:
            print(f"{v:>7} | {med[v]:10.1f} {min(rates[v]):8.1f} {max(rates[v]):8.1f} | "
                  f"{1000 * size * args.batch / med[v]:8.2f}")
        per_round = sorted(h / p for h, p in zip(rates["hora"], rates["psum"]))
        print(f"\nhora/psum samples/s: {med['hora'] / med['psum']:.2f}x (ratio of medians), "
              f"{statistics.median(per_round):.2f}x (median of per-round ratios, "
              f"{per_round[0]:.2f}-{per_round[-1]:.2f}x)")
        print(f"hora overhead vs nosync: {100 * (med['nosync'] / med['hora'] - 1):.1f}%; "
              f"psum: {100 * (med['nosync'] / med['psum'] - 1):.1f}%")
    if rank == 0:
        if times:
            report_tree(args, times)
        if same:
            print("replicas identical across ranks: " + ", ".join(
                f"{v} {len(set(vals)) == 1}" for v, vals in same.items()))
    jax.distributed.shutdown()
    hvd.shutdown()


def tree_vs_array(args: argparse.Namespace, hvd: Any, rank: int) -> dict[str, list[float]]:
    """Seconds per call (the slower rank's) of each form, ``args.rounds * 4`` interleaved
    rounds of 10 calls (order reversed every other round, 2 warm-up rounds)."""
    import jax
    import jax.numpy as jnp

    n, leaves = args.leaf_kib * 256, args.leaves
    tree = {f"leaf{i:03d}": jnp.full(n, float(rank), jnp.float32) for i in range(leaves)}
    flat = jnp.full(n * leaves, float(rank), jnp.float32)
    rows = flat.reshape(leaves, n)

    def step_tree(x: Any, reduce: bool = True) -> Any:  # made and consumed in one function
        tree = {f"leaf{i:03d}": x[i] * (i + 1) for i in range(leaves)}
        out = hvd.allreduce(tree, name="bench.stree") if reduce else tree
        return sum(v.sum() for v in jax.tree_util.tree_leaves(out))

    calls: dict[str, tuple[Any, Any]] = {
        "eager tree": (lambda t: hvd.allreduce(t, name="bench.tree"), tree),
        "eager array": (lambda a: hvd.allreduce(a, name="bench.array"), flat),
        "jit tree": (jax.jit(lambda t: hvd.allreduce(t, name="bench.jtree")), tree),
        "jit array": (jax.jit(lambda a: hvd.allreduce(a, name="bench.jarray")), flat),
        "step tree": (jax.jit(step_tree), rows),
        "step array": (jax.jit(lambda x: hvd.allreduce(x * 2, name="bench.sarray").sum()),
                       rows),
        # the same functions without the allreduce: what JAX alone charges
        "jit0 tree": (jax.jit(lambda t: jax.tree_util.tree_map(lambda v: v * 2, t)), tree),
        "jit0 array": (jax.jit(lambda a: a * 2), flat),
        "step0 tree": (jax.jit(lambda x: step_tree(x, reduce=False)), rows),
        "step0 array": (jax.jit(lambda x: (x * 2).sum()), rows),
    }
    times: dict[str, list[float]] = {k: [] for k in calls}
    for r in range(args.rounds * 4 + 2):
        order = list(calls) if r % 2 == 0 else list(reversed(calls))
        for what in order:
            fn, x = calls[what]
            hvd.barrier()
            start = time.perf_counter()
            for _ in range(10):
                jax.block_until_ready(fn(x))
            t = (time.perf_counter() - start) / 10
            if r >= 2:
                times[what].append(float(hvd.allreduce(jnp.float32(t), op=hvd.Max,
                                                       name="bench.time")))
    return times


def _ratio(label: str, tt: list[float], ta: list[float]) -> None:
    per = sorted(a / b for a, b in zip(tt, ta))
    print(f"   {label:>17}: tree {1e6 * statistics.median(tt):8.1f} us | array "
          f"{1e6 * statistics.median(ta):8.1f} us | tree/array "
          f"{statistics.median(tt) / statistics.median(ta):.2f}x (per round: median "
          f"{statistics.median(per):.2f}x, {per[0]:.2f}-{per[-1]:.2f}x)")


def report_tree(args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    """Median µs per op of each form, and the tree/array ratio: of the medians, and the
    median and range of the per-round ratios; for the jitted forms also the allreduce's own
    time (the function's time minus the same function without the allreduce, per round)."""
    print(f"\nallreduce of a {args.leaves}-leaf pytree ({args.leaves} x {args.leaf_kib} KiB) "
          f"vs one array of the same {args.leaves * args.leaf_kib} KiB "
          f"({len(times['eager tree'])} rounds; the slower rank's time):")
    _ratio("eager", times["eager tree"], times["eager array"])
    _ratio("jit", times["jit tree"], times["jit array"])
    _ratio("jit, JAX alone", times["jit0 tree"], times["jit0 array"])
    _ratio("in-step", times["step tree"], times["step array"])
    _ratio("in-step, JAX alone", times["step0 tree"], times["step0 array"])
    _ratio("in-step, allreduce", *[
        [t - t0 for t, t0 in zip(times[f"step {w}"], times[f"step0 {w}"])]
        for w in ("tree", "array")])
    print("   (jit: a jitted function taking and returning the tree; JAX alone there: a jitted "
          "x * 2 of it; in-step: the tree made from one array and summed inside one jitted "
          "function; JAX alone there: the same function without the allreduce; allreduce: "
          "the difference, round by round)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--worker"]
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(args.np), sys.executable,
           os.path.abspath(__file__), "--worker", *rest]
    print("launching: " + shlex.join(["hora", "run", "-np", str(args.np), "python",
                                      "benchmarks/jax_step.py", "--worker", *rest]), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu",
           "HOROVOD_STALL_CHECK_TIME_SECONDS": "30"}
    sys.exit(subprocess.run(cmd, env=env, timeout=900).returncode)


if __name__ == "__main__":
    main()
