"""The rank side of an Estimator's data: each rank reads its own shard of the Parquet dataset
in the store, as numpy batches, with pyarrow.

Sharding is Petastorm's: the dataset's row groups (every Parquet file written by Spark has one
or more) are listed in a fixed order and rank ``r`` of ``n`` reads row groups ``r, r+n, ...``;
when there are fewer row groups than ranks, every rank reads all of them and keeps rows
``r, r+n, ...``. The stream never ends (it starts the shard again): the training loop takes a
fixed number of steps per epoch on every rank, so that every rank makes the same number of
collective calls.

Shuffling (training): the order of the shard's row groups and the rows within each row group
are permuted, differently per epoch and per rank (seeded), and batches are cut from that
stream; rows mix within a row group, not across the whole shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

Batch = dict[str, np.ndarray]


class ShardReader:
    """Batches of rank ``rank``'s shard of the Parquet dataset at ``path`` in ``store``.

    Args:
        store: the Estimator's store (pickled to the rank).
        path: the dataset's path in the store.
        columns: the columns to read.
        metadata: per column ``kind`` ('scalar', 'vector' or 'array') and ``shape`` (flat
            length), from :func:`hora.spark.common.data.prepare_data`.
        rank, size: this rank and the number of ranks.
        batch_size: rows per batch.
        shuffle: permute row groups and rows (training); False reads in order.
        seed: base of the shuffling seed (rank and epoch are added).
        cache: keep the shard's rows in memory after the first pass (``inmemory_cache_all``).
    """

    def __init__(self, store: Any, path: str, columns: list[str],
                 metadata: dict[str, dict[str, Any]], rank: int, size: int, batch_size: int,
                 shuffle: bool = True, seed: int = 0, cache: bool = False) -> None:
        import pyarrow.parquet as pq

        self._store = store
        self._columns = list(columns)
        self._metadata = metadata
        self._batch_size = max(1, int(batch_size))
        self._shuffle = shuffle
        self._seed = seed + 7919 * rank
        self._cache: dict[int, Batch] | None = {} if cache else None
        self._files: dict[str, Any] = {}
        pieces = []
        for name in store.parquet_files(path):
            meta = self._open(name).metadata
            pieces += [(name, g) for g in range(meta.num_row_groups)
                       if meta.row_group(g).num_rows > 0]
        if not pieces:
            raise FileNotFoundError(f"no Parquet rows at {path} in the store")
        self._pq = pq
        if len(pieces) >= size:
            self._pieces = pieces[rank::size]
            self._stride: tuple[int, int] | None = None
        else:
            self._pieces = pieces
            self._stride = (rank, size)

    def _open(self, name: str) -> Any:
        import pyarrow.parquet as pq

        if name not in self._files:
            self._files[name] = pq.ParquetFile(self._store.fs.open(name, "rb"))
        return self._files[name]

    def _load(self, index: int) -> Batch:
        if self._cache is not None and index in self._cache:
            return self._cache[index]
        name, group = self._pieces[index]
        table = self._open(name).read_row_group(group, columns=self._columns)
        data = {col: self._column(col, table.column(col).combine_chunks())
                for col in self._columns}
        if self._stride is not None:
            start, step = self._stride
            data = {col: values[start::step] for col, values in data.items()}
        if self._cache is not None:
            self._cache[index] = data
        return data

    def _column(self, col: str, values: Any) -> np.ndarray:
        meta = self._metadata.get(col, {"kind": "scalar"})
        if meta["kind"] == "scalar":
            return np.asarray(values.to_numpy(zero_copy_only=False))
        flat = np.asarray(values.flatten().to_numpy(zero_copy_only=False))
        return flat.reshape(len(values), int(meta["shape"]))

    def rows(self) -> int:
        """Rows in this rank's shard."""
        total = 0
        for index in range(len(self._pieces)):
            name, group = self._pieces[index]
            n = self._open(name).metadata.row_group(group).num_rows
            if self._stride is not None:
                start, step = self._stride
                n = len(range(start, n, step))
            total += n
        return total

    def batches(self) -> Iterator[Batch]:
        """Batches of ``batch_size`` rows (dicts of column -> array), without end."""
        pending: Batch | None = None
        epoch = 0
        while True:
            rng = np.random.default_rng(self._seed + 104729 * epoch)
            order = rng.permutation(len(self._pieces)) if self._shuffle \
                else np.arange(len(self._pieces))
            for index in order:
                data = self._load(int(index))
                if self._shuffle:
                    perm = rng.permutation(len(next(iter(data.values()))))
                    data = {col: values[perm] for col, values in data.items()}
                if pending is not None:
                    data = {col: np.concatenate([pending[col], data[col]]) for col in data}
                n = len(next(iter(data.values())))
                start = 0
                while n - start >= self._batch_size:
                    stop = start + self._batch_size
                    yield {col: values[start:stop] for col, values in data.items()}
                    start = stop
                pending = {col: values[start:] for col, values in data.items()} \
                    if start < n else None
            epoch += 1

    def close(self) -> None:
        for f in self._files.values():
            try:
                f.close()
            except Exception:  # noqa: BLE001 (closing is best effort)
                pass
        self._files.clear()


def steps(rows: int, batch_size: int, size: int) -> int:
    """Steps per epoch so that the ranks together see every row once: ceil(rows / (batch_size
    * size)), at least 1."""
    return max(1, -(-rows // (max(1, batch_size) * max(1, size))))


__all__ = ["Batch", "ShardReader", "steps"]
