"""Gradient compression for torch tensors: Horovod's ``Compression.none`` / ``Compression.fp16``.

The policy is :mod:`hora.core.frontend.compression`; this module only supplies the torch dtype hook.
A user-defined compressor is any class with static ``compress(tensor) -> (tensor, ctx)`` and
``decompress(tensor, ctx) -> tensor``.
"""

from __future__ import annotations

from typing import Any

import torch

from hora.core.frontend import compression as _core


class _TorchDtypes:
    def dtype_name(self, tensor: Any) -> str:
        return str(tensor.dtype).replace("torch.", "")

    def cast(self, tensor: Any, name: str) -> Any:
        return tensor.to(getattr(torch, name))


_HOOK = _TorchDtypes()


class Compressor(_core.Compressor):
    """Interface for compressing and decompressing a tensor (Horovod's; see
    :class:`hora.core.frontend.compression.Compressor`)."""

    hook = _HOOK


NoneCompressor, FP16Compressor, Compression = _core.adapter_classes(Compressor)

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
