"""hora.torch's device buffers (:mod:`hora.torch.buffers`) against the core's host rules, in this
process: scaling with Horovod's arithmetic bit for bit as :func:`~hora.collectives.ops.
scale_inplace` does it, packing with zeros for a joined rank, unpacking into outputs or new
buffers, host staging. On the CPU, and on CUDA where this machine has it (skipped otherwise)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hora.collectives.ops import BFLOAT16, scale_inplace, scale_mode
from hora.torch.buffers import TorchBuffer

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine"))]
DTYPES = [torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.uint8, torch.bool]


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16).copy()
    return t.numpy().copy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("factor", [0.5, 1 / 3, -2.75, 0.0])
def test_scale_matches_the_host_rule(device: str, dtype: torch.dtype, factor: float) -> None:
    values = torch.tensor([7, -7, 3, 100, -1, 0, 1, 3000], dtype=torch.float64)
    if dtype in (torch.uint8, torch.bool):
        values = values.abs()
    t = values.to(dtype).to(device)
    want = _numpy(t)
    scale_inplace(want, factor)
    buf = TorchBuffer(t)
    buf.scale(factor, scale_mode(buf.dtype))
    got = _numpy(buf.native)
    assert got.dtype == want.dtype
    assert got.tobytes() == want.tobytes(), (got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_pack_fills_missing_parts_with_zeros(device: str) -> None:
    a = TorchBuffer(torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device))
    b = TorchBuffer(torch.tensor([5.0], device=device))
    packed = a.pack([a, None, b], [4, 3, 1])
    assert packed.shape == (8,) and packed.device == device
    assert packed.native.tolist() == [1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 5.0]


@pytest.mark.parametrize("device", DEVICES)
def test_unpack_into_outputs_and_new_buffers(device: str) -> None:
    flat = TorchBuffer(torch.arange(6.0, device=device))
    # every piece new: views of the flat buffer, shaped
    views = flat.unpack([4, 2], [(2, 2), (2,)], [None, None])
    assert [v.shape for v in views] == [(2, 2), (2,)]
    assert views[0].native.data_ptr() == flat.native.data_ptr()
    # an output given: copied into it, and the new pieces are copies (a kept result must not
    # hold the whole fused buffer)
    out = TorchBuffer(torch.zeros(2, 2, device=device))
    pieces = flat.unpack([4, 2], [(2, 2), (2,)], [out, None])
    assert pieces[0] is out and out.native.tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert pieces[1].native.tolist() == [4.0, 5.0]
    assert pieces[1].native.data_ptr() != flat.native.data_ptr() + 4 * 4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16, torch.bool],
                         ids=str)
def test_host_staging_round_trip(device: str, dtype: torch.dtype) -> None:
    t = torch.tensor([1, 0, 1, 1], device=device).to(dtype)
    buf = TorchBuffer(t)
    host = buf.to_host()
    assert host.dtype == buf.dtype and host.shape == (4,)
    if device == "cpu":  # a view of the tensor's memory: nothing copied either way
        assert host.ctypes.data == t.data_ptr()
    host[...] = host[::-1] if dtype is not torch.bool else ~host
    buf.load(host)
    assert _numpy(t).tobytes() == host.tobytes()
    raw = buf.bytes_view()
    assert raw.dtype == np.uint8 and raw.size == t.numel() * t.element_size()
