"""The driver side of an Estimator's data: check the DataFrame's columns, write the training
(and validation) rows as Parquet in the store, describe them for the ranks.

A column may be a number (byte ... double, boolean), a Spark ML ``Vector`` (dense or sparse;
written as an array of float32) or an array of numbers, of one length in every row. Anything
else — or a column that is not there, a null in it, arrays of varying length — is refused
before training starts, naming the column.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from hora._util.log import get_logger
from hora.spark.common.store import AbstractFilesystemStore

log = get_logger(__name__)

_SCALARS = {"ByteType": "int8", "ShortType": "int16", "IntegerType": "int32",
            "LongType": "int64", "FloatType": "float32", "DoubleType": "float64",
            "BooleanType": "bool"}
_HINT = ("HINT: the estimators take columns of numbers, Spark ML Vectors (e.g. from a "
         "VectorAssembler) or arrays of numbers; convert the column first (e.g. "
         "col(...).cast('double')).")


@dataclass
class DatasetInfo:
    """What :func:`prepare_data` wrote, for the driver and the ranks."""
    idx: int
    train_data_path: str
    val_data_path: str | None
    train_rows: int
    val_rows: int
    metadata: dict[str, dict[str, Any]] = field(default_factory=dict)


def column_kind(name: str, data_type: Any, role: str) -> dict[str, Any]:
    """``{'kind': 'scalar'|'vector'|'array', 'dtype': ..., 'spark_data_type': ...}`` of one
    column. Raises TypeError naming the column when the estimators cannot take its type."""
    type_name = type(data_type).__name__
    if type_name in _SCALARS:
        return {"kind": "scalar", "dtype": _SCALARS[type_name],
                "spark_data_type": data_type.simpleString()}
    if type_name == "VectorUDT":
        return {"kind": "vector", "dtype": "float32", "spark_data_type": "vector"}
    if type_name == "ArrayType":
        element = type(data_type.elementType).__name__
        if element in _SCALARS:
            return {"kind": "array", "dtype": "float32" if element == "DoubleType"
                    else _SCALARS[element], "spark_data_type": data_type.simpleString()}
    raise TypeError(f"{role} column {name!r} has type {data_type.simpleString()}, which the "
                    f"estimators cannot train on. {_HINT}")


def check_validation(validation: Any, columns: list[str]) -> None:
    """Horovod's rule: a float split in [0, 1) or the name of a column of the DataFrame."""
    if validation is None or isinstance(validation, bool):
        if validation:
            raise TypeError("validation must be a float split in [0, 1) or a column name, "
                            "not True")
        return
    if isinstance(validation, (int, float)):
        if not 0 <= float(validation) < 1:
            raise ValueError(f"validation split must be in [0, 1), not {validation}")
    elif isinstance(validation, str):
        if validation not in columns:
            raise ValueError(f"validation column {validation!r} not found in the DataFrame "
                             f"(its columns: {columns})")
    else:
        raise TypeError("validation must be a float split in [0, 1) or a column name, not "
                        f"{type(validation).__name__}")


def describe_columns(df: Any, feature_cols: list[str], label_cols: list[str],
                     sample_weight_col: str | None, validation: Any
                     ) -> dict[str, dict[str, Any]]:
    """Check that the columns exist and have types the estimators take; their metadata.

    Raises:
        ValueError: a column is missing (the message lists the DataFrame's columns), or
            ``feature_cols`` / ``label_cols`` is empty.
        TypeError: a column's type cannot be trained on.
    """
    if not feature_cols:
        raise ValueError("feature_cols must name at least one column")
    if not label_cols:
        raise ValueError("label_cols must name at least one column")
    fields = {f.name: f.dataType for f in df.schema.fields}
    roles = [("Feature", feature_cols), ("Label", label_cols),
             ("Sample weight", [sample_weight_col] if sample_weight_col else [])]
    for role, cols in roles:
        missing = [c for c in cols if c not in fields]
        if missing:
            raise ValueError(f"{role} columns {missing} not found in the DataFrame (its "
                             f"columns: {sorted(fields)})")
    check_validation(validation, list(fields))
    metadata = {}
    for role, cols in roles:
        for col in cols:
            metadata[col] = column_kind(col, fields[col], role)
    if isinstance(validation, str):
        kind = column_kind(validation, fields[validation], "Validation")
        if kind["kind"] != "scalar":
            raise TypeError(f"validation column {validation!r} must be boolean or 0/1, not "
                            f"{kind['spark_data_type']}")
    return metadata


def _prepared(df: Any, metadata: dict[str, dict[str, Any]], validation: Any) -> Any:
    """The DataFrame to write: the training columns, Vectors and double arrays as float32
    arrays (and the validation column, when there is one)."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, FloatType

    columns = []
    for col, meta in metadata.items():
        if meta["kind"] == "vector":
            columns.append(vector_to_array(F.col(col), "float32").alias(col))
        elif meta["kind"] == "array" and meta["dtype"] == "float32":
            columns.append(F.col(col).cast(ArrayType(FloatType())).alias(col))
        else:
            columns.append(F.col(col))
    if isinstance(validation, str):
        columns.append(F.col(validation).cast("boolean").alias(validation))
    return df.select(*columns)


def _check_values(prepared: Any, metadata: dict[str, dict[str, Any]]) -> int:
    """One Spark job: the row count, nulls per column, the length range of array columns.
    Fills ``metadata[col]['shape']``; raises ValueError naming a column with nulls or of
    varying length."""
    from pyspark.sql import functions as F

    aggs = [F.count(F.lit(1)).alias("rows")]
    for i, (col, meta) in enumerate(metadata.items()):
        aggs.append(F.sum(F.col(col).isNull().cast("long")).alias(f"n{i}"))
        if meta["kind"] != "scalar":
            aggs += [F.min(F.size(col)).alias(f"lo{i}"), F.max(F.size(col)).alias(f"hi{i}")]
    row = prepared.agg(*aggs).collect()[0].asDict()
    for i, (col, meta) in enumerate(metadata.items()):
        if row[f"n{i}"]:
            raise ValueError(f"column {col!r} has {row[f'n{i}']} null values; the estimators "
                             "need a value in every row (drop or fill them first)")
        if meta["kind"] == "scalar":
            meta["shape"] = 1
            continue
        lo, hi = row[f"lo{i}"], row[f"hi{i}"]
        if lo != hi:
            raise ValueError(f"column {col!r} holds arrays of lengths {lo} to {hi}; every row "
                             "must have the same length")
        meta["shape"] = int(lo or 0)
    return int(row["rows"])


def parquet_rows(store: AbstractFilesystemStore, path: str) -> int:
    """Rows of the Parquet dataset at ``path`` (from the files' footers)."""
    import pyarrow.parquet as pq

    total = 0
    for name in store.parquet_files(path):
        with store.fs.open(name, "rb") as f:
            total += pq.ParquetFile(f).metadata.num_rows
    return total


_cache_lock = threading.Lock()
_cache: dict[tuple[Any, ...], DatasetInfo] = {}


def _free_index(store: AbstractFilesystemStore) -> int:
    taken = {info.idx for key, info in _cache.items() if key[0] == store.prefix_path}
    idx = 0
    while idx in taken or store.exists(store.get_train_data_path(idx)) or \
            store.exists(store.get_val_data_path(idx)):
        idx += 1
    return idx


def prepare_data(num_proc: int, store: AbstractFilesystemStore, df: Any,
                 feature_columns: list[str], label_columns: list[str], validation: Any = None,
                 sample_weight_col: str | None = None, partitions_per_process: int = 10,
                 random_seed: int | None = None, verbose: int = 1) -> DatasetInfo:
    """Check ``df``'s columns and write its rows as Parquet in ``store`` (training rows, and
    validation rows when ``validation`` is a split or a column); reuse what an earlier call in
    this process wrote for the same DataFrame and arguments."""
    metadata = describe_columns(df, feature_columns, label_columns, sample_weight_col,
                                validation)
    parts = max(1, num_proc * max(1, partitions_per_process))
    key = (store.prefix_path, df.semanticHash(), tuple(feature_columns), tuple(label_columns),
           sample_weight_col, validation, parts, random_seed)
    with _cache_lock:
        info = _cache.get(key)
        if info is not None and store.is_parquet_dataset(info.train_data_path):
            log.info("Estimator: reusing the prepared data %s", info.train_data_path)
            return info
        idx = _free_index(store)
        prepared = _prepared(df, metadata, validation)
        rows = _check_values(prepared, metadata)
        if rows < num_proc:
            raise ValueError(f"the DataFrame has {rows} rows, fewer than the {num_proc} "
                             "processes that would train on it")
        train_df, val_df = prepared, None
        if isinstance(validation, str):
            from pyspark.sql import functions as F

            val_df = prepared.filter(F.col(validation)).drop(validation)
            train_df = prepared.filter(~F.col(validation)).drop(validation)
        elif validation:
            train_df, val_df = prepared.randomSplit([1.0 - float(validation), float(validation)],
                                                    seed=random_seed or 0)
        train_path = store.get_train_data_path(idx)
        val_path = store.get_val_data_path(idx) if val_df is not None else None
        if verbose:
            log.info("Estimator: writing %d rows as Parquet to %s%s", rows, train_path,
                     f" and {val_path}" if val_path else "")
        train_df.repartition(parts).write.mode("overwrite").parquet(train_path)
        if val_df is not None and val_path is not None:
            val_df.repartition(max(1, min(parts, num_proc * 2))).write.mode("overwrite") \
                .parquet(val_path)
        info = DatasetInfo(idx, train_path, val_path, parquet_rows(store, train_path),
                           parquet_rows(store, val_path) if val_path else 0, metadata)
        if info.train_rows < num_proc:
            raise ValueError(f"only {info.train_rows} training rows for {num_proc} processes")
        if val_path and info.val_rows == 0:
            raise ValueError(f"validation={validation!r} left no validation rows")
        _cache[key] = info
        return info


__all__ = ["DatasetInfo", "check_validation", "column_kind", "describe_columns",
           "parquet_rows", "prepare_data"]
