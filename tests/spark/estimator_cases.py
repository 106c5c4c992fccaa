"""The Spark Estimators on a real Spark in local mode, as one driver process: run by
tests/spark/test_spark_estimators.py (``python estimator_cases.py <work dir>``), so that the
pytest process never imports Spark's JVM, torch or Keras for them.

One ``local[2]`` SparkSession; scikit-learn's digits as a DataFrame (a Vector column for torch,
an array column for Keras), every fifth row held out. Each ``case_*`` function runs in file
order and prints ``CASE <name> OK`` or ``CASE <name> FAIL <reason>``; later cases use what
earlier ones fitted.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402

WORK = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/hora_estimator_cases")
STATE: dict[str, Any] = {}
ACCURACY = 0.90


class LogLines(logging.Handler):
    """Keeps the driver's hora log lines (the resume message is checked)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


LOG = LogLines()


def setup() -> None:
    from pyspark.ml.linalg import Vectors
    from pyspark.sql import SparkSession
    from sklearn.datasets import load_digits

    logging.getLogger("hora").addHandler(LOG)
    logging.getLogger("hora").setLevel(logging.INFO)
    spark = (SparkSession.builder.master("local[2]").appName("hora-estimator-tests")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("FATAL")
    digits = load_digits()
    x, y = digits.data / 16.0, digits.target
    rows = [(Vectors.dense(f), [float(v) for v in f], float(t), int(t), i % 5 == 0, i % 10 == 1)
            for i, (f, t) in enumerate(zip(x, y))]
    df = spark.createDataFrame(rows, ["features", "pixels", "label", "digit", "is_test",
                                      "is_val"]).cache()
    STATE.update(spark=spark, train=df.filter("not is_test"), test=df.filter("is_test"))


def accuracy(pred_df: Any, label: str, output: str) -> float:
    rows = pred_df.select(label, output).collect()
    return float(np.mean([int(np.argmax(r[output])) == int(r[label]) for r in rows]))


def torch_estimator(epochs: int, **kwargs: Any) -> Any:
    import torch
    from torch import nn

    import hora.spark.torch as hvd
    from hora.spark.common.backend import SparkBackend
    from hora.spark.common.store import Store

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return hvd.TorchEstimator(
        backend=SparkBackend(num_proc=2), store=Store.create(str(WORK / "store")), model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        loss=lambda out, label: nn.functional.cross_entropy(out, label.long()),
        input_shapes=[[-1, 64]], feature_cols=["features"], label_cols=["label"],
        batch_size=32, epochs=epochs, validation=0.1, partitions_per_process=2, random_seed=1,
        run_id="torch_run", **kwargs)


def case_torch_fit_with_validation_writes_a_checkpoint() -> None:
    import json

    model = torch_estimator(epochs=3).fit(STATE["train"])
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [1, 2, 3], history
    assert all(h["validation"]["loss"] > 0 for h in history), history
    assert history[-1]["train"]["loss"] < history[0]["train"]["loss"], history
    run = WORK / "store" / "runs" / "torch_run"
    assert (run / "checkpoint.pt").stat().st_size > 0, sorted(run.iterdir())
    meta = json.loads((run / "checkpoint.json").read_text())
    assert meta["epoch"] == 3 and len(meta["history"]) == 3, meta
    assert (run / "logs" / "history.json").exists()
    assert (WORK / "store" / "intermediate_train_data.0").is_dir()
    assert (WORK / "store" / "intermediate_val_data.0").is_dir()
    STATE["torch_history"] = history


def case_torch_resume_trains_only_the_missing_epochs() -> None:
    LOG.lines.clear()
    model = torch_estimator(epochs=6).fit(STATE["train"])
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [1, 2, 3, 4, 5, 6], history
    assert history[:3] == STATE["torch_history"], (history[:3], STATE["torch_history"])
    assert any("resuming run torch_run" in line and "after epoch 3" in line
               for line in LOG.lines), LOG.lines
    assert any("reusing the prepared data" in line for line in LOG.lines), LOG.lines
    STATE["torch_model"] = model


def case_torch_model_transform_predicts_held_out_rows() -> None:
    model = STATE["torch_model"].setOutputCols(["label_prob"])
    start = time.monotonic()
    acc = accuracy(model.transform(STATE["test"]), "label", "label_prob")
    print(f"torch transform: accuracy {acc:.3f} on held-out rows "
          f"({time.monotonic() - start:.1f} s)")
    assert acc >= ACCURACY, acc
    default = type(model)(**{"model": model.getModel(), "feature_columns": ["features"],
                             "input_shapes": [[-1, 64]], "label_columns": ["label"],
                             "_metadata": model._get_metadata()})
    assert default.getOutputCols() == ["label__output"]


def case_torch_model_save_and_load() -> None:
    from hora.spark.torch import TorchModel

    model = STATE["torch_model"]
    path = str(WORK / "saved_torch_model")
    model.write().overwrite().save(path)
    try:
        model.save(path)
        raise AssertionError("saving over an existing path did not fail")
    except FileExistsError:
        pass
    loaded = TorchModel.load(path)
    assert loaded.getOutputCols() == model.getOutputCols()
    assert loaded.getHistory() == model.getHistory()
    rows = STATE["test"].limit(20)
    a = [r.label_prob for r in model.transform(rows).select("label_prob").collect()]
    b = [r.label_prob for r in loaded.transform(rows).select("label_prob").collect()]
    assert np.allclose(np.array(a), np.array(b)), (a[:2], b[:2])


def case_a_missing_column_is_named_before_spark_runs_anything() -> None:
    estimator = torch_estimator(epochs=1).setFeatureCols(["feature"])
    try:
        estimator.fit(STATE["train"])
    except ValueError as exc:
        assert "Feature columns ['feature'] not found" in str(exc) and "features" in str(exc)
    else:
        raise AssertionError("fit did not fail")


def case_a_column_of_the_wrong_type_is_named() -> None:
    from pyspark.sql import functions as F

    df = STATE["train"].withColumn("text", F.lit("seven"))
    try:
        torch_estimator(epochs=1).setFeatureCols(["text"]).fit(df)
    except TypeError as exc:
        assert "'text' has type string" in str(exc), exc
    else:
        raise AssertionError("fit did not fail")


def case_ranks_without_hora_fail_with_the_reason() -> None:
    from hora.errors import RankFailedError
    from hora.spark.common.backend import SparkBackend

    python = "/usr/bin/python3"
    if not Path(python).exists():
        print("(no /usr/bin/python3: nothing to check)")
        return
    estimator = torch_estimator(epochs=1)
    estimator.setBackend(SparkBackend(num_proc=2, executable=python))
    estimator.setRunId("no_hora")
    try:
        estimator.fit(STATE["train"])
    except (RankFailedError, ImportError) as exc:
        print(f"without hora: {type(exc).__name__}: {str(exc)[:300]!r}")
        assert "No module named" in str(exc), exc
    else:
        raise AssertionError("fit did not fail")


def keras_estimator(epochs: int) -> Any:
    import keras

    import hora.spark.keras as hvd
    from hora.spark.common.backend import SparkBackend
    from hora.spark.common.store import Store

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    return hvd.KerasEstimator(
        backend=SparkBackend(num_proc=2), store=Store.create(str(WORK / "store")), model=model,
        optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
        metrics=["accuracy"], feature_cols=["pixels"], label_cols=["digit"], batch_size=32,
        epochs=epochs, validation="is_val", partitions_per_process=2, random_seed=1,
        run_id="keras_run", verbose=0)


def case_keras_fit_resume_and_transform() -> None:
    first = keras_estimator(epochs=3).fit(STATE["train"])
    history = first.getHistory()
    assert len(history["loss"]) == 3 and len(history["val_accuracy"]) == 3, history
    run = WORK / "store" / "runs" / "keras_run"
    assert (run / "checkpoint.npz").stat().st_size > 0, sorted(run.iterdir())
    model = keras_estimator(epochs=5).fit(STATE["train"])
    resumed = model.getHistory()
    assert len(resumed["loss"]) == 5 and resumed["loss"][:3] == history["loss"], resumed
    start = time.monotonic()
    acc = accuracy(model.setOutputCols(["digit_prob"]).transform(STATE["test"]), "digit",
                   "digit_prob")
    print(f"keras transform: accuracy {acc:.3f} on held-out rows "
          f"({time.monotonic() - start:.1f} s)")
    assert acc >= ACCURACY, acc


def main() -> int:
    start = time.monotonic()
    setup()
    print(f"SparkSession and data: {time.monotonic() - start:.1f} s", flush=True)
    cases = [(name, fn) for name, fn in globals().items() if name.startswith("case_")]
    for name, fn in cases:
        begin = time.monotonic()
        try:
            fn()
            print(f"CASE {name[5:]} OK ({time.monotonic() - begin:.1f} s)", flush=True)
        except BaseException as exc:  # noqa: BLE001 (every failure is reported as the case's)
            detail = "".join(traceback.format_exception(exc)).replace("\n", "\n    ")
            print(f"CASE {name[5:]} FAIL {type(exc).__name__}: {exc}\n    {detail}", flush=True)
    STATE["spark"].stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
