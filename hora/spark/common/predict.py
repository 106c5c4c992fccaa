"""What a fitted model's ``transform()`` runs in the Spark executors: predict a partition's rows
in batches and append the predictions to each row.

This module is pickled *by value* into the Spark job (see
:meth:`hora.spark.common.estimator.HorovodModel._transform`), and imports nothing from hora:
the executors need the framework (torch, or Keras with TensorFlow) and numpy, not hora.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

BATCH_ROWS = 256
"""Rows predicted per call of the model."""


def _features(rows: list[Any], col: str, shape: list[int]) -> np.ndarray:
    values = []
    for row in rows:
        value = row[col]
        if hasattr(value, "toArray"):  # a Spark ML DenseVector / SparseVector
            value = value.toArray()
        values.append(np.asarray(value, dtype=np.float32))
    return np.stack(values).reshape([len(rows), *[int(d) for d in shape[1:]]])


def _torch_predictor(spec: dict[str, Any]) -> Any:
    import torch

    model = spec["model"]
    model.eval()

    def run(inputs: list[np.ndarray]) -> list[np.ndarray]:
        with torch.no_grad():
            out = model(*[torch.from_numpy(x) for x in inputs])
        outs = out if isinstance(out, (list, tuple)) else [out]
        return [o.detach().cpu().numpy() for o in outs]

    return run


def _keras_predictor(spec: dict[str, Any]) -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if spec.get("legacy"):
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import keras

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(spec["model_bytes"])
        model = keras.models.load_model(path, custom_objects=spec.get("custom_objects"),
                                        compile=False)

    def run(inputs: list[np.ndarray]) -> list[np.ndarray]:
        out = model(inputs[0] if len(inputs) == 1 else list(inputs), training=False)
        outs = out if isinstance(out, (list, tuple)) else [out]
        return [np.asarray(o) for o in outs]

    return run


def _value(pred: np.ndarray, kind: str) -> Any:
    from pyspark.ml.linalg import DenseVector

    if kind == "vector":
        return DenseVector(np.asarray(pred, dtype=np.float64).ravel())
    value = float(np.asarray(pred).ravel()[0])
    if kind == "int":
        return int(round(value))
    if kind == "bool":
        return value >= 0.5
    return value


def predict_partition(spec: dict[str, Any], rows: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
    """Each row of ``rows`` (Spark ``Row`` objects) as a tuple with the model's outputs
    appended, one value per output column (``spec['output_kinds']``: 'vector', 'float',
    'int' or 'bool')."""
    run = _torch_predictor(spec) if spec["framework"] == "torch" else _keras_predictor(spec)
    chunk: list[Any] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == BATCH_ROWS:
            yield from _predict(run, spec, chunk)
            chunk = []
    if chunk:
        yield from _predict(run, spec, chunk)


def _predict(run: Any, spec: dict[str, Any], chunk: list[Any]) -> Iterator[tuple[Any, ...]]:
    inputs = [_features(chunk, col, shape)
              for col, shape in zip(spec["feature_cols"], spec["input_shapes"])]
    outputs = run(inputs)
    kinds = spec["output_kinds"]
    for i, row in enumerate(chunk):
        yield (*row, *[_value(out[i], kind) for out, kind in zip(outputs, kinds)])
