"""Gradient compression for torch tensors: Horovod's ``Compression.none`` / ``Compression.fp16``.

The policy is :mod:`hora.core.compression`; this module only supplies the torch dtype hook.
A user-defined compressor is any class with static ``compress(tensor) -> (tensor, ctx)`` and
``decompress(tensor, ctx) -> tensor``.
"""

from __future__ import annotations

from typing import Any

import torch

from hora.core import compression as _core


class _TorchDtypes:
    def dtype_name(self, tensor: Any) -> str:
        return str(tensor.dtype).replace("torch.", "")

    def cast(self, tensor: Any, name: str) -> Any:
        return tensor.to(getattr(torch, name))


_HOOK = _TorchDtypes()


class Compressor:
    """Interface for compressing and decompressing a tensor."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Compress a tensor; returns it with the context needed to decompress it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Decompress the tensor with the given context."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Default: no compression."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return _core.none_compress(tensor, _HOOK)

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return _core.none_decompress(tensor, ctx, _HOOK)


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 and are cast back afterwards (differentiable)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return _core.fp16_compress(tensor, _HOOK)

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return _core.fp16_decompress(tensor, ctx, _HOOK)


class Compression:
    """Optional gradient compression used by allreduce, reducescatter and the optimizer."""

    none = NoneCompressor
    """No compression (the default)."""

    fp16 = FP16Compressor
    """Compress all floating point gradients to 16-bit."""


__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
