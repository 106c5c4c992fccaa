"""The Estimators' parameters, with Horovod's names (``horovod.spark.common.params``): Spark ML
``Param``s with a ``getX`` / ``setX`` pair each (``batch_size`` -> ``getBatchSize`` /
``setBatchSize``), so that ``copy()``, ``extractParamMap()`` and Pipelines treat them as
Spark's own.
"""

from __future__ import annotations

from typing import Any

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasOutputCols

_ESTIMATOR_PARAMS: list[tuple[str, str, Any, Any]] = [
    # (name, doc, type converter, default)
    ("num_proc", "number of processes (ranks)", None, None),
    ("backend", "Backend that runs the ranks (default: SparkBackend(num_proc))", None, None),
    ("store", "Store for intermediate data, checkpoints and logs", None, None),
    ("model", "the model to train", None, None),
    ("optimizer", "the optimizer", None, None),
    ("loss", "loss, or a list of losses (one per label column)", None, None),
    ("loss_weights", "weight of each loss", None, None),
    ("metrics", "metrics to record per epoch", None, []),
    ("sample_weight_col", "column of sample weights", TypeConverters.toString, None),
    ("feature_cols", "feature column names", TypeConverters.toListString, None),
    ("label_cols", "label column names", TypeConverters.toListString, None),
    ("validation", "validation split (float in [0, 1)) or validation column name (str)",
     None, None),
    ("callbacks", "callbacks", None, []),
    ("batch_size", "batch size (rows per rank per step)", TypeConverters.toInt, 32),
    ("val_batch_size", "validation batch size (default batch_size)", None, None),
    ("epochs", "epochs", TypeConverters.toInt, 1),
    ("train_steps_per_epoch", "training steps (batches) per epoch", None, None),
    ("validation_steps_per_epoch", "validation steps per epoch", None, None),
    ("verbose", "verbosity (0 silent, 1 per-epoch lines, 2 more)", TypeConverters.toInt, 1),
    ("random_seed", "random seed for the frameworks and the shuffling", None, None),
    ("shuffle", "shuffle the training rows", TypeConverters.toBoolean, True),
    ("shuffle_buffer_size", "(deprecated in Horovod) accepted; rows are shuffled per row group",
     None, None),
    ("partitions_per_process", "Parquet partitions written per process",
     TypeConverters.toInt, 10),
    ("run_id", "ID of the run; an existing run resumes from its last checkpoint",
     None, None),
    ("gradient_compression", "hvd.Compression for the DistributedOptimizer", None, None),
    ("compress_sparse_cols", "accepted; sparse vectors are stored dense",
     TypeConverters.toBoolean, False),
    ("transformation_fn", "function applied to every batch (a dict of column -> array)",
     None, None),
    ("train_reader_num_workers", "accepted; the reader is one thread per rank", None, 2),
    ("val_reader_num_workers", "accepted; the reader is one thread per rank", None, 2),
    ("reader_pool_type", "accepted; the reader is one thread per rank", None, "thread"),
    ("label_shapes", "shape of each label column", None, None),
    ("inmemory_cache_all", "keep each rank's shard in memory after the first epoch",
     TypeConverters.toBoolean, False),
    ("use_gpu", "train on the GPU when the rank has one", TypeConverters.toBoolean, True),
    ("mp_start_method", "accepted; no reader processes are started", None, None),
    ("backward_passes_per_step", "backward passes (local gradient accumulations) per "
     "allreduce", TypeConverters.toInt, 1),
]

_MODEL_PARAMS: list[tuple[str, str, Any, Any]] = [
    ("history", "the metrics of every epoch", None, None),
    ("model", "the trained model", None, None),
    ("feature_columns", "feature column names", None, None),
    ("label_columns", "label column names", None, None),
    ("run_id", "ID of the run that trained the model", None, None),
    ("_metadata", "the training columns' metadata", None, None),
]


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.strip("_").split("_"))


def install(cls: type, table: list[tuple[str, str, Any, Any]]) -> None:
    """Give ``cls`` a Param and a get/set pair per row (kept where ``cls`` defines its own)."""
    for name, doc, converter, _ in table:
        kwargs = {"typeConverter": converter} if converter is not None else {}
        setattr(cls, name, Param(Params._dummy(), name, doc, **kwargs))
        getter, setter = "get" + _camel(name), "set" + _camel(name)
        if getter not in vars(cls):
            setattr(cls, getter, lambda self, _n=name: self.getOrDefault(_n))
        if setter not in vars(cls):
            setattr(cls, setter, lambda self, value, _n=name: self._set(**{_n: value}))


def defaults(table: list[tuple[str, str, Any, Any]]) -> dict[str, Any]:
    return {name: default for name, _, _, default in table}


class EstimatorParams(Params):
    """The parameters every hora Spark Estimator has (Horovod's ``EstimatorParams``)."""

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(**defaults(_ESTIMATOR_PARAMS))

    def setParams(self, **kwargs: Any) -> Any:  # noqa: N802 - Spark's name
        """Set parameters by name (``None`` values are skipped, as Horovod's
        ``keyword_only`` constructors do for unset arguments)."""
        return self._set(**{k: v for k, v in kwargs.items() if v is not None})

    def get(self, name: str) -> Any:
        """The value of parameter ``name`` (set or default)."""
        return self.getOrDefault(name)


class ModelParams(HasOutputCols):
    """The parameters of a fitted model (Horovod's ``ModelParams``)."""

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(**defaults(_MODEL_PARAMS))

    def setParams(self, **kwargs: Any) -> Any:  # noqa: N802 - Spark's name
        return self._set(**{k: v for k, v in kwargs.items() if v is not None})

    def get(self, name: str) -> Any:
        return self.getOrDefault(name)

    def setOutputCols(self, value: list[str]) -> Any:  # noqa: N802 - Horovod's name
        """Name the prediction columns, one per label column (default
        ``<label column>__output``); returns the model, as Horovod's does."""
        return self._set(outputCols=value)

    def _get_metadata(self) -> Any:
        return self.getOrDefault("_metadata")


install(EstimatorParams, _ESTIMATOR_PARAMS)
install(ModelParams, _MODEL_PARAMS)

__all__ = ["EstimatorParams", "ModelParams", "install"]
