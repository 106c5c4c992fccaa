"""Horovod's ``horovod.spark.common.store``: where an Estimator keeps its intermediate data
(the DataFrame written as Parquet) and its runs (checkpoints, logs).

``Store.create(path)`` picks the store from the path: ``hdfs://...`` -> :class:`HDFSStore`
(pyarrow's ``HadoopFileSystem``: needs libhdfs and Hadoop's ``CLASSPATH`` on every machine);
``/dbfs/...`` or ``dbfs:/...`` on Databricks -> :class:`DBFSLocalStore` (Databricks' local file
API); anything else -> :class:`FilesystemStore` through fsspec (a local path, ``file://``, and
whatever protocol an installed fsspec implementation serves, e.g. ``s3://`` with s3fs).
:class:`LocalStore` is a :class:`FilesystemStore`, as in Horovod.

Layout under the store's prefix (Horovod's)::

    intermediate_train_data.<idx>/   Parquet, one prepared DataFrame per idx
    intermediate_val_data.<idx>/
    runs/<run_id>/checkpoint.*       the last epoch's checkpoint
    runs/<run_id>/checkpoint.json    its epoch and the history so far
    runs/<run_id>/logs/              the run's logs (history.json; Keras callbacks' logs)

A store is pickled to the ranks (fsspec and pyarrow file systems pickle); no Spark is needed to
use one. Creating a store checks that its prefix is writable (:class:`~hora.errors.ConfigError`
naming the path otherwise), so a bad path fails before any Spark job.
"""

from __future__ import annotations

import os
import posixpath
import re
import secrets
from typing import Any

from hora._util.log import get_logger
from hora.errors import ConfigError

log = get_logger(__name__)


def is_databricks() -> bool:
    """True on a Databricks runtime (Horovod's test: its version variable is set)."""
    return "DATABRICKS_RUNTIME_VERSION" in os.environ


class Store:
    """Storage for intermediate data (materialized DataFrames) and run artifacts (checkpoints,
    logs): Horovod's interface. Use :meth:`create`."""

    def get_train_data_path(self, idx: int | None = None) -> str:
        """The training Parquet dataset's path (``.idx`` appended when given)."""
        raise NotImplementedError

    def get_val_data_path(self, idx: int | None = None) -> str:
        """The validation Parquet dataset's path."""
        raise NotImplementedError

    def get_test_data_path(self, idx: int | None = None) -> str:
        """A test dataset's path (unused by the estimators; Horovod's layout)."""
        raise NotImplementedError

    def saving_runs(self) -> bool:
        """True if runs (checkpoints, logs) are saved."""
        raise NotImplementedError

    def get_runs_path(self) -> str:
        raise NotImplementedError

    def get_run_path(self, run_id: str) -> str:
        raise NotImplementedError

    def get_checkpoint_path(self, run_id: str) -> str | None:
        """The directory of the run's checkpoint files (None when runs are not saved)."""
        raise NotImplementedError

    def get_logs_path(self, run_id: str) -> str | None:
        raise NotImplementedError

    def get_checkpoint_filename(self) -> str:
        raise NotImplementedError

    def get_logs_subdir(self) -> str:
        return "logs"

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def read(self, path: str) -> bytes:
        raise NotImplementedError

    def write(self, path: str, data: bytes) -> None:
        raise NotImplementedError

    def write_text(self, path: str, text: str) -> None:
        self.write(path, text.encode())

    @staticmethod
    def create(prefix_path: str, *args: Any, **kwargs: Any) -> Store:
        """The store for ``prefix_path`` (see the module's doc)."""
        if HDFSStore.matches(prefix_path):
            return HDFSStore(prefix_path, *args, **kwargs)
        if is_databricks() and DBFSLocalStore.matches_dbfs(prefix_path):
            return DBFSLocalStore(prefix_path, *args, **kwargs)
        return FilesystemStore(prefix_path, *args, **kwargs)


class AbstractFilesystemStore(Store):
    """A store on one (fsspec-compatible) file system: paths, reads, writes.

    Args:
        prefix_path: the store's root.
        train_path, val_path, test_path, runs_path: other places for those (default: under
            the prefix).
        save_runs: False keeps no checkpoints or logs.
        storage_options: options for the file system (fsspec's ``storage_options``).
        checkpoint_filename: the checkpoint's base name (default ``checkpoint``; each framework
            adds its suffix).
    """

    def __init__(self, prefix_path: str, train_path: str | None = None,
                 val_path: str | None = None, test_path: str | None = None,
                 runs_path: str | None = None, save_runs: bool = True,
                 storage_options: dict[str, Any] | None = None,
                 checkpoint_filename: str | None = None, **kwargs: Any) -> None:
        if kwargs:
            log.info("Store: ignored arguments %s", sorted(kwargs))
        self.storage_options = dict(storage_options or {})
        self.prefix_path = self.get_full_path(prefix_path)
        self._train_path = self._default(train_path, "intermediate_train_data")
        self._val_path = self._default(val_path, "intermediate_val_data")
        self._test_path = self._default(test_path, "intermediate_test_data")
        self._runs_path = self._default(runs_path, "runs")
        self._save_runs = save_runs
        self.checkpoint_filename = checkpoint_filename or "checkpoint"
        self._check_writable()

    # ---- paths --------------------------------------------------------------------------------
    @property
    def fs(self) -> Any:
        """The fsspec file system (paths given to it are :meth:`get_localized_path`'s)."""
        raise NotImplementedError

    def get_full_path(self, path: str) -> str:
        """``path`` with its file system's protocol: what Spark reads and writes."""
        raise NotImplementedError

    def get_localized_path(self, path: str) -> str:
        """``path`` as the file system (:attr:`fs`) names it: without the protocol."""
        raise NotImplementedError

    def _default(self, path: str | None, key: str) -> str:
        return self.get_full_path(path) if path is not None else \
            posixpath.join(self.prefix_path, key)

    def get_train_data_path(self, idx: int | None = None) -> str:
        return self._train_path if idx is None else f"{self._train_path}.{idx}"

    def get_val_data_path(self, idx: int | None = None) -> str:
        return self._val_path if idx is None else f"{self._val_path}.{idx}"

    def get_test_data_path(self, idx: int | None = None) -> str:
        return self._test_path if idx is None else f"{self._test_path}.{idx}"

    def saving_runs(self) -> bool:
        return self._save_runs

    def get_runs_path(self) -> str:
        return self._runs_path

    def get_run_path(self, run_id: str) -> str:
        return posixpath.join(self._runs_path, run_id)

    def get_checkpoint_path(self, run_id: str) -> str | None:
        return self.get_run_path(run_id) if self._save_runs else None

    def get_logs_path(self, run_id: str) -> str | None:
        return posixpath.join(self.get_run_path(run_id), self.get_logs_subdir()) \
            if self._save_runs else None

    def get_checkpoint_filename(self) -> str:
        return self.checkpoint_filename

    # ---- I/O ----------------------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self.get_localized_path(path)))

    def read(self, path: str) -> bytes:
        with self.fs.open(self.get_localized_path(path), "rb") as f:
            return bytes(f.read())

    def write(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` (its directory is created), replacing it whole: a reader
        never sees half a file where the file system can rename."""
        local = self.get_localized_path(path)
        self.fs.makedirs(posixpath.dirname(local), exist_ok=True)
        partial = f"{local}.partial-{secrets.token_hex(4)}"
        with self.fs.open(partial, "wb") as f:
            f.write(data)
        try:
            self.fs.mv(partial, local)
        except OSError:
            self.fs.rm(partial)
            raise

    def remove(self, path: str) -> None:
        """Remove ``path`` (recursively) if it exists."""
        local = self.get_localized_path(path)
        if self.fs.exists(local):
            self.fs.rm(local, recursive=True)

    def is_parquet_dataset(self, path: str) -> bool:
        """True if ``path`` holds Parquet files."""
        return bool(self.parquet_files(path))

    def parquet_files(self, path: str) -> list[str]:
        """The Parquet files of the dataset at ``path`` (localized paths, sorted)."""
        local = self.get_localized_path(path)
        if not self.fs.exists(local):
            return []
        return sorted(p for p in self.fs.find(local) if p.endswith(".parquet")
                      and not posixpath.basename(p).startswith(("_", ".")))

    def _check_writable(self) -> None:
        probe = posixpath.join(self.get_localized_path(self.prefix_path),
                               f".hora-write-test-{secrets.token_hex(4)}")
        try:
            self.fs.makedirs(posixpath.dirname(probe), exist_ok=True)
            with self.fs.open(probe, "wb") as f:
                f.write(b"ok")
            self.fs.rm(probe)
        except Exception as exc:  # noqa: BLE001 (any file system's error means the same here)
            raise ConfigError(
                f"{type(self).__name__}: cannot write to the store's path {self.prefix_path}: "
                f"{type(exc).__name__}: {exc}. HINT: the driver and every executor must be able "
                "to write there (prepared data, checkpoints and logs go there); pick a "
                "writable directory, e.g. Store.create('/tmp/hora_store'), or one on a file "
                "system every machine shares (hdfs://..., /dbfs/...).") from exc


class FilesystemStore(AbstractFilesystemStore):
    """A store on any file system fsspec serves (a local path, ``file://``, ``s3://`` with s3fs,
    ``gs://`` with gcsfs, ...)."""

    def __init__(self, prefix_path: str, *args: Any, **kwargs: Any) -> None:
        from fsspec.core import url_to_fs

        options = dict(kwargs.get("storage_options") or {})
        try:
            self._fs, _ = url_to_fs(prefix_path, **options)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"Store: no file system serves {prefix_path!r}: {exc}") from exc
        super().__init__(prefix_path, *args, **kwargs)

    @property
    def fs(self) -> Any:
        return self._fs

    def get_full_path(self, path: str) -> str:
        if "://" in path:
            return path
        if "file" in _protocols(self._fs):
            return "file://" + os.path.abspath(path)
        return str(self._fs.unstrip_protocol(path))

    def get_localized_path(self, path: str) -> str:
        return str(self._fs._strip_protocol(path))

    def get_filesystem(self) -> Any:
        return self._fs


class LocalStore(FilesystemStore):
    """The local file system as a store (Horovod's name; a :class:`FilesystemStore`)."""


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


class HDFSStore(AbstractFilesystemStore):
    """HDFS as a store, through pyarrow's ``HadoopFileSystem`` (libhdfs over JNI).

    ``prefix_path``: ``hdfs://namenode:8020/user/me/hora``, ``hdfs:///user/me/hora`` or
    ``/user/me/hora``. pyarrow needs ``libhdfs.so`` (``ARROW_LIBHDFS_DIR`` or ``HADOOP_HOME``),
    Java, and Hadoop's jars on ``CLASSPATH`` (``hadoop classpath --glob``) on the driver and on
    every executor; without them the store cannot be created and the error says so.
    """

    FS_PREFIX = "hdfs://"
    URL_PATTERN = re.compile(r"^(?:(hdfs://))?(?:([^/:]+))?(?::([0-9]+))?(/.*)?$")

    def __init__(self, prefix_path: str, host: str | None = None, port: int | None = None,
                 user: str | None = None, kerb_ticket: str | None = None,
                 driver: str = "libhdfs", extra_conf: dict[str, str] | None = None,
                 *args: Any, **kwargs: Any) -> None:
        match = self.URL_PATTERN.match(prefix_path)
        if match is None or not match.group(4):
            raise ConfigError(f"HDFSStore: cannot read a path from {prefix_path!r} (expected "
                              "hdfs://host:port/path, hdfs:///path or /path)")
        url_host, url_port = match.group(2), match.group(3)
        self._url_prefix = prefix_path[:match.start(4)] if match.group(1) else self.FS_PREFIX
        self._hdfs_kwargs = dict(host=host or url_host or "default",
                                 port=int(port or url_port or 0), user=user,
                                 kerb_ticket=kerb_ticket, extra_conf=extra_conf)
        self._fs = self._connect()
        super().__init__(prefix_path, *args, **kwargs)

    def _connect(self) -> Any:
        try:
            from fsspec.implementations.arrow import ArrowFSWrapper
            from pyarrow import fs as pafs

            return ArrowFSWrapper(pafs.HadoopFileSystem(**self._hdfs_kwargs))
        except ImportError as exc:
            raise ConfigError("HDFSStore needs pyarrow and fsspec: pip install pyarrow fsspec"
                              ) from exc
        except OSError as exc:
            raise ConfigError(
                f"HDFSStore: cannot connect to HDFS ({self._hdfs_kwargs['host']}:"
                f"{self._hdfs_kwargs['port']}): {exc}. HINT: pyarrow needs libhdfs.so "
                "(ARROW_LIBHDFS_DIR or HADOOP_HOME), a Java runtime (JAVA_HOME) and Hadoop's "
                "jars on CLASSPATH (`export CLASSPATH=$(hadoop classpath --glob)`) on the "
                "driver and every executor.") from exc

    @property
    def fs(self) -> Any:
        return self._fs

    def get_full_path(self, path: str) -> str:
        return path if path.startswith(self.FS_PREFIX) else self._url_prefix + path

    def get_localized_path(self, path: str) -> str:
        return path[len(self._url_prefix):] if path.startswith(self._url_prefix) else path

    @classmethod
    def matches(cls, path: str) -> bool:
        return path.startswith(cls.FS_PREFIX)


class DBFSLocalStore(FilesystemStore):
    """Databricks File System through its local file API (``/dbfs/...``): a local-file store
    whose Spark paths are ``file:///dbfs/...``. Accepts ``/dbfs/...``, ``dbfs:/...``,
    ``file:/dbfs/...`` and ``file:///dbfs/...``."""

    def __init__(self, prefix_path: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(self.normalize_path(prefix_path), *args, **kwargs)

    @classmethod
    def matches_dbfs(cls, path: str) -> bool:
        return (path.startswith("dbfs:/") and not path.startswith("dbfs://")) or \
            path.startswith(("/dbfs/", "file:///dbfs/", "file:/dbfs/"))

    @staticmethod
    def normalize_path(path: str) -> str:
        """The ``/dbfs/...`` form of ``path``."""
        if path.startswith("dbfs:/") and not path.startswith("dbfs://"):
            return "/dbfs" + path[len("dbfs:"):]
        for prefix in ("file://", "file:"):
            if path.startswith(prefix + "/dbfs/"):
                return path[len(prefix):]
        if path.startswith("/dbfs/"):
            return path
        raise ConfigError(f"DBFSLocalStore: {path!r} is not a DBFS path: use /dbfs/..., "
                          "dbfs:/..., file:/dbfs/... or file:///dbfs/...")

    def get_localized_path(self, path: str) -> str:
        return super().get_localized_path(self.normalize_path(path)
                                          if self.matches_dbfs(path) else path)


__all__ = ["AbstractFilesystemStore", "DBFSLocalStore", "FilesystemStore", "HDFSStore",
           "LocalStore", "Store", "is_databricks"]
