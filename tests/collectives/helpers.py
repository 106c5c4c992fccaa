"""Shared test helpers: a call-recording Comm, input generators and numpy references.

Inputs are chosen so that every partial result of every reduction order is exactly
representable in the dtype, so results are compared *bitwise* with the reference for every
dtype (tolerance 0):

* integers: any values for Sum/Min/Max (integer overflow wraps modulo 2**bits, which is
  associative and commutative, and the reference wraps the same way); small values for Product;
* floats (float16, bfloat16, float32, float64): small integers for Sum (|sum| <= 64), signed
  powers of two in [1/2, 2] for Product (|product| in [2**-8, 2**8]), eighths for Min/Max;
* bool: Sum and Max are logical or, Product and Min logical and.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hora.collectives.comm import Buffer, Comm
from hora.collectives.ops import SUPPORTED_DTYPES, ReduceOp

DTYPES = list(SUPPORTED_DTYPES)
OPS = [ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product]
FLOAT_DTYPES = ["float16", "bfloat16", "float32", "float64"]


def sizes_for(n: int) -> list[int]:
    """Element counts worth testing on ``n`` ranks: empty, 1, odd, n-1, primes, a few thousand."""
    return sorted({0, 1, 7, max(n - 1, 0), 13, 2053})


def _nbytes(buf: Buffer) -> int:
    if isinstance(buf, np.ndarray):
        return int(buf.nbytes)
    return memoryview(buf).nbytes


@dataclass
class RecordingComm:
    """Wraps a Comm and records every call as ``(kind, peer(s)..., nbytes)``."""

    inner: Comm
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def describe(self, peer: int) -> str:
        return self.inner.describe(peer)

    def send(self, peer: int, buf: Buffer) -> None:
        self.calls.append(("send", peer, _nbytes(buf)))
        self.inner.send(peer, buf)

    def recv_into(self, peer: int, buf: Buffer) -> None:
        self.calls.append(("recv", peer, _nbytes(buf)))
        self.inner.recv_into(peer, buf)

    def sendrecv(self, send_peer: int, send_buf: Buffer, recv_peer: int, recv_buf: Buffer) -> None:
        self.calls.append(("sendrecv", send_peer, recv_peer, _nbytes(send_buf), _nbytes(recv_buf)))
        self.inner.sendrecv(send_peer, send_buf, recv_peer, recv_buf)

    def kinds_and_peers(self) -> list[tuple[Any, ...]]:
        """The calls without byte counts."""
        return [c[:3] if c[0] == "sendrecv" else c[:2] for c in self.calls]


def make_inputs(dtype_name: str, op: ReduceOp, nranks: int, count: int,
                seed: int = 0) -> list[np.ndarray]:
    """One input array per rank; see the module docstring for the value ranges."""
    rng = np.random.default_rng(seed)
    dtype = SUPPORTED_DTYPES[dtype_name]
    shape = (nranks, count)
    if dtype.kind == "b":
        p_true = 0.9 if op in (ReduceOp.Product, ReduceOp.Min) else 0.1
        values: np.ndarray = rng.random(shape) < p_true
    elif dtype.kind in "iu":
        if op == ReduceOp.Product:
            low = -3 if dtype.kind == "i" else 0
            values = rng.integers(low, 4, shape)
        else:
            info = np.iinfo(dtype)
            values = rng.integers(info.min, info.max, shape, endpoint=True, dtype=dtype)
    elif op in (ReduceOp.Sum, ReduceOp.Average):
        values = rng.integers(-8, 9, shape).astype(np.float64)
    elif op == ReduceOp.Product:
        values = rng.choice(np.array([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0]), shape)
    else:
        values = rng.integers(-1000, 1001, shape) / 8.0
    stacked = values.astype(dtype)
    return [np.ascontiguousarray(stacked[r]) for r in range(nranks)]


def reference(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """Element-wise reduction over ranks computed independently of hora's kernels."""
    stack = np.stack(inputs)
    dtype = stack.dtype
    if op == ReduceOp.Average:
        op = ReduceOp.Sum
    if dtype.kind == "b":
        either = op in (ReduceOp.Sum, ReduceOp.Max)
        return np.asarray(stack.any(axis=0) if either else stack.all(axis=0))
    wide = stack.astype(np.int64 if dtype.kind in "iu" else np.float64)
    if op == ReduceOp.Sum:
        result = wide.sum(axis=0)
    elif op == ReduceOp.Product:
        result = wide.prod(axis=0)
    elif op == ReduceOp.Min:
        result = wide.min(axis=0)
    else:
        result = wide.max(axis=0)
    return result.astype(dtype)


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality (distinguishes -0.0 from 0.0 and compares NaN payloads)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
