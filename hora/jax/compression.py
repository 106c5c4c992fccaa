"""Gradient compression for JAX arrays: Horovod's ``Compression.none`` / ``Compression.fp16``.

The policy is :mod:`hora.core.frontend.compression`; this module only supplies the JAX dtype hook
(casts are ``astype``, so they work on tracers inside ``jit`` and are differentiable).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from hora.core.frontend import compression as _core


class _JaxDtypes:
    def dtype_name(self, tensor: Any) -> str:
        return str(np.dtype(getattr(tensor, "dtype", None) or jnp.asarray(tensor).dtype))

    def cast(self, tensor: Any, name: str) -> Any:
        return jnp.asarray(tensor).astype(jnp.dtype(name))


_HOOK = _JaxDtypes()


class Compressor(_core.Compressor):
    """Interface for compressing and decompressing an array (Horovod's; see
    :class:`hora.core.frontend.compression.Compressor`)."""

    hook = _HOOK


NoneCompressor, FP16Compressor, Compression = _core.adapter_classes(Compressor)

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
