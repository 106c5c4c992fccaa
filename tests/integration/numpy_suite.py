"""The framework-neutral collective suite through hora's numpy API (``import hora``): the
factory, and the rank side of the job (``python numpy_suite.py``). Imports no framework."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import numpy as np

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
    for case_id, fn in collective_suite.cases(factory):
        try:
            fn(hvd, factory)
        except BaseException as exc:  # noqa: BLE001 - report, then leave at once
            detail = f"{type(exc).__name__}: {exc}".replace("\n", " | ")
            print(f"CASE {case_id} FAIL {detail}", flush=True)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        print(f"CASE {case_id} OK", flush=True)
    hvd.shutdown()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
