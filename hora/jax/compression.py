"""Gradient compression for JAX arrays: Horovod's ``Compression.none`` / ``Compression.fp16``.

The policy is :mod:`hora.core.compression`; this module only supplies the JAX dtype hook (casts
are ``astype``, so they work on tracers inside ``jit`` and are differentiable).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from hora.core import compression as _core


class _JaxDtypes:
    def dtype_name(self, tensor: Any) -> str:
        return str(np.dtype(getattr(tensor, "dtype", None) or jnp.asarray(tensor).dtype))

    def cast(self, tensor: Any, name: str) -> Any:
        return jnp.asarray(tensor).astype(jnp.dtype(name))


_HOOK = _JaxDtypes()


class Compressor:
    """Interface for compressing and decompressing an array."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Compress an array; returns it with the context needed to decompress it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Decompress the array with the given context."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Default: no compression."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return _core.none_compress(tensor, _HOOK)

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return _core.none_decompress(tensor, ctx, _HOOK)


class FP16Compressor(Compressor):
    """Floating-point arrays travel as float16 and are cast back afterwards."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return _core.fp16_compress(tensor, _HOOK)

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return _core.fp16_decompress(tensor, ctx, _HOOK)


class Compression:
    """Optional gradient compression used by allreduce, reducescatter and the optimizer."""

    none = NoneCompressor
    """No compression (the default)."""

    fp16 = FP16Compressor
    """Compress all floating point gradients to 16-bit."""


__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
