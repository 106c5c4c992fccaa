"""Keras 3 ``model.fit``: hora's DistributedOptimizer vs MultiWorkerMirroredStrategy vs no sync.

    python benchmarks/keras_step.py                     # 2 ranks, MLP 784-1024-1024-10
    python benchmarks/keras_step.py --rounds 9 --steps 30
    python benchmarks/keras_step.py --rounds 1 --steps 3 --hidden 64    # smoke test
    python benchmarks/keras_step.py --rounds 9 --breakdown  # + where hora's host call spends
    hora run -np 2 python benchmarks/keras_step.py --worker   # what the first line launches

The same 2 processes (started by ``hora run -np 2``, one TensorFlow thread each) train three
copies of one MLP on a fixed synthetic batch of ``--batch`` samples per rank, SGD, each with
``model.fit(steps_per_epoch=--steps)``:

* ``hora``: ``hora.keras.DistributedOptimizer`` (one fused allreduce of the gradients per step,
  inside the compiled train step);
* ``mwms``: ``tf.distribute.MultiWorkerMirroredStrategy`` (TensorFlow's own collective ops over
  gRPC on 127.0.0.1, ports shared by rank 0 through ``hvd.broadcast_object``; the strategy is
  created first, as TensorFlow requires), model and optimizer built in its scope. Keras 3.15's
  ``model.fit`` fails under this strategy with 2 workers (``strategy.reduce("MEAN", loss,
  axis=0)`` on a scalar: "Invalid reduction dimension 0 for input with 0 dimensions"), so the
  step is the custom loop the TensorFlow guides use: ``strategy.run`` of tape + ``opt.apply``
  in one ``tf.function``;
* ``nosync``: ``model.fit`` with a plain optimizer (the compute-only floor of ``hora``);
* ``nosync_loop``: the custom loop without a strategy (the floor of ``mwms``).

The machine's speed swings, so variants are interleaved in rounds (order rotated per round) and
medians over rounds are reported. Samples/s counts both ranks: ``size * batch`` per step, the
step time measured on rank 0 from the end of a phase's first step to the end of its last (the
first step absorbs the ranks' drift from the previous phase: an unsynchronized variant lets one
rank run ahead, and a synchronized one then starts by waiting for the other). Ratios are of the
medians, and the median of the per-round ratios (robust to the machine's load drifting during
the run).

``--breakdown`` also times hora's host call (the allreduce of a step's gradients, inside the
compiled step) on both ranks during the measured hora phases: its duration on rank 0, how long
the earlier rank waited for the later one to enter it, and the time from the later entry to the
first exit (the collectives themselves). ``time.perf_counter`` is one clock for every process
of a host, so the ranks' stamps compare directly.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from typing import Any

from _relaunch import relaunch

VARIANTS = ("hora", "mwms", "nosync", "nosync_loop")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import hora

    hora.init()
    rank, size = hora.rank(), hora.size()
    ports = hora.broadcast_object([_free_port() for _ in range(size)] if rank == 0 else None, 0)
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": rank}})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # before any other TF op
    import keras
    import numpy as np

    import hora.keras as hvd
    from hora.core.engine import context

    rng = np.random.RandomState(rank)
    x = rng.randn(args.batch, 784).astype("float32")
    y = rng.randint(0, 10, size=args.batch).astype("float32")  # MWMS: Keras 3 averages a batch

    def mlp() -> Any:
        keras.utils.set_random_seed(0)
        layers = [keras.Input((784,))]
        layers += [keras.layers.Dense(args.hidden, activation="relu") for _ in range(2)]
        return keras.Sequential([*layers, keras.layers.Dense(10)])

    def loss() -> Any:  # one loss object per model (a shared one breaks the strategy's model)
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    models: dict[str, Any] = {}
    runs: dict[str, Any] = {}
    xt, yt = tf.constant(x), tf.constant(y)

    class Stamps(keras.callbacks.Callback):
        """When each step of a ``fit`` ended."""

        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.times.append(time.perf_counter())

    def fit_runner(model: Any) -> Any:
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        stamps = Stamps()

        def run(steps: int) -> list[float]:
            stamps.times = []
            model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False,
                      callbacks=[stamps])
            return stamps.times
        return run

    def loop_runner(model: Any, opt: Any, strategy: Any) -> Any:
        loss_fn = loss()

        def replica_step(xb: Any, yb: Any) -> None:
            with tf.GradientTape() as tape:
                # the strategy sums the replicas' gradients: scale each replica's mean loss
                value = loss_fn(yb, model(xb, training=True)) / strategy.num_replicas_in_sync
            opt.apply(tape.gradient(value, model.trainable_variables),
                      model.trainable_variables)

        step = tf.function(lambda: strategy.run(replica_step, args=(xt, yt)))

        def run(steps: int) -> list[float]:
            times = []
            for _ in range(steps):
                step()
                times.append(time.perf_counter())
            return times
        return run

    for variant in VARIANTS:
        if variant == "mwms":
            with strategy.scope():
                model, opt = mlp(), keras.optimizers.SGD(0.01)
                opt.build(model.trainable_variables)
            runs[variant] = loop_runner(model, opt, strategy)
        elif variant == "nosync_loop":
            model, opt = mlp(), keras.optimizers.SGD(0.01)
            runs[variant] = loop_runner(model, opt, tf.distribute.get_strategy())
        else:
            model, opt = mlp(), keras.optimizers.SGD(0.01)
            model.compile(optimizer=hvd.DistributedOptimizer(opt) if variant == "hora" else opt,
                          loss=loss())
            runs[variant] = fit_runner(model)
        models[variant] = model

    lane_ops = [0, 0]  # hora's allreduces during the measured rounds: through the lane, in all
    calls: list[tuple[float, float]] = []  # --breakdown: hora's host calls, (entry, exit)
    timing = [False]
    if args.breakdown:
        from hora.tensorflow.gradients import GradientReducer

        reduce_all = GradientReducer._singles

        def timed(self: Any, arrays: Any, names: list[str]) -> Any:
            start = time.perf_counter()
            out = reduce_all(self, arrays, names)
            if timing[0]:
                calls.append((start, time.perf_counter()))
            return out
        GradientReducer._singles = timed  # type: ignore[method-assign]

    def run(variant: str, steps: int, count: bool = False) -> float:
        """Seconds per step from the end of the first step to the end of the last."""
        lane = context.get().engine.lane(0)
        before = lane.describe() if lane is not None else None
        timing[0], first = count and variant == "hora", len(calls)
        times = runs[variant](steps)
        timing[0] = False
        del calls[first:first + 1]  # the phase's first step (untimed below too)
        if count and variant == "hora" and lane is not None and before is not None:
            after = lane.describe()
            lane_ops[0] += after["fast_ops"] - before["fast_ops"]
            lane_ops[1] += after["logged"] - before["logged"]
        return float(times[-1] - times[0]) / (len(times) - 1)

    for variant in VARIANTS:  # trace and warm up
        run(variant, args.warmup)
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for variant in order:
            rates[variant].append(size * args.batch / run(variant, args.steps, count=True))
    load.append(os.getloadavg()[0])
    weights = {v: float(sum(np.abs(w.numpy()).sum() for w in models[v].weights))
               for v in ("hora", "mwms")}
    everyone = hvd.allgather_object(weights)
    stamps = hvd.allgather_object(calls) if args.breakdown else []
    if rank == 0:
        _report(args, size, models["hora"].count_params(), rates, everyone, load)
        print(f"hora's gradient allreduces through the fast lane: {lane_ops[0]} of "
              f"{lane_ops[1]} (the others were negotiated with rank 0)", flush=True)
        if stamps:
            _breakdown(stamps)
    hvd.shutdown()


def _report(args: argparse.Namespace, size: int, n_params: int,
            rates: dict[str, list[float]], everyone: list[dict[str, float]],
            load: list[float]) -> None:
    import keras
    import tensorflow as tf

    med = {v: statistics.median(rates[v]) for v in VARIANTS}
    print(f"\nKeras model.fit step, {size} ranks x 1 thread, MLP 784-{args.hidden}-{args.hidden}"
          f"-10 ({n_params / 1e6:.2f} M params), batch {args.batch} per rank, SGD, "
          f"{args.rounds} rounds x {args.steps} steps")
    print(f"tensorflow {tf.__version__}, keras {keras.__version__}; load average "
          f"{load[0]:.1f} at the start, {load[1]:.1f} at the end")
    print(f"\n{'variant':>11} | {'samples/s':>10} {'min':>9} {'max':>9} | {'ms/step':>8}")
    for v in VARIANTS:
        print(f"{v:>11} | {med[v]:10.1f} {min(rates[v]):9.1f} {max(rates[v]):9.1f} | "
              f"{1000 * size * args.batch / med[v]:8.2f}")
    def per_round(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rates[a], rates[b]))

    print(f"\nhora/mwms samples/s: {med['hora'] / med['mwms']:.2f}x "
          f"(per-round median {per_round('hora', 'mwms'):.2f}x); "
          f"hora/nosync: {med['hora'] / med['nosync']:.2f}x "
          f"(per-round median {per_round('hora', 'nosync'):.2f}x); "
          f"mwms/nosync_loop: {med['mwms'] / med['nosync_loop']:.2f}x")
    same = {v: len({round(w[v], 3) for w in everyone}) == 1 for v in ("hora", "mwms")}
    print("replicas identical across ranks: "
          + ", ".join(f"{v} {'yes' if ok else 'NO'}" for v, ok in same.items()), flush=True)


def _breakdown(stamps: list[list[tuple[float, float]]]) -> None:
    """Print ``--breakdown``'s figures from every rank's (entry, exit) stamps of the same calls."""
    steps = list(zip(*stamps))  # one tuple of (entry, exit) per rank for each host call

    def line(what: str, ms: list[float]) -> str:
        q = statistics.quantiles(ms, n=10) if len(ms) > 1 else ms * 9
        return (f"  {what:<44} median {statistics.median(ms):6.2f}  p10 {q[0]:6.2f}  "
                f"p90 {q[-1]:6.2f}  mean {statistics.mean(ms):6.2f}")

    print(f"\nhora's host call per step, ms ({len(steps)} steps):")
    print(line("duration on rank 0", [1e3 * (s[0][1] - s[0][0]) for s in steps]))
    print(line("the earlier rank waits for the later one", [
        1e3 * (max(e for e, _ in s) - min(e for e, _ in s)) for s in steps]))
    print(line("from the later entry to the first exit", [
        1e3 * (min(x for _, x in s) - max(e for e, _ in s)) for s in steps]), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--breakdown", action="store_true",
                        help="also time hora's host call on both ranks (see the docstring)")
    parser.add_argument("--worker", action="store_true",
                        help="run as one rank (under hora run) instead of launching")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.warmup < 2:
        parser.error("--steps and --warmup must be at least 2 (a phase's first step is not "
                     "timed)")
    if args.worker:
        worker(args)
        return
    relaunch(__file__, args.np, argv,
             {"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow"})


if __name__ == "__main__":
    main()
