"""Tensors that stay where they live: the core's interface to an adapter's device buffers.

By default an adapter hands the core host memory: a view of a CPU tensor, a staged copy of a GPU
one. When the job's data plane moves a framework's tensors itself (the torch data plane and
torch tensors: CUDA ones through NCCL, CPU ones through gloo), the adapter hands them over as
:class:`DeviceBuffer` instead. The core then packs fused ops, scales and unpacks them with the
framework's own kernels on their device (:mod:`hora.core.data.device_exec`) and gives the plane the
framework's tensor: a CUDA gradient never visits host memory, and everything else (naming,
negotiation, fusion, the checks across ranks, fail-loud) is unchanged.

The core still knows no framework: :class:`DeviceBuffer` is the small interface an adapter
implements over its tensors (:class:`hora.torch.ops.TorchBuffer`). Where a device buffer meets
a path that moves host memory only (hora's builtin path, for what the plane cannot reduce; a
one-rank set), the core stages it through host memory (:func:`hora.core.data.device_exec.stage`,
:meth:`DeviceBuffer.to_host`), as every adapter does on the builtin plane.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hora.collectives.ops import scale_inplace, scale_mode

native_frameworks: tuple[str, ...] = ()
"""The frameworks whose tensors this job's data plane moves as they are (see :func:`native`;
adapters read it on every op)."""
_allocators: dict[str, Callable[[tuple[int, ...], np.dtype[Any]], DeviceBuffer]] = {}


class DeviceBuffer(abc.ABC):
    """An adapter's tensor as the core sees it when it stays on its device.

    ``native`` is the framework's tensor (C-contiguous, of ``shape``); ``dtype`` the numpy
    dtype of its elements (``ml_dtypes.bfloat16`` for bfloat16); ``device`` its device kind
    (``"cuda"``, ``"cpu"``), the one the ranks agree on. Every method is local and returns once
    the work is queued on the device in order (a CUDA stream): the plane's op, queued after
    them, sees their results.
    """

    __slots__ = ("device", "dtype", "native", "shape")

    def __init__(self, native: Any, shape: tuple[int, ...], dtype: np.dtype[Any],
                 device: str) -> None:
        self.native, self.shape, self.dtype, self.device = native, shape, dtype, device

    @property
    def size(self) -> int:
        """Elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @abc.abstractmethod
    def view(self, shape: tuple[int, ...]) -> DeviceBuffer:
        """The same memory as ``shape`` (same element count)."""

    @abc.abstractmethod
    def part(self, start: int, stop: int) -> DeviceBuffer:
        """Elements ``[start, stop)`` of the flat buffer, as a 1-D view (no copy)."""

    @abc.abstractmethod
    def bytes_view(self) -> DeviceBuffer:
        """The same memory as a flat buffer of bytes (uint8): moving ops need no dtype, and an
        engine moves bytes of any dtype (gloo cannot move int16 as int16)."""

    @abc.abstractmethod
    def empty(self, shape: tuple[int, ...]) -> DeviceBuffer:
        """A new uninitialized buffer of ``shape``, of this dtype, on this device."""

    @abc.abstractmethod
    def pack(self, parts: Sequence[DeviceBuffer | None], sizes: Sequence[int]) -> DeviceBuffer:
        """A new flat buffer on this device holding ``parts`` one after another, flat, each of
        ``sizes[i]`` elements (None: that many zeros): a fused op's buffer in one copy."""

    @abc.abstractmethod
    def unpack(self, sizes: Sequence[int], shapes: Sequence[tuple[int, ...]],
               outs: Sequence[DeviceBuffer | None]) -> list[DeviceBuffer]:
        """This flat buffer cut into pieces of ``sizes`` elements: piece ``i`` copied into
        ``outs[i]`` where given (returned), else a new buffer of ``shapes[i]`` (when no piece has
        an ``outs``, the pieces may be views of this buffer, which then holds exactly those
        results)."""

    @abc.abstractmethod
    def assign(self, src: DeviceBuffer) -> None:
        """Copy ``src``'s elements in (the same element count, any shape)."""

    @abc.abstractmethod
    def scale(self, factor: float, mode: str) -> None:
        """Multiply in place by ``factor`` (not 1) as
        :func:`~hora.collectives.ops.scale_mode` ``mode`` says."""

    @abc.abstractmethod
    def to_host(self) -> np.ndarray:
        """The values in host memory (a view of the memory itself where it is host memory)."""

    @abc.abstractmethod
    def load(self, host: np.ndarray) -> None:
        """Copy ``host``'s values in (nothing when ``host`` is :meth:`to_host`'s view)."""


def configure(frameworks: tuple[str, ...] = ()) -> None:
    """At ``init()``: the frameworks whose tensors this job's data plane takes as they are (its
    row's ``native`` in :mod:`hora.core.data.paths`; none after ``shutdown()``)."""
    global native_frameworks
    native_frameworks = tuple(frameworks)


def native(framework: str) -> bool:
    """Whether ``framework``'s adapter hands its tensors over as :class:`DeviceBuffer` (the
    job's data plane moves them itself). Checked on every op: a tuple lookup."""
    return framework in native_frameworks


def register_allocator(device: str,
                       make: Callable[[tuple[int, ...], np.dtype[Any]], DeviceBuffer]) -> None:
    """An adapter's way to make an empty buffer on ``device``: a rank that has joined has no
    tensor of its own to take one from, yet contributes zeros in the agreed device's memory."""
    _allocators[device] = make


def allocator(device: str) -> Callable[[tuple[int, ...], np.dtype[Any]], DeviceBuffer] | None:
    """The allocator registered for ``device``, or None."""
    return _allocators.get(device)


def scale(buf: np.ndarray | DeviceBuffer, factor: float) -> None:
    """Multiply ``buf`` (host or device) by ``factor`` in place, with Horovod's arithmetic."""
    if factor == 1.0 or buf.size == 0:
        return
    if isinstance(buf, DeviceBuffer):
        buf.scale(factor, scale_mode(buf.dtype))
    else:
        scale_inplace(buf, factor)


__all__ = ["DeviceBuffer", "allocator", "configure", "native", "register_allocator",
           "scale"]
