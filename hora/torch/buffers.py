"""Torch tensors as the core's device buffers (:class:`hora.core.op.device.DeviceBuffer`).

On the torch data plane (``HORA_DATA_PLANE=torch``) hora.torch hands the core its tensors as
they are, on their device: fused allreduces are packed, scaled and unpacked with torch's own
kernels there, and ``torch.distributed`` moves them (NCCL for CUDA tensors, gloo for CPU ones),
so a CUDA gradient is never copied to host memory. Every method queues work on the tensor's
device in the current stream's order, which the plane's op then follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hora.collectives.ops import BFLOAT16
from hora.core.op import device as _device
from hora.core.op.device import DeviceBuffer

_NUMPY: dict[torch.dtype, np.dtype[Any]] = {
    t: np.dtype(n) for t, n in ((torch.float16, "float16"), (torch.float32, "float32"),
                                (torch.float64, "float64"), (torch.int8, "int8"),
                                (torch.uint8, "uint8"), (torch.int16, "int16"),
                                (torch.int32, "int32"), (torch.int64, "int64"),
                                (torch.bool, "bool"))}
if BFLOAT16 is not None:
    _NUMPY[torch.bfloat16] = np.dtype(BFLOAT16)
_TORCH = {n: t for t, n in _NUMPY.items()}


class TorchBuffer(DeviceBuffer):
    """A contiguous torch tensor (``native``), on whatever device it lives."""

    __slots__ = ()

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(tensor, tuple(tensor.shape), _NUMPY[tensor.dtype], tensor.device.type)

    def view(self, shape: tuple[int, ...]) -> TorchBuffer:
        return TorchBuffer(self.native.view(shape))

    def part(self, start: int, stop: int) -> TorchBuffer:
        return TorchBuffer(self.native.view(-1)[start:stop])

    def bytes_view(self) -> TorchBuffer:
        return TorchBuffer(self.native.view(-1).view(torch.uint8))

    def empty(self, shape: tuple[int, ...]) -> TorchBuffer:
        t = self.native
        return TorchBuffer(torch.empty(shape, dtype=t.dtype, device=t.device))

    def pack(self, parts: Sequence[DeviceBuffer | None], sizes: Sequence[int]) -> TorchBuffer:
        t = self.native
        flat = [p.native.view(-1) if p is not None
                else torch.zeros(n, dtype=t.dtype, device=t.device)
                for p, n in zip(parts, sizes)]
        return TorchBuffer(torch.cat(flat) if flat else t.new_empty(0))

    def unpack(self, sizes: Sequence[int], shapes: Sequence[tuple[int, ...]],
               outs: Sequence[DeviceBuffer | None]) -> list[DeviceBuffer]:
        pieces = self.native.split(list(sizes))
        if all(o is None for o in outs):  # this buffer holds exactly these results: views
            return [TorchBuffer(p.view(shape)) for p, shape in zip(pieces, shapes)]
        results: list[DeviceBuffer] = []
        for piece, shape, out in zip(pieces, shapes, outs):
            if out is None:  # a copy: a kept result must not hold the whole fused buffer
                results.append(TorchBuffer(piece.view(shape).clone()))
            else:
                out.native.view(-1).copy_(piece)
                results.append(out)
        return results

    def assign(self, src: DeviceBuffer) -> None:
        self.native.view(-1).copy_(src.native.reshape(-1))

    def scale(self, factor: float, mode: str) -> None:
        t = self.native
        if mode == "int":  # in float64, truncated toward zero
            t.copy_(torch.trunc(t.to(torch.float64) * factor))
        elif mode == "bool":
            if factor == 0:
                t.zero_()
        elif mode == "wide":  # 16-bit floats: in float32, rounded back once
            t.copy_(t.to(torch.float32).mul_(factor))
        else:
            t.mul_(factor)

    def to_host(self) -> np.ndarray:
        t = self.native.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype is torch.bfloat16:
            return t.view(torch.int16).numpy().view(self.dtype)
        return t.numpy()

    def load(self, host: np.ndarray) -> None:
        t = self.native
        if t.device.type == "cpu" and host.size and host.ctypes.data == t.data_ptr():
            return  # to_host's own view: the values are there already
        if BFLOAT16 is not None and host.dtype == BFLOAT16:
            src = torch.from_numpy(np.ascontiguousarray(host).view(np.int16)).view(torch.bfloat16)
        else:
            src = torch.from_numpy(np.ascontiguousarray(host))
        t.view(-1).copy_(src.reshape(-1))


_GPU: list[torch.device] = []  # the CUDA device of the last CUDA tensor handed over


def wrap(tensor: torch.Tensor) -> TorchBuffer:
    """``tensor`` (detached; a contiguous copy if it is not contiguous) as a device buffer."""
    t = tensor.detach().contiguous()
    if t.is_cuda and (not _GPU or _GPU[0] != t.device):
        _GPU[:] = [t.device]
    return TorchBuffer(t)


def _cuda(shape: tuple[int, ...], dtype: np.dtype[Any]) -> DeviceBuffer:
    """A rank that joined contributes zeros on the GPU its earlier ops used (the engine's
    thread has its own current device, not the one the program set)."""
    gpu = _GPU[0] if _GPU else torch.device("cuda", torch.cuda.current_device())
    return TorchBuffer(torch.empty(shape, dtype=_TORCH[np.dtype(dtype)], device=gpu))


_device.register_allocator("cuda", _cuda)

__all__ = ["TorchBuffer", "wrap"]
