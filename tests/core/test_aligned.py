"""hora.core.data.aligned: every fresh result array the core makes is 64-byte aligned."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from hora.core.data import aligned


@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 5), (1000, 7)])
@pytest.mark.parametrize("dtype", ["uint8", "float16", "float32", "float64", "bool"])
def test_empty_is_aligned_contiguous_and_sized(shape: tuple[int, ...], dtype: str) -> None:
    for _ in range(4):  # several allocations: numpy's own 16-byte alignment is not enough
        out = aligned.empty(shape, dtype)
        assert out.shape == shape and out.dtype == np.dtype(dtype)
        assert out.flags.c_contiguous and out.flags.writeable
        if out.size:
            assert out.ctypes.data % aligned.ALIGN == 0


def test_empty_like_and_int_shape() -> None:
    src = np.arange(12, dtype=np.int32).reshape(3, 4)
    out = aligned.empty_like(src)
    assert out.shape == (3, 4) and out.dtype == np.int32 and out.ctypes.data % 64 == 0
    assert aligned.empty(5, "float32").shape == (5,)


_THROUGH_ENGINE = """
import numpy as np, hora
hora.init()
for n in (1, 17, 4099):
    x = np.arange(n, dtype=np.float32)
    assert hora.allreduce(x, name=f"a{n}").ctypes.data % 64 == 0, n
    assert hora.allgather(x, name=f"g{n}").ctypes.data % 64 == 0, n
    assert hora.broadcast(x, 0, name=f"b{n}").ctypes.data % 64 == 0, n
hora.shutdown()
print("ALIGNED")
"""


def test_core_results_are_aligned() -> None:
    """Through the engine (one rank, its own process): allreduce, allgather, broadcast."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    done = subprocess.run([sys.executable, "-c", _THROUGH_ENGINE], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 0 and "ALIGNED" in done.stdout, done.stderr[-3000:]
