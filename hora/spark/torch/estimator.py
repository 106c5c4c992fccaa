"""Horovod's ``horovod.spark.torch``: :class:`TorchEstimator` fits a PyTorch model on a Spark
DataFrame with ``num_proc`` ranks; the result, :class:`TorchModel`, is a Spark ML Transformer
that predicts on a DataFrame.

The driver imports torch (the model is a torch module) but never hora's engine; the ranks run
:func:`hora.spark.torch.remote.train`.
"""

from __future__ import annotations

import copy
import io
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


def default_input_shapes(feature_cols: list[str], metadata: dict[str, dict[str, Any]]
                         ) -> list[list[int]]:
    """``[-1, length]`` per feature column (``[-1, 1]`` for a number)."""
    return [[-1, int(metadata[c].get("shape", 1))] for c in feature_cols]


def check_input_shapes(feature_cols: list[str], input_shapes: list[Any],
                       metadata: dict[str, dict[str, Any]]) -> None:
    """Each shape must hold as many values per row as its column has."""
    if len(input_shapes) != len(feature_cols):
        raise ValueError(f"input_shapes has {len(input_shapes)} shapes for "
                         f"{len(feature_cols)} feature columns {feature_cols}")
    for col, shape in zip(feature_cols, input_shapes):
        per_row = math.prod(int(d) for d in list(shape)[1:])
        length = int(metadata[col].get("shape", 1))
        if per_row != length:
            raise ValueError(f"input shape {list(shape)} holds {per_row} values per row, but "
                             f"feature column {col!r} has {length}")


class TorchEstimator(HorovodEstimator):
    """Spark Estimator that fits a PyTorch model on a DataFrame (Horovod's arguments).

    Args:
        num_proc: number of ranks (default ``spark.default.parallelism``); or ``backend``.
        model: the ``torch.nn.Module`` to train (its ``forward`` takes one tensor per feature
            column, in order).
        backend: a :class:`~hora.spark.common.backend.Backend` (default
            ``SparkBackend(num_proc)``); not together with ``num_proc``.
        store: a :class:`~hora.spark.common.store.Store` (or a path for ``Store.create``).
        optimizer: a ``torch.optim`` optimizer built on ``model.parameters()``; wrapped in
            ``hvd.DistributedOptimizer`` on every rank.
        loss: ``loss(output, label)``, or one per label column.
        loss_constructors: functions that return the loss(es) (instead of ``loss``).
        metrics: functions ``metric(output, label) -> number`` averaged per epoch.
        loss_weights: a weight per loss.
        sample_weight_col: a column of row weights (the loss must then return one value per
            row: ``reduction='none'``).
        gradient_compression: ``hvd.Compression.fp16`` / ``.none``.
        feature_cols, label_cols: the DataFrame's columns (numbers, Vectors or arrays).
        input_shapes: a shape per feature column, batch first (default ``[-1, length]``).
        label_shapes: a shape per label column (default: as stored, ``[rows]`` or
            ``[rows, length]``).
        validation: a split in [0, 1) or the name of a 0/1 column.
        callbacks: objects with any of ``on_train_begin()``, ``on_epoch_end(epoch, logs)``,
            ``on_train_end(logs)``, called on every rank.
        batch_size, val_batch_size: rows per rank per step.
        epochs: epochs to train (a resumed run trains the epochs its checkpoint lacks).
        verbose: 0 quiet; 1 logs every epoch's metrics on rank 0.
        random_seed: torch's seed and the shuffling's.
        shuffle: shuffle the training rows (default True).
        partitions_per_process: Parquet partitions per rank (default 10).
        run_id: the run's name in the store; an existing run resumes from its checkpoint.
        train_steps_per_epoch, validation_steps_per_epoch: steps per epoch (default: every
            row once over all ranks).
        backward_passes_per_step: local gradient accumulations per allreduce.
        transformation_fn: applied to every batch (a dict of column name -> numpy array).
        inmemory_cache_all: keep each rank's shard in memory after the first epoch.
        Others of Horovod's (``train_minibatch_fn``, reader worker counts, ``use_gpu``, ...)
        are accepted; see docs/spark.md for what they do here.
    """

    RUN_PREFIX = "pytorch"
    CHECKPOINT_SUFFIX = ".pt"

    @keyword_only
    def __init__(self, *, num_proc: int | None = None, model: Any = None,
                 backend: Backend | None = None, store: Any = None, optimizer: Any = None,
                 loss: Any = None, loss_constructors: Any = None, metrics: Any = None,
                 loss_weights: Any = None, sample_weight_col: str | None = None,
                 gradient_compression: Any = None, feature_cols: list[str] | None = None,
                 input_shapes: list[Any] | None = None, validation: Any = None,
                 label_cols: list[str] | None = None, callbacks: Any = None,
                 batch_size: int | None = None, val_batch_size: int | None = None,
                 epochs: int | None = None, verbose: int = 1, random_seed: int | None = None,
                 shuffle_buffer_size: int | None = None, shuffle: bool | None = None,
                 partitions_per_process: int | None = None, run_id: str | None = None,
                 train_minibatch_fn: Any = None, train_steps_per_epoch: int | None = None,
                 validation_steps_per_epoch: int | None = None, transformation_fn: Any = None,
                 train_reader_num_workers: int | None = None,
                 val_reader_num_workers: int | None = None, reader_pool_type: str | None = None,
                 label_shapes: Any = None, inmemory_cache_all: bool = False,
                 use_gpu: bool = True, mp_start_method: str | None = None,
                 backward_passes_per_step: int | None = None) -> None:
        super().__init__()
        self._setDefault(input_shapes=None, loss_constructors=None, train_minibatch_fn=None)
        kwargs = self._input_kwargs
        if kwargs.get("loss") is not None and kwargs.get("loss_constructors") is not None:
            raise ValueError("only one of loss_constructors and loss parameters can be "
                             "specified.")
        self.setParams(**kwargs)

    def _losses(self) -> Any:
        constructors = self.getOrDefault("loss_constructors")
        if constructors is not None:
            return [make() for make in constructors]
        loss = self.getOrDefault("loss")
        if loss is None:
            raise ValueError("TorchEstimator: the loss parameter is required (e.g. "
                             "loss=torch.nn.functional.cross_entropy)")
        return loss

    def _check_metadata_compatibility(self, metadata: dict[str, dict[str, Any]]) -> None:
        shapes = self.getOrDefault("input_shapes")
        if shapes is not None:
            check_input_shapes(list(self.getOrDefault("feature_cols")), shapes, metadata)

    def _fit_on_prepared_data(self, backend: Backend, store: AbstractFilesystemStore,
                              info: DatasetInfo, run_id: str) -> TorchModel:
        import torch

        model, optimizer = self.getOrDefault("model"), self.getOrDefault("optimizer")
        if optimizer is None:
            raise ValueError("TorchEstimator: the optimizer parameter is required")
        feature_cols = list(self.getOrDefault("feature_cols"))
        input_shapes = self.getOrDefault("input_shapes") or default_input_shapes(feature_cols,
                                                                     info.metadata)
        get = self.getOrDefault
        spec = {name: get(name) for name in (
            "loss_weights", "sample_weight_col", "label_cols", "label_shapes", "callbacks",
            "batch_size", "val_batch_size", "epochs", "verbose", "random_seed", "shuffle",
            "train_steps_per_epoch", "validation_steps_per_epoch", "transformation_fn",
            "inmemory_cache_all", "gradient_compression")}
        spec.update(model=model, optimizer=optimizer, loss=self._losses(),
                    metrics=list(get("metrics") or []), feature_cols=feature_cols,
                    input_shapes=input_shapes, store=store, info=info,
                    backward_passes_per_step=max(1, int(get("backward_passes_per_step"))),
                    checkpoint=self._load_checkpoint(store, run_id),
                    checkpoint_file=self._checkpoint_file(store, run_id),
                    logs_path=store.get_logs_path(run_id))
        from hora.spark.torch import remote

        results = backend.run(remote.train, args=(spec,), env={})
        result = results[0]
        state = torch.load(io.BytesIO(result["state"]), map_location="cpu", weights_only=False)
        trained = copy.deepcopy(model)
        trained.load_state_dict(state["model"])
        trained.eval()
        trained_opt = None
        try:
            trained_opt = type(optimizer)(trained.parameters(), **optimizer.defaults)
            trained_opt.load_state_dict(state["optimizer"])
        except (TypeError, ValueError) as exc:
            log.info("TorchEstimator: the trained optimizer's state is not kept: %s", exc)
        return TorchModel(history=result["history"], model=trained, optimizer=trained_opt,
                          feature_columns=feature_cols, input_shapes=input_shapes,
                          label_columns=list(get("label_cols")), run_id=run_id,
                          _metadata=info.metadata, loss=get("loss"),
                          loss_constructors=self.getOrDefault("loss_constructors"))


class TorchModel(HorovodModel):
    """Spark Transformer wrapping a trained PyTorch model: ``transform(df)`` predicts on a
    DataFrame (one column per label column, ``<label>__output`` by default; a model output of
    several values per row becomes a Vector). ``getModel()`` returns the torch module,
    ``getHistory()`` the metrics of every epoch."""

    FRAMEWORK = "torch"

    @keyword_only
    def __init__(self, *, history: Any = None, model: Any = None,
                 feature_columns: list[str] | None = None, input_shapes: Any = None,
                 label_columns: list[str] | None = None, optimizer: Any = None,
                 run_id: str | None = None, _metadata: Any = None, loss: Any = None,
                 loss_constructors: Any = None) -> None:
        super().__init__()
        self._setDefault(optimizer=None, loss=None, loss_constructors=None, input_shapes=None)
        kwargs = self._input_kwargs
        if label_columns:
            self.setOutputCols([col + "__output" for col in label_columns])
        self.setParams(**kwargs)

    def _predict_spec(self) -> dict[str, Any]:
        return {"framework": "torch", "model": self.getOrDefault("model"),
                "input_shapes": self.getOrDefault("input_shapes")}

    def _output_sizes(self) -> list[int]:
        import torch

        model = self.getOrDefault("model")
        model.eval()
        zeros = [torch.zeros([1, *[int(d) for d in list(s)[1:]]])
                 for s in self.getOrDefault("input_shapes")]
        with torch.no_grad():
            out = model(*zeros)
        outs = out if isinstance(out, (list, tuple)) else [out]
        return [int(o.numel()) for o in outs]

    def _model_to_bytes(self) -> bytes:
        from pyspark import cloudpickle

        return bytes(cloudpickle.dumps(self.getOrDefault("model")))

    @classmethod
    def _model_from_bytes(cls, data: bytes, params: dict[str, Any]) -> Any:
        import pickle

        return pickle.loads(data)


install(TorchEstimator, [
    ("input_shapes", "input layer shapes", None, None),
    ("loss_constructors", "functions that construct the loss", None, None),
    ("train_minibatch_fn", "accepted; the training step is hora's", None, None)])
install(TorchModel, [
    ("optimizer", "the trained optimizer", None, None),
    ("input_shapes", "input layer shapes", None, None),
    ("loss", "loss", None, None),
    ("loss_constructors", "functions that construct the loss", None, None)])

__all__ = ["TorchEstimator", "TorchModel"]
