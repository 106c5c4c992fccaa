"""Step overhead: one framework's training step with hora's sync vs without sync vs the bytes alone.

    python benchmarks/step_overhead.py --framework torch     # MLP 784-2048-2048-10, 22 MiB
    python benchmarks/step_overhead.py --framework keras     # Keras 3 fit, MLP 784-1024-1024-10
    python benchmarks/step_overhead.py --framework jax       # jitted optax step, same MLP
    python benchmarks/step_overhead.py --framework jax --rounds 2 --steps 3 --hidden 64  # smoke
    hora run -np 2 python benchmarks/step_overhead.py --worker --framework torch   # one rank

The same 2 processes (``hora run -np 2``, one framework thread each) train two copies of one MLP
on a fixed synthetic batch per rank, plain SGD (JAX: one XLA thread per rank,
``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1`` unless set),
and allreduce arrays of the gradients' shapes,
in interleaved rounds (the order rotated per round):

* ``hora``: the step with hora's ``DistributedOptimizer`` (torch: gradient hooks during
  backward, ``step()`` waits; Keras 3: ``model.fit`` with ``hora.keras.DistributedOptimizer``;
  JAX: one jitted ``value_and_grad`` + ``hvd.DistributedOptimizer(optax.sgd)`` step);
* ``nosync``: the same step with the plain optimizer (the compute-only floor);
* ``bare``: numpy arrays of the gradients' shapes and dtype allreduced in place through the core
  (``hora.allreduce_async_`` each, then one wait for all): what the bytes alone cost on this
  machine, in the same job, without any framework.

It prints the median ms per step of each (``nosync``: the slowest rank's, as a job without sync
ends with its slowest rank; every rank's median too), the ``nosync / hora``
time ratio (ratio of the medians, and the median and range of the per-round ratios: the figure
of issue 29's targets),
and hora's extra time per step (``hora - nosync``) against ``bare``; then where the step's sync
point goes (Keras, JAX: hora's host call in the compiled step; torch: ``synchronize()`` in
``step()``, after backward, the hooks' allreduces having started during it): its duration on
rank 0, how long the earlier rank waited for the later one to get there, and the time from the
later arrival to the first exit, and rank 0's step before and after it (from the step's start
to the sync point's entry, from its exit to the step's end: what the step costs around the
sync point, to set against ``nosync``'s whole step); torch also the time its backward hooks
spend running the large gradients' allreduces themselves (those of 1 MiB and more, without
overlap). Step times are
rank 0's, from the end of a phase's first step to the end of its last (the first absorbs the
ranks' drift from the previous phase).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from _relaunch import relaunch

Runner = Callable[[int], list[float]]  # run n steps, return the time stamp after each


def _torch(args: argparse.Namespace) -> tuple[dict[str, Runner], list[tuple[int, ...]], Any]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import hora.torch as hvd
    from hora.torch import optimizer as hora_optimizer

    torch.set_num_threads(1)
    # large gradients' allreduces run in their backward hooks, on the backward thread
    hora_optimizer._wait_briefly = _stamped(hora_optimizer._wait_briefly, INLINE)
    hvd.init()
    rank = hvd.rank()

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(784, args.hidden), nn.ReLU(),
                             nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                             nn.Linear(args.hidden, 10))

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 784, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    runners: dict[str, Runner] = {}
    models = {}
    for variant in ("hora", "nosync"):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if variant == "hora":
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            opt.synchronize = _stamped(opt.synchronize)  # step() waits for the hooks' ops here
        models[variant] = model

        def run(n: int, model: nn.Module = model, opt: Any = opt) -> list[float]:
            stamps = []
            for _ in range(n):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                stamps.append(time.perf_counter())
            return stamps
        runners[variant] = run
    shapes = [tuple(p.shape) for p in models["hora"].parameters()]

    def check() -> float:
        return float(sum(p.detach().abs().sum() for p in models["hora"].parameters()))
    return runners, shapes, check


def _keras(args: argparse.Namespace) -> tuple[dict[str, Runner], list[tuple[int, ...]], Any]:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    import numpy as np

    import hora.keras as hvd
    from hora.tensorflow.gradients import GradientReducer

    hvd.init()
    GradientReducer._singles = _stamped(GradientReducer._singles)  # type: ignore[method-assign]
    rng = np.random.RandomState(hvd.rank())
    x = rng.randn(args.batch, 784).astype("float32")
    y = rng.randint(0, 10, size=args.batch).astype("float32")

    class Stamps(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.times.append(time.perf_counter())

    runners: dict[str, Runner] = {}
    models = {}
    for variant in ("hora", "nosync"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((784,)),
                                  keras.layers.Dense(args.hidden, activation="relu"),
                                  keras.layers.Dense(args.hidden, activation="relu"),
                                  keras.layers.Dense(10)])
        opt = keras.optimizers.SGD(0.01)
        model.compile(optimizer=hvd.DistributedOptimizer(opt) if variant == "hora" else opt,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        models[variant] = model

        def run(n: int, model: Any = model, ds: Any = ds) -> list[float]:
            stamps = Stamps()
            model.fit(ds, epochs=1, steps_per_epoch=n, verbose=0, shuffle=False,
                      callbacks=[stamps])
            return stamps.times
        runners[variant] = run
    shapes = [tuple(w.shape) for w in models["hora"].trainable_weights]

    def check() -> float:
        return float(sum(np.abs(w.numpy()).sum() for w in models["hora"].weights))
    return runners, shapes, check


def _jax(args: argparse.Namespace) -> tuple[dict[str, Runner], list[tuple[int, ...]], Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import hora.jax as hvd
    from hora.jax import host_call

    hvd.init()
    traced_call = host_call.call

    def call(fn: Any, *rest: Any, **kw: Any) -> Any:  # the step's host call, stamped
        return traced_call(_stamped(fn), *rest, **kw)
    host_call.call = call
    dims = [784, args.hidden, args.hidden, 10]
    rng = np.random.default_rng(0)
    params0 = [{"w": jnp.asarray(rng.normal(0, 0.05, (a, b)).astype(np.float32)),
                "b": jnp.zeros(b, jnp.float32)} for a, b in zip(dims[:-1], dims[1:])]
    local = np.random.default_rng(1 + hvd.rank())
    xb = jnp.asarray(local.normal(size=(args.batch, 784)).astype(np.float32))
    yb = jnp.asarray(local.integers(0, 10, args.batch))

    def loss_fn(p: Any, x: Any, y: Any) -> Any:
        for layer in p[:-1]:
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        logits = x @ p[-1]["w"] + p[-1]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    runners: dict[str, Runner] = {}
    final: dict[str, Any] = {}
    for variant in ("hora", "nosync"):
        tx = (hvd.DistributedOptimizer(optax.sgd(0.01), name="overhead") if variant == "hora"
              else optax.sgd(0.01))

        @jax.jit
        def step(p: Any, s: Any, x: Any, y: Any, tx: Any = tx) -> Any:
            g = jax.grad(loss_fn)(p, x, y)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        state = [params0, tx.init(params0)]

        def run(n: int, step: Any = step, state: list[Any] = state, v: str = variant
                ) -> list[float]:
            stamps = []
            for _ in range(n):
                state[0], state[1] = step(state[0], state[1], xb, yb)
                jax.block_until_ready(state[0])
                stamps.append(time.perf_counter())
            final[v] = state[0]
            return stamps
        runners[variant] = run
    shapes = [tuple(a.shape) for a in jax.tree_util.tree_leaves(params0)]

    def check() -> float:
        return float(sum(np.abs(np.asarray(a)).sum()
                         for a in jax.tree_util.tree_leaves(final["hora"])))
    return runners, shapes, check


CALLS: list[tuple[float, float]] = []
"""(entry, exit) of hora's host call (Keras, JAX) or of ``synchronize()`` (torch) during the
measured hora phases."""
BOUNDS: list[list[float]] = []
"""The measured hora phases' step boundaries: each phase's start, then each step's end."""
INLINE: list[tuple[float, float]] = []
"""torch: (entry, exit) of each allreduce a backward hook runs itself (large gradients)."""
_TIMING = [False]


def _stamped(fn: Callable[..., Any], into: list[tuple[float, float]] = CALLS
             ) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if _TIMING[0]:
            into.append((start, time.perf_counter()))
        return out
    return run


def _bare(shapes: list[tuple[int, ...]]) -> Runner:
    """Allreduce numpy arrays of ``shapes`` in place through the core, all submitted, then one
    wait for each: the bytes' own cost."""
    import numpy as np

    import hora

    arrays = [np.ones(s, np.float32) for s in shapes]

    def run(n: int) -> list[float]:
        stamps = []
        for _ in range(n):
            handles = [hora.allreduce_async_(a, name=f"bare.{i}") for i, a in enumerate(arrays)]
            for h in handles:
                hora.synchronize(h)
            stamps.append(time.perf_counter())
        return stamps
    return run


def worker(args: argparse.Namespace) -> None:
    import hora

    build = {"torch": _torch, "keras": _keras, "jax": _jax}[args.framework]
    runners, shapes, check = build(args)
    runners["bare"] = _bare(shapes)
    variants = ("hora", "nosync", "bare")

    def phase(variant: str, steps: int, timed: bool = False) -> float:
        hora.barrier()
        _TIMING[0] = timed and variant == "hora"
        start = time.perf_counter()
        stamps = runners[variant](steps)
        if _TIMING[0]:
            BOUNDS.append([start, *stamps])
        _TIMING[0] = False
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1)

    for v in variants:
        phase(v, args.warmup)
    times: dict[str, list[float]] = {v: [] for v in variants}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for v in variants[r % 3:] + variants[:r % 3]:
            times[v].append(phase(v, args.steps, timed=True))
    load.append(os.getloadavg()[0])
    checks = hora.allgather_object(round(check(), 2))
    calls = hora.allgather_object(CALLS)
    nosync = hora.allgather_object(times["nosync"])
    if hora.rank() == 0:
        _report(args, shapes, times, nosync, load, len(set(checks)) == 1)
        _breakdown(args.framework, calls)
    hora.shutdown()


def _report(args: argparse.Namespace, shapes: list[tuple[int, ...]],
            times: dict[str, list[float]], nosync: list[list[float]], load: list[float],
            same: bool) -> None:
    """Rank 0's medians; ``nosync`` is every rank's: a job without sync still ends with its
    slowest rank, so the nosync series is the slowest rank's (by its median; ranks on cores of
    unequal speed differ by up to ~10 % on this machine's VM; synced, every rank runs at the
    slowest one's pace). Not each round's slower rank: that maximum of two noisy samples would
    overstate nosync by the rounds' noise."""
    import numpy as np

    per_rank = [1e3 * statistics.median(t) for t in nosync]
    times = {**times, "nosync": nosync[per_rank.index(max(per_rank))]}
    nbytes = sum(4 * int(np.prod(s)) for s in shapes)
    med = {v: 1e3 * statistics.median(t) for v, t in times.items()}
    ratios = [n / h for n, h in zip(times["nosync"], times["hora"])]
    print(f"\n{args.framework} step, 2 ranks, MLP 784-{args.hidden}-{args.hidden}-10, "
          f"{len(shapes)} gradients, {nbytes / 2**20:.2f} MiB, batch {args.batch}/rank, "
          f"{args.rounds} rounds x {args.steps} steps; load {load[0]:.2f} -> {load[1]:.2f}")
    for v in ("hora", "nosync", "bare"):
        ms = [1e3 * t for t in times[v]]
        print(f"  {v:>7}: median {med[v]:7.2f} ms/step  (min {min(ms):7.2f}, max {max(ms):7.2f})"
              + ("  the slowest rank's; per rank: "
                 + ", ".join(f"{m:.2f}" for m in per_rank) if v == "nosync" else ""))
    print(f"  nosync/hora: {med['nosync'] / med['hora']:.3f} (per-round median "
          f"{statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f})")
    print(f"  hora - nosync: {med['hora'] - med['nosync']:.2f} ms/step; the bytes alone "
          f"(bare allreduce): {med['bare']:.2f} ms")
    print(f"  replicas identical across ranks: {'yes' if same else 'NO'}", flush=True)


def _breakdown(framework: str, stamps: list[list[tuple[float, float]]]) -> None:
    """Where hora's sync point of each step goes, from every rank's (entry, exit) stamps of the
    same calls (``time.perf_counter`` is one clock for the processes of a host)."""
    steps = list(zip(*stamps))
    if not steps:
        return

    def line(what: str, ms: list[float]) -> str:
        q = statistics.quantiles(ms, n=10) if len(ms) > 1 else ms * 9
        return (f"    {what:<46} median {statistics.median(ms):6.2f}  p10 {q[0]:6.2f}  "
                f"p90 {q[-1]:6.2f}")

    what = "synchronize() in step()" if framework == "torch" else "the host call"
    print(f"  {what} per step, ms ({len(steps)} steps):")
    print(line("duration on rank 0", [1e3 * (s[0][1] - s[0][0]) for s in steps]))
    print(line("the earlier rank waits for the later one", [
        1e3 * (max(e for e, _ in s) - min(e for e, _ in s)) for s in steps]))
    print(line("from the later entry to the first exit", [
        1e3 * (min(x for _, x in s) - max(e for e, _ in s)) for s in steps]), flush=True)
    ends = [(b[i], b[i + 1]) for b in BOUNDS for i in range(len(b) - 1)]
    if len(ends) == len(steps):  # one sync point a step: the step around it, rank 0
        print(line("rank 0's step before it", [1e3 * (e - a) for (a, _), (e, _) in
                                                zip(ends, stamps[0])]))
        print(line("rank 0's step after it", [1e3 * (b - x) for (_, b), (_, x) in
                                               zip(ends, stamps[0])]), flush=True)
    if INLINE:  # torch: the hooks' own allreduces, before synchronize()
        print(f"  allreduces run in backward hooks (gradients of 1 MiB and more) on rank 0: "
              f"{len(INLINE) / len(steps):.1f} per step, "
              f"{1e3 * sum(b - a for a, b in INLINE) / len(steps):.2f} ms per step", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("torch", "keras", "jax"), required=True)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=None,
                        help="hidden units (default: torch 2048, keras and jax 1024)")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", action="store_true",
                        help="run as one rank (under hora run) instead of launching")
    args = parser.parse_args(argv)
    if args.hidden is None:
        args.hidden = 2048 if args.framework == "torch" else 1024
    if args.steps < 2 or args.warmup < 2:
        parser.error("--steps and --warmup must be at least 2 (a phase's first step is not "
                     "timed)")
    if args.worker:
        worker(args)
        return
    relaunch(__file__, args.np, argv, {
        "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow",
        "JAX_PLATFORMS": "cpu",
        # one XLA thread per rank, as torch and TensorFlow get one each
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                                                 "intra_op_parallelism_threads=1")})


if __name__ == "__main__":
    main()
