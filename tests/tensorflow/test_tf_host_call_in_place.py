"""hora.tensorflow.bridge.host_call_in_place: results written into the inputs' own memory come
back as TensorFlow's own buffers (no copy, and a later kernel may reuse them), other results
are converted; a single process, no collective."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from hora.tensorflow.bridge import host_call_in_place  # noqa: E402
from hora.tensorflow.gradients import unshared  # noqa: E402


def _address(t: Any) -> Any:
    """Where ``t`` lives, as the graph sees it (a host call reading it)."""
    return tf.numpy_function(lambda a: np.int64(a.ctypes.data), [t], tf.int64)


def test_in_place_results_are_the_inputs_buffers() -> None:
    seen: list[int] = []

    def double(a: np.ndarray, b: np.ndarray) -> list[np.ndarray]:
        seen.extend([a.ctypes.data, b.ctypes.data])
        assert a.flags.writeable and b.flags.writeable
        a *= 2.0
        b += 1
        return [a, b]

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor) -> tuple[Any, ...]:
        a, b = host_call_in_place(double, [unshared(x * 1.0), unshared(y + 0)])
        return a + 0.0, b, _address(a)

    @tf.function
    def then(x: tf.Tensor, y: tf.Tensor) -> Any:
        a, _ = host_call_in_place(double, [unshared(x * 1.0), unshared(y + 0)])
        return _address(a * 3.0)  # a's only reader: its kernel may write into a's buffer

    x = tf.range(4096, dtype=tf.float32)
    y = tf.range(8, dtype=tf.int32)
    for _ in range(3):
        seen.clear()
        a, b, where = step(x, y)
        np.testing.assert_array_equal(a.numpy(), 2.0 * np.arange(4096, dtype=np.float32))
        np.testing.assert_array_equal(b.numpy(), np.arange(8) + 1)
        assert int(where) == seen[0], "the result is a copy of the input buffer"
        seen.clear()
        later = then(x, y)
        assert int(later) == seen[0], "a later kernel could not reuse the result's buffer"
    np.testing.assert_array_equal(x.numpy(), np.arange(4096, dtype=np.float32))  # untouched


def test_other_results_are_converted() -> None:
    def fresh(a: np.ndarray) -> list[np.ndarray]:
        return [a + 1.0]

    @tf.function
    def step(x: tf.Tensor) -> tf.Tensor:
        return host_call_in_place(fresh, [unshared(x * 1.0)])[0]

    x = tf.ones([16])
    np.testing.assert_array_equal(step(x).numpy(), np.full(16, 2.0, np.float32))


def test_errors_keep_their_tensorflow_mapping() -> None:
    def bad(a: np.ndarray) -> list[np.ndarray]:
        raise ValueError("bad argument")

    @tf.function
    def step(x: tf.Tensor) -> tf.Tensor:
        return host_call_in_place(bad, [unshared(x * 1.0)])[0]

    with pytest.raises(tf.errors.InvalidArgumentError, match="bad argument"):
        step(tf.ones([4]))
