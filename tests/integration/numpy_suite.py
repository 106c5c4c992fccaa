"""The framework-neutral collective suite through hora's numpy API (``import hora``): the
factory, and the rank side of the job (``python numpy_suite.py``). Imports no framework."""

from __future__ import annotations

from typing import Any

import numpy as np
from _case_runner import run_cases

REDUCE = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64"]


class NumpyFactory:
    """float64 values <-> numpy arrays of a named dtype (the core's own buffers)."""

    reduce_dtypes = list(REDUCE)
    move_dtypes = list(REDUCE)
    rejected: dict[str, list[str]] = {}  # no Horovod dtype table for numpy: every dtype works

    def make(self, values: np.ndarray, dtype: str) -> np.ndarray:
        return np.asarray(values).astype(dtype)

    def values(self, tensor: Any) -> np.ndarray:
        return np.asarray(tensor).astype(np.float64)

    def dtype(self, tensor: Any) -> str:
        return str(np.asarray(tensor).dtype)


def main() -> None:
    import collective_suite

    import hora as hvd

    collective_suite.init(hvd)
    factory = NumpyFactory()
    run_cases(hvd, collective_suite.cases(factory), factory)


if __name__ == "__main__":
    main()
