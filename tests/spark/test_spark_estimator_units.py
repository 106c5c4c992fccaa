"""The Spark Estimators' pieces without a JVM: stores, the Parquet reader's sharding, the column
checks, the parameters. Skipped without pyspark or pyarrow (no torch, no Keras here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pyspark", reason="pyspark is not installed (pip install pyspark)")
pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install pyarrow)")
import pyarrow.parquet as pq  # noqa: E402 (after the skips)
from pyspark.ml.linalg import VectorUDT  # noqa: E402
from pyspark.sql import types as T  # noqa: E402

from hora.errors import ConfigError  # noqa: E402
from hora.spark.common import data  # noqa: E402
from hora.spark.common.estimator import output_kind  # noqa: E402
from hora.spark.common.reader import ShardReader, steps  # noqa: E402
from hora.spark.common.store import (  # noqa: E402
    AbstractFilesystemStore,
    DBFSLocalStore,
    FilesystemStore,
    HDFSStore,
    LocalStore,
    Store,
)

pytestmark = pytest.mark.timeout(60)


def test_create_gives_a_filesystem_store_with_horovods_layout(tmp_path: Path) -> None:
    store = Store.create(str(tmp_path / "s"))
    assert isinstance(store, FilesystemStore)
    prefix = f"file://{tmp_path}/s"
    assert store.prefix_path == prefix
    assert store.get_train_data_path(3) == f"{prefix}/intermediate_train_data.3"
    assert store.get_val_data_path() == f"{prefix}/intermediate_val_data"
    assert store.get_checkpoint_path("r1") == f"{prefix}/runs/r1"
    assert store.get_logs_path("r1") == f"{prefix}/runs/r1/logs"
    store.write_text(store.get_run_path("r1") + "/a.txt", "hello")
    assert store.exists(f"{prefix}/runs/r1/a.txt")
    assert store.read(f"{tmp_path}/s/runs/r1/a.txt") == b"hello"
    assert [p.name for p in (tmp_path / "s" / "runs" / "r1").iterdir()] == ["a.txt"]
    assert isinstance(LocalStore(str(tmp_path / "t")), FilesystemStore)
    assert LocalStore(str(tmp_path / "t"), save_runs=False).get_checkpoint_path("r") is None


def test_a_store_path_that_is_not_writable_is_refused_with_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=f"cannot write to the store's path file://{blocker}/s"):
        Store.create(str(blocker / "s"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_a_read_only_directory_is_refused(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="HINT"):
            Store.create(str(tmp_path / "s"))
    finally:
        tmp_path.chmod(0o700)


def test_dbfs_paths_normalize_and_need_databricks_for_create(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    assert DBFSLocalStore.normalize_path("dbfs:/a/b") == "/dbfs/a/b"
    assert DBFSLocalStore.normalize_path("file:///dbfs/a") == "/dbfs/a"
    assert DBFSLocalStore.normalize_path("file:/dbfs/a") == "/dbfs/a"
    assert not DBFSLocalStore.matches_dbfs("dbfs://host/a")
    with pytest.raises(ConfigError, match="not a DBFS path"):
        DBFSLocalStore.normalize_path("/tmp/a")
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "15.4")
    monkeypatch.setattr(AbstractFilesystemStore, "_check_writable", lambda self: None)
    store = Store.create("dbfs:/ml/hora")  # nothing is written: there is no /dbfs here
    assert isinstance(store, DBFSLocalStore)
    assert store.get_train_data_path(0) == "file:///dbfs/ml/hora/intermediate_train_data.0"
    assert store.get_localized_path("dbfs:/ml/hora/runs") == "/dbfs/ml/hora/runs"


def test_hdfs_without_libhdfs_says_what_is_missing() -> None:
    with pytest.raises(ConfigError, match="libhdfs"):
        Store.create("hdfs://namenode:8020/user/me/hora")
    assert HDFSStore.matches("hdfs:///a") and not HDFSStore.matches("/a")


def _write_dataset(root: Path, files: int, rows_per_file: int) -> None:
    root.mkdir(parents=True)
    n = 0
    for i in range(files):
        ids = np.arange(n, n + rows_per_file)
        n += rows_per_file
        table = pa.table({"id": pa.array(ids, pa.int64()),
                          "x": pa.array([[float(v), float(-v)] for v in ids],
                                        pa.list_(pa.float32()))})
        pq.write_table(table, root / f"part-{i:05d}.parquet")
    (root / "_SUCCESS").write_text("")


META = {"id": {"kind": "scalar", "shape": 1}, "x": {"kind": "array", "shape": 2}}


@pytest.mark.parametrize("files", [6, 1])
def test_ranks_read_disjoint_shards_that_cover_the_dataset(tmp_path: Path, files: int) -> None:
    store = Store.create(str(tmp_path / "s"))
    _write_dataset(tmp_path / "s" / "d", files, 60 // files)
    seen = []
    for rank in range(3):
        reader = ShardReader(store, store.get_full_path(str(tmp_path / "s" / "d")),
                             ["id", "x"], META, rank, 3, batch_size=4, shuffle=False)
        rows = reader.rows()
        batches = reader.batches()
        ids = np.concatenate([next(batches)["id"] for _ in range(rows // 4)])
        seen.append(ids)
        reader.close()
    assert sorted(np.concatenate(seen).tolist()) == list(range(60))
    batch = next(ShardReader(store, str(tmp_path / "s" / "d"), ["id", "x"], META, 0, 3,
                             batch_size=5, shuffle=False).batches())
    assert batch["x"].shape == (5, 2) and batch["x"].dtype == np.float32
    assert np.array_equal(batch["x"][:, 0], batch["id"].astype(np.float32))


def test_shuffling_permutes_per_epoch_and_the_stream_never_ends(tmp_path: Path) -> None:
    store = Store.create(str(tmp_path / "s"))
    _write_dataset(tmp_path / "s" / "d", 4, 10)
    reader = ShardReader(store, str(tmp_path / "s" / "d"), ["id"], META, 0, 1, batch_size=8,
                         shuffle=True, seed=3)
    it = reader.batches()
    ids = np.concatenate([next(it)["id"] for _ in range(15)])  # 120 rows: 3 epochs of 40
    epochs = [ids[i * 40:(i + 1) * 40] for i in range(3)]
    assert all(sorted(e.tolist()) == list(range(40)) for e in epochs)
    assert epochs[0].tolist() != list(range(40)) and epochs[0].tolist() != epochs[1].tolist()
    assert steps(40, 8, 1) == 5 and steps(41, 8, 2) == 3 and steps(1, 32, 4) == 1


def test_columns_are_checked_by_name_and_type() -> None:
    schema = T.StructType([T.StructField("v", VectorUDT()), T.StructField("a", T.ArrayType(
        T.DoubleType())), T.StructField("y", T.LongType()), T.StructField("s", T.StringType()),
        T.StructField("n", T.ArrayType(T.ArrayType(T.FloatType())))])

    class Frame:
        columns = [f.name for f in schema.fields]

        def __init__(self) -> None:
            self.schema = schema

    df: Any = Frame()
    meta = data.describe_columns(df, ["v", "a"], ["y"], None, 0.2)
    assert meta["v"]["kind"] == "vector" and meta["a"]["dtype"] == "float32"
    assert meta["y"] == {"kind": "scalar", "dtype": "int64", "spark_data_type": "bigint"}
    with pytest.raises(ValueError, match=r"Label columns \['label'\] not found.*'v'"):
        data.describe_columns(df, ["v"], ["label"], None, None)
    with pytest.raises(TypeError, match="Feature column 's' has type string"):
        data.describe_columns(df, ["s"], ["y"], None, None)
    with pytest.raises(TypeError, match="'n' has type array<array<float>>"):
        data.describe_columns(df, ["n"], ["y"], None, None)
    with pytest.raises(ValueError, match="validation split must be in"):
        data.describe_columns(df, ["v"], ["y"], None, 1.5)
    with pytest.raises(ValueError, match="validation column 'val' not found"):
        data.describe_columns(df, ["v"], ["y"], None, "val")
    with pytest.raises(ValueError, match="feature_cols must name"):
        data.describe_columns(df, [], ["y"], None, None)


def test_a_prediction_column_takes_the_labels_type_or_a_vector() -> None:
    assert output_kind(10, {"kind": "scalar", "dtype": "float64"})[0] == "vector"
    assert output_kind(1, {"kind": "scalar", "dtype": "float64"}) == ("float", T.DoubleType())
    assert output_kind(1, {"kind": "scalar", "dtype": "int32"}) == ("int", T.IntegerType())
    assert output_kind(1, {"kind": "array", "dtype": "float32"})[0] == "vector"


def test_estimator_params_have_horovods_names_and_defaults() -> None:
    from hora.spark.common.params import EstimatorParams

    params = EstimatorParams()
    assert params.getBatchSize() == 32 and params.getEpochs() == 1  # type: ignore[attr-defined]
    assert params.getShuffle() is True and params.getPartitionsPerProcess() == 10  # type: ignore
    params.setValidation(0.1).setRunId("r")  # type: ignore[attr-defined]
    assert params.getValidation() == 0.1 and params.getRunId() == "r"  # type: ignore


def test_importing_the_estimators_common_parts_loads_no_framework() -> None:
    code = ("import sys, hora.spark.common.estimator, hora.spark.common.store; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'tensorflow', 'keras', 'hora') and (m.startswith(('torch', 'tensorflow', "
            "'keras')) or m.startswith(('hora.core', 'hora.torch', 'hora.keras')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == "[]", out
