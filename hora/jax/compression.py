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


class Compressor(_core.Compressor):
    """Interface for compressing and decompressing an array (Horovod's; see
    :class:`hora.core.compression.Compressor`)."""

    hook = _HOOK


class NoneCompressor(_core.NoneCompressor, Compressor):
    """Default: no compression."""


class FP16Compressor(_core.FP16Compressor, Compressor):
    """Floating-point arrays travel as float16 and are cast back afterwards."""


class Compression:
    """Optional gradient compression used by allreduce, reducescatter and the optimizer."""

    none = NoneCompressor
    """No compression (the default)."""

    fp16 = FP16Compressor
    """Compress all floating point gradients to 16-bit."""


__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
