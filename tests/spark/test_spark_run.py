"""hora.spark.run on a real Spark in local mode: one rank per barrier task.

One SparkSession (local[4]) serves the whole module: its JVM takes ~10 s to start. At the end the
session is stopped and its JVM shut down, so no Spark outlives this module in the test process.
Skipped when pyspark or a Java runtime is missing.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pyspark", reason="pyspark is not installed (pip install pyspark)")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("no Java runtime for Spark (install a JRE, e.g. Debian's default-jre-headless)",
                allow_module_level=True)

import cloudpickle  # noqa: E402 (pyspark's dependency; after the skips)

import hora.spark  # noqa: E402
from hora.errors import ConfigError, RankFailedError  # noqa: E402
from hora.runner.api import RemoteTraceback  # noqa: E402

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
SLOTS = 4
MASTER = f"local[{SLOTS},4]"  # 4 tries per task, as spark.task.maxFailures on a cluster


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """A local[4,4] SparkSession (4 slots; a failed task may be retried, as on a cluster) whose
    Python workers run this interpreter; the functions of this module are pickled by value (the
    ranks cannot import a test module)."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    saved = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    session = (SparkSession.builder.master(MASTER).appName("hora-spark-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .getOrCreate())
    session.sparkContext.setLogLevel("FATAL")  # failing tasks are the point of some tests
    try:
        yield session
    finally:
        session.stop()
        gateway = SparkContext._gateway
        if gateway is not None:  # the JVM would otherwise live as long as this process
            proc = getattr(gateway, "proc", None)
            gateway.shutdown()
            if proc is not None and proc.stdin is not None:
                proc.stdin.close()  # the JVM exits when its stdin closes
                proc.wait(timeout=30)
            SparkContext._gateway = None
            SparkContext._jvm = None
        cloudpickle.unregister_pickle_by_value(module)
        if saved is None:
            os.environ.pop("PYSPARK_PYTHON", None)
        else:
            os.environ["PYSPARK_PYTHON"] = saved


# ---- functions the ranks run ------------------------------------------------------------------

def _topology() -> tuple[Any, ...]:
    import hora

    hora.init()
    total = hora.allreduce(np.array([float(hora.rank() + 1)]), op=hora.Sum, name="total")
    return (hora.rank(), hora.size(), hora.local_rank(), hora.local_size(), hora.cross_rank(),
            hora.cross_size(), float(total[0]), os.getpid())


def _echo(a: int, b: str, *, scale: float, tag: str = "none") -> tuple[Any, ...]:
    import hora

    hora.init()
    mean = hora.allreduce(np.full(3, float(hora.rank())) * scale, op=hora.Average)
    return hora.rank(), a, b, tag, mean.tolist()


def _environment() -> dict[str, Any]:
    with open("/proc/self/cmdline", "rb") as f:
        own = f.read()
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        parent = f.read()
    return {"setting": os.environ.get("MY_SETTING"), "secret": os.environ.get("HORA_SECRET_KEY"),
            "run_secret_visible": "_HORA_RUN_SECRET" in os.environ,
            "launcher": os.environ.get("HORA_LAUNCHER"), "rank": os.environ.get("HOROVOD_RANK"),
            "host": os.environ.get("HOROVOD_HOSTNAME"),
            "cmdlines": own + b"\0" + parent}


def _fail_on_rank_1(sleep_s: float, calls: str) -> str:
    import hora

    hora.init()
    with open(calls, "a") as f:
        f.write(f"{hora.rank()}\n")
    if hora.rank() == 1:
        raise ValueError("rank 1 could not go on")
    time.sleep(sleep_s)  # in no collective: the job must stop this rank itself
    return "rank 0 finished"


def _die_on_rank_1() -> float:
    import hora

    hora.init()
    if hora.rank() == 1:
        os._exit(3)
    return float(hora.allreduce(np.ones(2), name="after_the_death")[0])


def _talk() -> int:
    import hora

    hora.init()
    print(f"hello from rank {hora.rank()}", flush=True)
    print(f"warning from rank {hora.rank()}", file=sys.stderr, flush=True)
    return hora.rank()


def _train_digits(examples: str, steps: int) -> tuple[int, bytes, float, list[float]]:
    """A few DistributedOptimizer steps of examples/torch_digits.py's model and data."""
    sys.path.insert(0, examples)
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler
    from torch_digits import MLP, load_digits_split

    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(100 + hvd.rank())  # different initial weights: the broadcast must fix it
    train, _, n_in, n_out = load_digits_split(seed=0, val_fraction=0.2)
    model = MLP(n_in, n_out)
    opt = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    start = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    sampler: DistributedSampler[Any] = DistributedSampler(train, num_replicas=hvd.size(),
                                                          rank=hvd.rank(), seed=0)
    losses = []
    model.train()
    for _, (x, y) in zip(range(steps), DataLoader(train, batch_size=32, sampler=sampler)):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    end = torch.cat([p.detach().flatten() for p in model.parameters()])
    return hvd.rank(), end.numpy().tobytes(), float((end - start).abs().sum()), losses


# ---- tests --------------------------------------------------------------------------------------

def test_four_ranks_allreduce_with_topology_in_rank_order(spark: Any) -> None:
    results = hora.spark.run(_topology, num_proc=4)
    assert [r[:6] for r in results] == [(rank, 4, rank, 4, 0, 1) for rank in range(4)]
    assert [r[6] for r in results] == [10.0] * 4  # 1 + 2 + 3 + 4 on every rank
    assert len({r[7] for r in results}) == 4  # one process per rank
    assert os.getpid() not in {r[7] for r in results}


def test_args_kwargs_and_num_proc_from_default_parallelism(spark: Any) -> None:
    assert spark.sparkContext.defaultParallelism == SLOTS
    results = hora.spark.run(_echo, args=(7, "seven"), kwargs={"scale": 2.0, "tag": "x"})
    assert results == [(rank, 7, "seven", "x", [3.0, 3.0, 3.0]) for rank in range(SLOTS)]


def test_env_reaches_ranks_and_the_secret_stays_off_command_lines(spark: Any) -> None:
    context = spark.sparkContext
    context.environment["HORA_HOSTNAME"] = "executor-a"  # the executors' own host identity
    try:
        results = hora.spark.run(_environment, num_proc=2, env={"MY_SETTING": "on"})
    finally:
        del context.environment["HORA_HOSTNAME"]
    assert [r["host"] for r in results] == ["executor-a", "executor-a"]
    assert [r["setting"] for r in results] == ["on", "on"]
    assert [r["rank"] for r in results] == ["0", "1"]
    assert {r["launcher"] for r in results} == {"hora.spark.run"}
    assert not any(r["run_secret_visible"] for r in results)  # run_func takes it out
    secret = results[0]["secret"]
    assert re.fullmatch(r"[0-9a-f]{64}", secret) and results[1]["secret"] == secret
    for r in results:  # neither the rank's nor its Spark worker's command line
        assert secret.encode() not in r["cmdlines"]
    assert all(secret not in value for _, value in spark.sparkContext.getConf().getAll())


def test_an_error_on_rank_1_fails_the_job_with_its_type_and_rank(spark: Any,
                                                                   tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 1 could not go on") as info:
        hora.spark.run(_fail_on_rank_1, args=(120.0, str(calls)), num_proc=2)
    elapsed = time.monotonic() - start
    assert sorted(calls.read_text().split()) == ["0", "1"]  # Spark retried nothing
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback) and cause.rank == 1
    assert "_fail_on_rank_1" in cause.text
    assert elapsed < 30, f"rank 0 (sleeping, in no collective) was not stopped: {elapsed:.1f} s"


def test_a_rank_that_dies_is_named_with_its_exit_status(spark: Any) -> None:
    with pytest.raises(RankFailedError, match=r"rank 1 of 2 .*exited with code 3") as info:
        hora.spark.run(_die_on_rank_1, num_proc=2)
    assert info.value.rank == 1 and info.value.exit_status == 3


def test_rank_output_reaches_the_given_streams_with_prefixes(spark: Any) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert hora.spark.run(_talk, num_proc=2, stdout=out, stderr=err,
                          prefix_output_with_timestamp=True) == [0, 1]
    stamp = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"
    for rank in (0, 1):
        assert re.search(rf"^{stamp}\[{rank}\]<stdout>:hello from rank {rank}$", out.getvalue(),
                         re.M), out.getvalue()
        assert re.search(rf"^{stamp}\[{rank}\]<stderr>:warning from rank {rank}$",
                         err.getvalue(), re.M), err.getvalue()
    assert "<stderr>" not in out.getvalue()


def test_more_ranks_than_local_slots_is_refused_at_once(spark: Any) -> None:
    with pytest.raises(ConfigError, match=r"num_proc=5 .* local\[4,4\] has 4.*local\[5\]"):
        hora.spark.run(_topology, num_proc=5)


def test_tasks_that_cannot_all_start_time_out(spark: Any, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    from hora.spark import runner

    monkeypatch.setattr(runner, "local_slots", lambda master, cpus: None)  # as on a cluster
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^Timed out waiting for Spark tasks to start\..*"
                                           r"0 of 5 tasks started within 2 s"):
        hora.spark.run(_topology, num_proc=5, start_timeout=2)
    assert time.monotonic() - start < 20
    monkeypatch.undo()
    assert [r[0] for r in hora.spark.run(_topology, num_proc=2)] == [0, 1]  # Spark recovered


def test_torch_training_step_gives_identical_weights_on_both_ranks(spark: Any) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn", reason="examples/torch_digits.py needs scikit-learn")
    results = hora.spark.run(_train_digits, args=(EXAMPLES, 5), num_proc=2)
    assert [r[0] for r in results] == [0, 1]
    weights = [np.frombuffer(r[1], dtype=np.float32) for r in results]
    assert weights[0].size > 10_000
    assert np.array_equal(weights[0], weights[1])
    assert results[0][2] > 0  # the steps moved the weights
    assert len(results[0][3]) == 5 and results[0][3] != results[1][3]  # each its own batches


def test_an_unpicklable_fn_is_refused_before_spark_starts_a_job(spark: Any) -> None:
    import threading

    lock = threading.Lock()
    with pytest.raises(TypeError, match="fn, args and kwargs must be picklable"):
        hora.spark.run(lambda: lock.locked(), num_proc=2)


def test_without_an_active_context_the_error_says_so(spark: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from pyspark import SparkContext

    monkeypatch.setattr(SparkContext, "_active_spark_context", None)
    with pytest.raises(RuntimeError, match="Could not find an active SparkContext"):
        hora.spark.run(_topology)
