"""The function every rank of a :class:`~hora.spark.keras.KerasEstimator` fit runs: Horovod's
Keras recipe with ``hora.keras`` (Keras 3 on TensorFlow) on the rank's shard of the Parquet
data in the store.

Per rank: ``hvd.init()``; the model (a ``.keras`` file's bytes) and the optimizer (its Keras
config) from the driver, or the run's last checkpoint when it resumes; the optimizer wrapped in
``hvd.DistributedOptimizer``; ``model.fit`` over a fixed number of steps per epoch on every
rank with ``BroadcastGlobalVariablesCallback(0)`` and ``MetricAverageCallback()``, then the
user's callbacks, and rank 0 writing the checkpoint (weights and optimizer variables, ``.npz``)
and the history to the store after each epoch.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from hora.spark.common.reader import ShardReader, steps
from hora.spark.common.training import save_checkpoint


def load_model_bytes(data: bytes, custom_objects: Any = None) -> Any:
    """A Keras model from the bytes of its ``.keras`` file (uncompiled)."""
    import keras

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return keras.models.load_model(path, custom_objects=custom_objects, compile=False)


def model_bytes(model: Any) -> bytes:
    """The bytes of ``model``'s ``.keras`` file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def _array(values: np.ndarray, shape: list[int] | None) -> np.ndarray:
    if values.dtype == np.float64 or values.dtype == np.bool_:
        values = values.astype(np.float32)
    elif values.dtype.kind in "iu":
        values = values.astype(np.int64)
    return values.reshape([len(values), *shape[1:]]) if shape else values


def _batches(spec: dict[str, Any], reader: ShardReader) -> Iterator[tuple[Any, ...]]:
    features, labels = spec["feature_cols"], spec["label_cols"]
    label_shapes = spec["label_shapes"] or [None] * len(labels)
    for batch in reader.batches():
        if spec["transformation_fn"] is not None:
            batch = spec["transformation_fn"](batch)
        x = [_array(batch[c], s) for c, s in zip(features, spec["input_shapes"])]
        y = [_array(batch[c], s) for c, s in zip(labels, label_shapes)]
        item: tuple[Any, ...] = (x[0] if len(x) == 1 else tuple(x),
                                 y[0] if len(y) == 1 else tuple(y))
        if spec["sample_weight_col"]:
            item += (batch[spec["sample_weight_col"]].astype(np.float32),)
        yield item


def _weights_blob(model: Any, optimizer: Any) -> bytes:
    arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    arrays.update({f"o{i}": np.asarray(v) for i, v in enumerate(optimizer.variables)})
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _restore(model: Any, optimizer: Any, blob: bytes) -> None:
    with np.load(io.BytesIO(blob)) as data:
        weights = [data[f"w{i}"] for i in range(sum(k.startswith("w") for k in data.files))]
        model.set_weights(weights)
        saved = [data[f"o{i}"] for i in range(sum(k.startswith("o") for k in data.files))]
    optimizer.build(model.trainable_variables)
    if len(saved) == len(optimizer.variables):
        for variable, value in zip(optimizer.variables, saved):
            variable.assign(value)


def train(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Train on this rank; rank 0 returns ``{'history': {...}, 'weights': [...]}``, the other
    ranks None."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    import hora.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    tf.config.threading.set_intra_op_parallelism_threads(
        max(1, (os.cpu_count() or 1) // max(1, hvd.local_size())))
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if spec["random_seed"] is not None:
        keras.utils.set_random_seed(spec["random_seed"])
    custom = spec["custom_objects"]
    model = load_model_bytes(spec["model_bytes"], custom)
    optimizer = keras.optimizers.deserialize(spec["optimizer_config"], custom_objects=custom)
    optimizer = hvd.DistributedOptimizer(
        optimizer, compression=spec["gradient_compression"] or hvd.Compression.none,
        backward_passes_per_step=spec["backward_passes_per_step"])
    model.compile(optimizer=optimizer, loss=spec["loss"], loss_weights=spec["loss_weights"],
                  metrics=list(spec["metrics"] or []))
    start_epoch, history = 0, {}
    if spec["checkpoint"] is not None:
        blob, meta = spec["checkpoint"]
        _restore(model, optimizer, blob)
        start_epoch, history = int(meta.get("epoch", 0)), dict(meta.get("history") or {})
    store, info = spec["store"], spec["info"]
    columns = [*spec["feature_cols"], *spec["label_cols"]]
    if spec["sample_weight_col"]:
        columns.append(spec["sample_weight_col"])
    batch_size = spec["batch_size"]
    reader = ShardReader(store, info.train_data_path, columns, info.metadata, rank, size,
                         batch_size, spec["shuffle"], spec["random_seed"] or 0,
                         spec["inmemory_cache_all"])
    fit_args: dict[str, Any] = {
        "steps_per_epoch": spec["train_steps_per_epoch"] or steps(info.train_rows, batch_size,
                                                                  size)}
    if info.val_data_path:
        val_batch = spec["val_batch_size"] or batch_size
        val_reader = ShardReader(store, info.val_data_path, columns, info.metadata, rank, size,
                                 val_batch, False, 0, spec["inmemory_cache_all"])
        fit_args["validation_data"] = _batches(spec, val_reader)
        fit_args["validation_steps"] = spec["validation_steps_per_epoch"] or steps(
            info.val_rows, val_batch, size)

    class _Checkpoint(keras.callbacks.Callback):
        """Rank 0: after each epoch, the checkpoint and the history go to the store."""

        def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            for key, value in (logs or {}).items():
                history.setdefault(key, []).append(float(value))
            if rank == 0 and spec["checkpoint_file"]:
                save_checkpoint(store, spec["checkpoint_file"],
                                _weights_blob(self.model, optimizer), epoch + 1, history,
                                spec["logs_path"])

    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback(), *list(spec["callbacks"] or []),
                 _Checkpoint()]
    if start_epoch < spec["epochs"]:
        model.fit(_batches(spec, reader), epochs=spec["epochs"], initial_epoch=start_epoch,
                  shuffle=False,
                  callbacks=callbacks, verbose=(2 if spec["verbose"] else 0) if rank == 0
                  else 0, **fit_args)
    reader.close()
    if rank != 0:
        return None
    return {"history": history, "weights": model.get_weights()}
