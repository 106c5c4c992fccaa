"""Gradient compression for TensorFlow tensors: Horovod's ``Compression.none`` /
``Compression.fp16``.

The policy is :mod:`hora.core.frontend.compression`; this module only supplies the TensorFlow dtype
hook. A user-defined compressor is any class with static ``compress(tensor) -> (tensor, ctx)`` and
``decompress(tensor, ctx) -> tensor``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora.core.frontend import compression as _core


class _TensorFlowDtypes:
    def dtype_name(self, tensor: Any) -> str:
        return str(tf.as_dtype(tensor.dtype).name)

    def cast(self, tensor: Any, name: str) -> Any:
        return tf.cast(tensor, tf.as_dtype(name))


_HOOK = _TensorFlowDtypes()


class Compressor(_core.Compressor):
    """Interface for compressing and decompressing a tensor (Horovod's; see
    :class:`hora.core.frontend.compression.Compressor`)."""

    hook = _HOOK


NoneCompressor, FP16Compressor, Compression = _core.adapter_classes(Compressor)

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
