"""hora.core.data.packing: a list of arrays as one buffer per dtype, and back."""

from __future__ import annotations

import numpy as np

from hora.core.data.packing import layout_tag, pack, unpack


def test_pack_groups_by_dtype_in_order_and_unpack_restores_every_array() -> None:
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(4, dtype=np.int64),
              np.full((1, 2), 7, np.float32), np.zeros((0,), np.float32), np.float32(3)[()],
              np.arange(3, dtype=np.int64)]
    arrays[4] = np.asarray(arrays[4])
    buffers, layout = pack(arrays)
    assert [b.dtype for b in buffers] == [np.float32, np.int64]
    assert [b.size for b in buffers] == [6 + 2 + 0 + 1, 4 + 3]
    back = unpack([b * 2 for b in buffers], layout)
    for a, b in zip(arrays, back):
        assert b.shape == a.shape and b.dtype == a.dtype
        np.testing.assert_array_equal(b, a * 2)


def test_a_dtype_with_one_array_is_not_copied() -> None:
    a = np.arange(8, dtype=np.float64)
    buffers, _ = pack([a, np.ones(2, np.float32)])
    assert np.shares_memory(buffers[0], a)


def test_layout_tag_tells_shapes_and_dtypes_apart() -> None:
    def tag(*arrays: np.ndarray) -> str:
        return layout_tag(pack(list(arrays))[1])

    base = tag(np.zeros((2, 3)), np.zeros(4, np.float32))
    assert base == tag(np.ones((2, 3)), np.ones(4, np.float32))  # values do not matter
    assert base != tag(np.zeros((3, 2)), np.zeros(4, np.float32))  # same size, other shape
    assert base != tag(np.zeros((2, 3)), np.zeros(4, np.float64))
    assert base != tag(np.zeros(4, np.float32), np.zeros((2, 3)))  # order


def test_large_arrays_keep_a_buffer_each_and_are_not_copied() -> None:
    big = np.ones(64 * 1024, np.float32)  # 256 KiB
    small = [np.full(3, i, np.float32) for i in range(2)]
    buffers, layout = pack([small[0], big, small[1]], pack_below=128 * 1024)
    assert layout.groups == ((0, 2), (1,))
    assert np.shares_memory(buffers[1], big)
    back = unpack(buffers, layout)
    np.testing.assert_array_equal(back[2], small[1])
    assert back[1].shape == big.shape
