"""Horovod's Spark Estimators with hora: fit a PyTorch and a Keras model on a Spark DataFrame of
scikit-learn's handwritten digits (1797 8x8 images, shipped inside the package: no download),
then predict held-out rows with the fitted models' ``transform()``.

Horovod's ``examples/spark/pytorch/pytorch_spark_mnist.py`` and
``examples/spark/keras/keras_spark_mnist.py`` with the imports swapped
(``horovod.spark.*`` -> ``hora.spark.*``)::

    python examples/spark_estimator_digits.py                      # both, local[2], 2 ranks
    python examples/spark_estimator_digits.py --framework torch --epochs 10
    python examples/spark_estimator_digits.py --master spark://host:7077 --num-proc 4 \\
        --work-dir hdfs:///user/me/hora            # a cluster: a store every machine reaches

Each fit writes the DataFrame as Parquet into the store (``--work-dir``), trains on
``--num-proc`` ranks (one per Spark task), keeps a checkpoint per epoch under
``<work-dir>/runs/<run id>/``, and returns a Spark ML Transformer. Run it again with the same
``--run-id`` to resume from the last checkpoint. Ends with lines like
``torch: held-out accuracy 96.1% (2 ranks)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # local mode: the executors' Python

import numpy as np  # noqa: E402
from pyspark.ml.linalg import Vectors  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from hora.spark.common.backend import SparkBackend  # noqa: E402
from hora.spark.common.store import Store  # noqa: E402


def digits_frame(spark: Any) -> tuple[Any, Any]:
    """(train, test) DataFrames: ``features`` (a Vector of 64 pixels in [0, 1]), ``pixels``
    (the same as an array), ``label`` (double), ``digit`` (int); every fifth row held out."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rows = [(Vectors.dense(x / 16.0), [float(v) for v in x / 16.0], float(y), int(y),
             i % 5 == 0) for i, (x, y) in enumerate(zip(digits.data, digits.target))]
    df = spark.createDataFrame(rows, ["features", "pixels", "label", "digit", "is_test"])
    return df.filter("not is_test"), df.filter("is_test")


def accuracy(pred_df: Any, label: str, output: str) -> float:
    rows = pred_df.select(label, output).collect()
    return float(np.mean([int(np.argmax(r[output])) == int(r[label]) for r in rows]))


def fit_torch(args: argparse.Namespace, store: Store, train: Any, test: Any) -> float:
    import torch
    from torch import nn

    import hora.spark.torch as hvd

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    loss = nn.CrossEntropyLoss()
    estimator = hvd.TorchEstimator(
        backend=SparkBackend(num_proc=args.num_proc, stdout=sys.stdout, stderr=sys.stderr),
        store=store, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        loss=lambda output, label: loss(output, label.long()), input_shapes=[[-1, 64]],
        feature_cols=["features"], label_cols=["label"], batch_size=args.batch_size,
        epochs=args.epochs, validation=0.1, random_seed=args.seed, verbose=1,
        run_id=f"{args.run_id}_torch" if args.run_id else None)
    fitted = estimator.fit(train).setOutputCols(["label_prob"])
    return accuracy(fitted.transform(test), "label", "label_prob")


def fit_keras(args: argparse.Namespace, store: Store, train: Any, test: Any) -> float:
    import keras

    import hora.spark.keras as hvd

    keras.utils.set_random_seed(args.seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    estimator = hvd.KerasEstimator(
        backend=SparkBackend(num_proc=args.num_proc, stdout=sys.stdout, stderr=sys.stderr),
        store=store, model=model, optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"],
        feature_cols=["pixels"], label_cols=["digit"], batch_size=args.batch_size,
        epochs=args.epochs, validation=0.1, random_seed=args.seed, verbose=1,
        run_id=f"{args.run_id}_keras" if args.run_id else None)
    fitted = estimator.fit(train).setOutputCols(["digit_prob"])
    return accuracy(fitted.transform(test), "digit", "digit_prob")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", help="Spark master (default local[num-proc])")
    parser.add_argument("--num-proc", type=int, default=2, help="ranks (Spark tasks)")
    parser.add_argument("--framework", choices=["torch", "keras", "both"], default="both")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(),
                                                           "hora_estimator_digits"),
                        help="the store: intermediate Parquet data, checkpoints, logs")
    parser.add_argument("--run-id", help="name the runs (an existing run resumes)")
    args = parser.parse_args(argv)

    spark = (SparkSession.builder.master(args.master or f"local[{args.num_proc}]")
             .appName("hora_spark_estimator_digits")
             .config("spark.sql.shuffle.partitions", "4").getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    try:
        store = Store.create(args.work_dir)
        train, test = digits_frame(spark)
        frameworks = ["torch", "keras"] if args.framework == "both" else [args.framework]
        for name in frameworks:
            fit = fit_torch if name == "torch" else fit_keras
            acc = fit(args, store, train, test)
            print(f"{name}: held-out accuracy {100 * acc:.1f}% ({args.num_proc} ranks)")
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
