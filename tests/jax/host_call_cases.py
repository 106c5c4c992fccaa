"""Single-process cases of :mod:`hora.jax.host_call` (the FFI handler: how it reads XLA's call
frame, views operands and results, and stores results), run by test_host_call.py in a child
process (the pytest process never imports JAX). Prints ``CASE <id> OK`` per case, stops at the
first failure."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hora.jax import host_call

F32 = jax.ShapeDtypeStruct((3, 4), jnp.float32)


def _spec(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def operands_read_only() -> None:
    """Operands arrive as read-only views of XLA's buffers with their shapes and dtypes
    (bfloat16 and a 0-d scalar included); results are copied back."""
    seen: list[tuple[Any, ...]] = []

    def fn(a: list[np.ndarray]) -> list[np.ndarray]:
        seen.append(tuple((x.shape, x.dtype, x.flags.writeable) for x in a))
        return [a[0] * 2, a[1].astype(np.float32) + 1, a[2] + 1]

    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    h = jnp.ones(5, jnp.bfloat16)
    s = jnp.float32(7)
    f = jax.jit(lambda x, h, s: host_call.call(
        fn, [F32, jax.ShapeDtypeStruct((5,), jnp.float32), _spec(s)], [x * 1, h, s]))
    got = f(x, h, s)
    np.testing.assert_array_equal(got[0], np.arange(12).reshape(3, 4) * 2)
    np.testing.assert_array_equal(got[1], np.full(5, 2, np.float32))
    assert float(got[2]) == 8.0
    assert seen[0] == (((3, 4), np.dtype(np.float32), False),
                       ((5,), np.dtype(jnp.bfloat16), False), ((), np.dtype(np.float32), False))


def aliased_in_place() -> None:
    """An aliased operand is a writable view of its result: changed in place and returned,
    its bytes are the result (no copy); pieces cut other results out of a buffer."""
    def fn(a: list[np.ndarray]) -> list[np.ndarray]:
        a[1] *= 3  # in place: the aliased result's buffer
        return [a[0], a[1]]

    small = jax.ShapeDtypeStruct((2,), jnp.float32)
    f = jax.jit(lambda x: host_call.call(
        fn, [small, small, F32], [jnp.arange(4, dtype=jnp.float32) * 1, x * 2],
        pieces=[(0, 0), (0, 8), (1, 0)], aliases={0: None, 1: 2}))
    x = jnp.ones((3, 4), jnp.float32)
    for _ in range(2):  # twice: other buffers the second time
        lo, hi, big = f(x)
        np.testing.assert_array_equal(lo, [0, 1])
        np.testing.assert_array_equal(hi, [2, 3])
        np.testing.assert_array_equal(big, np.full((3, 4), 6, np.float32))


def pieces_from_new_buffer() -> None:
    """A function may return new buffers instead of the aliased views: their bytes are
    copied into the results."""
    def fn(a: list[np.ndarray]) -> list[np.ndarray]:
        return [np.arange(4, dtype=np.float32) + 10, np.full((3, 4), 5, np.float32)]

    small = jax.ShapeDtypeStruct((2,), jnp.float32)
    f = jax.jit(lambda x: host_call.call(
        fn, [small, small, F32], [jnp.zeros(4, jnp.float32) + x[0, 0], x * 2],
        pieces=[(0, 0), (0, 8), (1, 0)], aliases={0: None, 1: 2}))
    lo, hi, big = f(jnp.ones((3, 4), jnp.float32))
    np.testing.assert_array_equal(lo, [10, 11])
    np.testing.assert_array_equal(hi, [12, 13])
    np.testing.assert_array_equal(big, np.full((3, 4), 5, np.float32))


def into_outputs() -> None:
    """``into``: writable views of the results asked for (None for the others); a result
    written there and returned is not copied again; zero-size operands and results work."""
    seen: list[Any] = []

    def fn(a: list[np.ndarray], outs: list[np.ndarray | None]) -> list[np.ndarray]:
        seen.append([o is None for o in outs] + [a[1].shape])
        out = outs[0]
        assert out is not None and out.flags.writeable
        np.add(a[0], 1, out=out)
        return [out, np.zeros((0,), np.float32), a[0] - 1]

    empty = jax.ShapeDtypeStruct((0,), jnp.float32)
    f = jax.jit(lambda x: host_call.call(fn, [F32, empty, F32], [x, jnp.zeros(0)],
                                         into=[0, 1]))
    one, none, two = f(jnp.ones((3, 4), jnp.float32))
    np.testing.assert_array_equal(one, np.full((3, 4), 2, np.float32))
    np.testing.assert_array_equal(two, np.zeros((3, 4), np.float32))
    assert none.shape == (0,)
    assert seen[0] == [False, False, True, (0,)], seen


def errors_reach_jax() -> None:
    """An exception in the function (here: writing a read-only operand, a wrong result
    shape) is raised by JAX with its text."""
    def write(a: list[np.ndarray]) -> list[np.ndarray]:
        a[0][...] = 0
        return [a[0]]

    def shape(a: list[np.ndarray]) -> list[np.ndarray]:
        return [np.zeros((2, 2), np.float32)]

    for fn, text in ((write, "read-only"), (shape, "shape")):
        try:
            jax.block_until_ready(jax.jit(lambda x, fn=fn: host_call.call(fn, [F32], [x]))(
                jnp.ones((3, 4), jnp.float32)))
        except Exception as exc:  # noqa: BLE001 - the JAX runtime error
            assert text in str(exc), str(exc)
        else:
            raise AssertionError(f"no error for {fn.__name__}")


CASES: list[tuple[str, Callable[[], None]]] = [
    ("operands-read-only", operands_read_only), ("aliased-in-place", aliased_in_place),
    ("pieces-from-new-buffer", pieces_from_new_buffer), ("into-outputs", into_outputs),
    ("errors-reach-jax", errors_reach_jax)]


def main() -> None:
    assert host_call.available(), "the FFI host call is not available"
    for case_id, fn in CASES:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - report and stop
            traceback.print_exc()
            print(f"CASE {case_id} FAIL {type(exc).__name__}: {exc}", flush=True)
            sys.exit(1)
        print(f"CASE {case_id} OK", flush=True)


if __name__ == "__main__":
    main()
