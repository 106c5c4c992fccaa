"""Horovod's ``horovod.spark.keras``: :class:`KerasEstimator` fits a Keras 3 model on a Spark
DataFrame with ``num_proc`` ranks; the result, :class:`KerasModel`, is a Spark ML Transformer
that predicts on a DataFrame.

The driver imports Keras (the model is a Keras model) but never hora's engine; the ranks run
:func:`hora.spark.keras.remote.train`.
"""

from __future__ import annotations

import math
from typing import Any

from pyspark import keyword_only

from hora._util.log import get_logger
from hora.spark.common.backend import Backend
from hora.spark.common.data import DatasetInfo
from hora.spark.common.estimator import HorovodEstimator, HorovodModel
from hora.spark.common.params import install
from hora.spark.common.store import AbstractFilesystemStore

log = get_logger(__name__)


def input_shapes(model: Any) -> list[list[int]]:
    """``[-1, *shape]`` of each of the model's inputs."""
    return [[-1, *[int(d) for d in tensor.shape[1:]]] for tensor in model.inputs]


def _check_keras_3(model: Any) -> None:
    module = type(model).__module__
    if module.startswith(("tf_keras", "tensorflow.python.keras")):
        raise TypeError("KerasEstimator trains Keras 3 models (import keras); this model is a "
                        f"tf-keras (Keras 2) model ({module}). HINT: build it with Keras 3, or "
                        "train it with hora.spark.run and hora.tensorflow.keras.")


class KerasEstimator(HorovodEstimator):
    """Spark Estimator that fits a Keras 3 model on a DataFrame (Horovod's arguments).

    Args:
        num_proc: number of ranks (default ``spark.default.parallelism``); or ``backend``.
        model: the Keras model (its inputs take the feature columns, in order; it must have
            known input shapes, e.g. ``keras.Input((64,))``, and be savable as ``.keras``).
        backend, store: as for :class:`~hora.spark.torch.TorchEstimator`.
        optimizer: a Keras optimizer (sent by its config; wrapped in
            ``hvd.DistributedOptimizer`` on every rank).
        loss, loss_weights, metrics: as ``model.compile`` takes them.
        custom_objects: for loading the model and the optimizer on the ranks.
        feature_cols, label_cols, sample_weight_col, validation, batch_size, val_batch_size,
        epochs, verbose, random_seed, shuffle, partitions_per_process, run_id,
        train_steps_per_epoch, validation_steps_per_epoch, backward_passes_per_step,
        gradient_compression, transformation_fn, label_shapes, inmemory_cache_all: as for
        :class:`~hora.spark.torch.TorchEstimator`.
        callbacks: Keras callbacks, run on every rank after hora's broadcast and metric
            averaging.
        checkpoint_callback: accepted; the checkpoint is hora's (weights and optimizer state
            after every epoch, in the store).
    """

    RUN_PREFIX = "keras"
    CHECKPOINT_SUFFIX = ".npz"

    @keyword_only
    def __init__(self, *, num_proc: int | None = None, model: Any = None,
                 backend: Backend | None = None, store: Any = None, optimizer: Any = None,
                 loss: Any = None, metrics: Any = None, loss_weights: Any = None,
                 sample_weight_col: str | None = None, gradient_compression: Any = None,
                 custom_objects: Any = None, feature_cols: list[str] | None = None,
                 label_cols: list[str] | None = None, validation: Any = None,
                 callbacks: Any = None, batch_size: int | None = None,
                 val_batch_size: int | None = None, epochs: int | None = None,
                 verbose: int = 1, random_seed: int | None = None,
                 shuffle_buffer_size: int | None = None, shuffle: bool | None = None,
                 partitions_per_process: int | None = None, run_id: str | None = None,
                 train_steps_per_epoch: int | None = None,
                 validation_steps_per_epoch: int | None = None, transformation_fn: Any = None,
                 train_reader_num_workers: int | None = None,
                 val_reader_num_workers: int | None = None, reader_pool_type: str | None = None,
                 label_shapes: Any = None, checkpoint_callback: Any = None,
                 inmemory_cache_all: bool = False, backward_passes_per_step: int | None = None,
                 use_gpu: bool = True, mp_start_method: str | None = None) -> None:
        super().__init__()
        self._setDefault(custom_objects={}, checkpoint_callback=None)
        self.setParams(**self._input_kwargs)

    def _check_metadata_compatibility(self, metadata: dict[str, dict[str, Any]]) -> None:
        model = self.getOrDefault("model")
        _check_keras_3(model)
        feature_cols = list(self.getOrDefault("feature_cols"))
        try:
            shapes = input_shapes(model)
        except (AttributeError, ValueError):
            return  # a model not built yet: Keras says so on the ranks
        if len(shapes) != len(feature_cols):
            raise ValueError(f"the model has {len(shapes)} inputs for {len(feature_cols)} "
                             f"feature columns {feature_cols}")
        for col, shape in zip(feature_cols, shapes):
            per_row = math.prod(shape[1:])
            if per_row != int(metadata[col].get("shape", 1)):
                raise ValueError(f"model input {shape} holds {per_row} values per row, but "
                                 f"feature column {col!r} has {metadata[col].get('shape')}")

    def _fit_on_prepared_data(self, backend: Backend, store: AbstractFilesystemStore,
                              info: DatasetInfo, run_id: str) -> KerasModel:
        import keras

        from hora.spark.keras import remote

        get = self.getOrDefault
        model, optimizer = get("model"), get("optimizer")
        if optimizer is None:
            raise ValueError("KerasEstimator: the optimizer parameter is required")
        if get("loss") is None:
            raise ValueError("KerasEstimator: the loss parameter is required")
        if isinstance(optimizer, str):
            optimizer = keras.optimizers.get(optimizer)
        custom = get("custom_objects") or {}
        data = remote.model_bytes(model)
        spec = {name: get(name) for name in (
            "loss", "loss_weights", "metrics", "sample_weight_col", "label_cols",
            "label_shapes", "callbacks", "batch_size", "val_batch_size", "epochs", "verbose",
            "random_seed", "shuffle", "train_steps_per_epoch", "validation_steps_per_epoch",
            "transformation_fn", "inmemory_cache_all", "gradient_compression")}
        spec.update(model_bytes=data, optimizer_config=keras.optimizers.serialize(optimizer),
                    custom_objects=custom, feature_cols=list(get("feature_cols")),
                    input_shapes=input_shapes(model), store=store, info=info,
                    backward_passes_per_step=max(1, int(get("backward_passes_per_step"))),
                    checkpoint=self._load_checkpoint(store, run_id),
                    checkpoint_file=self._checkpoint_file(store, run_id),
                    logs_path=store.get_logs_path(run_id))
        results = backend.run(remote.train, args=(spec,), env={})
        trained = remote.load_model_bytes(data, custom)
        trained.set_weights(results[0]["weights"])
        return KerasModel(history=results[0]["history"], model=trained,
                          feature_columns=list(get("feature_cols")),
                          label_columns=list(get("label_cols")), custom_objects=custom,
                          run_id=run_id, _metadata=info.metadata)


class KerasModel(HorovodModel):
    """Spark Transformer wrapping a trained Keras model: ``transform(df)`` predicts on a
    DataFrame (one column per label column, ``<label>__output`` by default; an output of
    several values per row becomes a Vector). ``getModel()`` returns the Keras model,
    ``getHistory()`` Keras' history (metric -> a value per epoch)."""

    FRAMEWORK = "keras"

    @keyword_only
    def __init__(self, *, history: Any = None, model: Any = None,
                 feature_columns: list[str] | None = None,
                 label_columns: list[str] | None = None, custom_objects: Any = None,
                 run_id: str | None = None, _metadata: Any = None) -> None:
        super().__init__()
        self._setDefault(custom_objects={})
        if label_columns:
            self.setOutputCols([col + "__output" for col in label_columns])
        self.setParams(**self._input_kwargs)

    def _predict_spec(self) -> dict[str, Any]:
        from hora.spark.keras.remote import model_bytes

        model = self.getOrDefault("model")
        return {"framework": "keras", "model_bytes": model_bytes(model),
                "custom_objects": self.getOrDefault("custom_objects") or None,
                "input_shapes": input_shapes(model)}

    def _output_sizes(self) -> list[int]:
        outputs = self.getOrDefault("model").outputs
        return [math.prod(int(d) for d in tensor.shape[1:]) for tensor in outputs]

    def _model_to_bytes(self) -> bytes:
        from hora.spark.keras.remote import model_bytes

        return model_bytes(self.getOrDefault("model"))

    @classmethod
    def _model_from_bytes(cls, data: bytes, params: dict[str, Any]) -> Any:
        from hora.spark.keras.remote import load_model_bytes

        return load_model_bytes(data, params.get("custom_objects") or None)


install(KerasEstimator, [
    ("custom_objects", "custom objects for loading the model and optimizer", None, None),
    ("checkpoint_callback", "accepted; the checkpoint is hora's", None, None)])
install(KerasModel, [
    ("custom_objects", "custom objects for loading the model", None, None)])

__all__ = ["KerasEstimator", "KerasModel"]
