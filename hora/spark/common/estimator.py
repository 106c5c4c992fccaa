"""The framework-independent halves of the Spark Estimators (Horovod's
``horovod.spark.common.estimator``): :class:`HorovodEstimator` (fit: check and write the data,
find a checkpoint to resume from, run the ranks through the backend) and :class:`HorovodModel`
(the fitted Spark ML Transformer: ``transform()``, output columns, save / load).
"""

from __future__ import annotations

import functools
import json
import posixpath
import secrets
import time
from typing import Any, cast

from pyspark.ml import Estimator, Model
from pyspark.ml.util import MLReadable, MLReader, MLWritable, MLWriter

from hora._util.log import get_logger
from hora.spark.common import predict as predict_module
from hora.spark.common.backend import Backend, SparkBackend
from hora.spark.common.data import DatasetInfo, prepare_data
from hora.spark.common.params import EstimatorParams, ModelParams
from hora.spark.common.store import AbstractFilesystemStore, Store
from hora.spark.common.training import CHECKPOINT_META

log = get_logger(__name__)



class HorovodEstimator(Estimator, EstimatorParams):
    """Fits a model on a DataFrame with ``num_proc`` ranks; subclasses add the framework."""

    _input_kwargs: dict[str, Any]  # set by pyspark's keyword_only
    RUN_PREFIX = "run"
    CHECKPOINT_SUFFIX = ""

    def fit(self, dataset: Any, params: Any = None) -> Any:
        """Train on ``dataset`` (a Spark DataFrame); the fitted :class:`HorovodModel`."""
        return super().fit(dataset, params)

    def _fit(self, dataset: Any) -> Any:
        if self.getOrDefault("model") is None:
            raise ValueError(f"{type(self).__name__}: the model parameter is required")
        backend = self._get_or_create_backend()
        store = self._get_store()
        info = prepare_data(backend.num_processes(), store, dataset,
                            feature_columns=list(self.getOrDefault("feature_cols") or []),
                            label_columns=list(self.getOrDefault("label_cols") or []),
                            validation=self.getOrDefault("validation"),
                            sample_weight_col=self.getOrDefault("sample_weight_col"),
                            partitions_per_process=self.getOrDefault("partitions_per_process"),
                            random_seed=self.getOrDefault("random_seed"),
                            verbose=self.getOrDefault("verbose"))
        self._check_metadata_compatibility(info.metadata)
        run_id = self.getOrDefault("run_id") or (
            f"{self.RUN_PREFIX}_{time.strftime('%Y%m%d_%H%M%S')}_{secrets.token_hex(3)}")
        return self._fit_on_prepared_data(backend, store, info, str(run_id))

    def _check_metadata_compatibility(self, metadata: dict[str, dict[str, Any]]) -> None:
        """Subclasses check the model's inputs against the columns."""

    def _fit_on_prepared_data(self, backend: Backend, store: AbstractFilesystemStore,
                              info: DatasetInfo, run_id: str) -> Any:
        raise NotImplementedError

    def _get_or_create_backend(self) -> Backend:
        backend = self.getOrDefault("backend")
        num_proc = self.getOrDefault("num_proc")
        if backend is None:
            return SparkBackend(num_proc, verbose=self.getOrDefault("verbose"))
        if num_proc is not None:
            raise ValueError('At most one of parameters "backend" and "num_proc" may be '
                             "specified")
        return backend

    def _get_store(self) -> AbstractFilesystemStore:
        store = self.getOrDefault("store")
        if isinstance(store, str):
            store = Store.create(store)
        if store is None:
            raise ValueError(f"{type(self).__name__}: the store parameter is required, e.g. "
                             "store=Store.create('/tmp/hora_store') (from "
                             "hora.spark.common.store); prepared data and checkpoints go there")
        if not isinstance(store, AbstractFilesystemStore):
            raise TypeError(f"store must be a hora.spark.common.store.Store, not "
                            f"{type(store).__name__}")
        return store

    # ---- checkpoints --------------------------------------------------------------------------
    def _checkpoint_file(self, store: AbstractFilesystemStore, run_id: str) -> str | None:
        path = store.get_checkpoint_path(run_id)
        if path is None:
            return None
        return posixpath.join(path, store.get_checkpoint_filename() + self.CHECKPOINT_SUFFIX)

    def _load_checkpoint(self, store: AbstractFilesystemStore, run_id: str
                         ) -> tuple[bytes, dict[str, Any]] | None:
        """The run's last checkpoint and its ``checkpoint.json``, or None (a new run)."""
        path = self._checkpoint_file(store, run_id)
        if path is None or not store.exists(path):
            return None
        meta_path = posixpath.join(posixpath.dirname(path), CHECKPOINT_META)
        meta = json.loads(store.read(meta_path)) if store.exists(meta_path) else {}
        if self.getOrDefault("verbose"):
            log.info("%s: resuming run %s from its checkpoint %s (after epoch %s)",
                     type(self).__name__, run_id, path, meta.get("epoch", "?"))
        return store.read(path), meta


def output_kind(size: int, label_meta: dict[str, Any]) -> tuple[str, Any]:
    """How a prediction of ``size`` values per row goes in a column: ('vector' | 'float' |
    'int' | 'bool', its Spark type). One value per row takes the label column's scalar type
    (Horovod's rule); more make a Vector."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    if size != 1 or label_meta.get("kind") != "scalar":
        return "vector", VectorUDT()
    dtype = label_meta.get("dtype", "float64")
    if dtype == "bool":
        return "bool", T.BooleanType()
    if dtype.startswith("int"):
        return "int", {"int8": T.ByteType(), "int16": T.ShortType(), "int32": T.IntegerType(),
                       "int64": T.LongType()}[dtype]
    return "float", T.FloatType() if dtype == "float32" else T.DoubleType()


class _Writer(MLWriter):
    def __init__(self, instance: HorovodModel) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:  # noqa: N802 - Spark's name
        self.instance._save_to(path, overwrite=bool(self.shouldOverwrite))


class _Reader(MLReader):
    def __init__(self, cls: type[HorovodModel]) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> HorovodModel:
        return self.cls._load_from(path)


class HorovodModel(Model, ModelParams, MLWritable, MLReadable):
    """A fitted model as a Spark ML Transformer: ``transform(df)`` appends one prediction column
    per label column (``<label>__output`` unless :meth:`setOutputCols` names them)."""

    _input_kwargs: dict[str, Any]  # set by pyspark's keyword_only
    FRAMEWORK = ""

    def transform(self, dataset: Any, params: Any = None) -> Any:
        """``dataset`` with the prediction columns appended (computed in the executors)."""
        return super().transform(dataset, params)

    def _predict_spec(self) -> dict[str, Any]:
        """What :func:`hora.spark.common.predict.predict_partition` needs (framework-specific)."""
        raise NotImplementedError

    def _output_sizes(self) -> list[int]:
        """Values per row of each model output (run once on the driver on zeros)."""
        raise NotImplementedError

    def _transform(self, dataset: Any) -> Any:
        from pyspark import cloudpickle
        from pyspark.sql import SparkSession
        from pyspark.sql.types import StructField, StructType

        label_cols = list(self.getOrDefault("label_columns") or [])
        output_cols = list(self.getOutputCols())
        feature_cols = list(self.getOrDefault("feature_columns") or [])
        missing = [c for c in feature_cols if c not in dataset.columns]
        if missing:
            raise ValueError(f"Feature columns {missing} not found in the DataFrame to "
                             f"transform (its columns: {sorted(dataset.columns)})")
        clash = [c for c in output_cols if c in dataset.columns]
        if clash:
            raise ValueError(f"output columns {clash} already exist in the DataFrame; name "
                             "others with setOutputCols([...])")
        metadata = self._get_metadata() or {}
        sizes = self._output_sizes()
        if len(sizes) != len(output_cols):
            raise ValueError(f"the model has {len(sizes)} outputs but {len(output_cols)} output "
                             f"columns are set ({output_cols})")
        kinds, fields = [], []
        for name, size, label in zip(output_cols, sizes, label_cols):
            kind, spark_type = output_kind(size, metadata.get(label, {}))
            kinds.append(kind)
            fields.append(StructField(name, spark_type, nullable=True))
        spec = {**self._predict_spec(), "feature_cols": feature_cols, "output_kinds": kinds}
        # The executors need the framework, not hora: the partition function goes by value.
        cloudpickle.register_pickle_by_value(predict_module)
        run = functools.partial(predict_module.predict_partition, spec)
        schema = StructType([*dataset.schema.fields, *fields])
        session = SparkSession.getActiveSession() or dataset.sparkSession
        return session.createDataFrame(dataset.rdd.mapPartitions(run), schema=schema)

    # ---- save / load --------------------------------------------------------------------------
    def write(self) -> MLWriter:
        """Writer: ``model.write().overwrite().save(path)``; ``model.save(path)`` refuses an
        existing path."""
        return _Writer(self)

    @classmethod
    def read(cls) -> MLReader:
        return _Reader(cls)

    def _model_to_bytes(self) -> bytes:
        raise NotImplementedError

    @classmethod
    def _model_from_bytes(cls, data: bytes, params: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _save_to(self, path: str, overwrite: bool) -> None:
        from fsspec.core import url_to_fs
        from pyspark import cloudpickle

        fs, local = url_to_fs(path)
        if fs.exists(local):
            if not overwrite:
                raise FileExistsError(f"{path} already exists; use "
                                      "model.write().overwrite().save(path)")
            fs.rm(local, recursive=True)
        fs.makedirs(local, exist_ok=True)
        params = {p.name: v for p, v in self.extractParamMap().items()
                  if p.name not in ("model", "outputCols")}
        meta = {"class": f"{type(self).__module__}.{type(self).__qualname__}",
                "uid": self.uid, "framework": self.FRAMEWORK,
                "outputCols": list(self.getOutputCols()), "saved": time.time()}
        with fs.open(posixpath.join(local, "metadata.json"), "w") as f:
            f.write(json.dumps(meta))
        with fs.open(posixpath.join(local, "params.pkl"), "wb") as f:
            f.write(cloudpickle.dumps(params))
        with fs.open(posixpath.join(local, "model.bin"), "wb") as f:
            f.write(self._model_to_bytes())

    @classmethod
    def _load_from(cls, path: str) -> HorovodModel:
        import pickle

        from fsspec.core import url_to_fs

        fs, local = url_to_fs(path)
        with fs.open(posixpath.join(local, "metadata.json"), "r") as f:
            meta = json.loads(f.read())
        if meta.get("framework") != cls.FRAMEWORK:
            raise ValueError(f"{path} holds a {meta.get('class')}, not a {cls.__name__}")
        with fs.open(posixpath.join(local, "params.pkl"), "rb") as f:
            params = pickle.loads(f.read())
        with fs.open(posixpath.join(local, "model.bin"), "rb") as f:
            model = cls._model_from_bytes(f.read(), params)
        instance = cast(Any, cls)(model=model, **{k: v for k, v in params.items()
                                       if k in cls._init_names()})
        instance._resetUid(meta["uid"])
        instance.setOutputCols(meta["outputCols"])
        return instance

    @classmethod
    def _init_names(cls) -> set[str]:
        import inspect

        return set(inspect.signature(cls.__init__).parameters) - {"self"}


__all__ = ["CHECKPOINT_META", "HorovodEstimator", "HorovodModel", "output_kind"]
