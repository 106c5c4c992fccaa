"""Gradient compression, framework-neutral: which tensors a compressor casts, and to what.

Horovod's compressor interface is two static methods, ``compress(tensor) -> (tensor, ctx)`` and
``decompress(tensor, ctx) -> tensor``. The policy (what FP16 compression touches and how it is
undone) lives here once; a framework adapter supplies a two-method :class:`DtypeHook` (the
canonical dtype name of a tensor, and a cast to a named dtype) and subclasses the
:class:`NoneCompressor` / :class:`FP16Compressor` here with it, for its ``Compression.none`` /
``Compression.fp16``. :data:`NUMPY` is the hook for
numpy arrays.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from hora.collectives.ops import dtype_name, to_dtype

FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})
"""Dtypes that :func:`fp16_compress` casts to float16 (every other dtype passes through)."""


class DtypeHook(Protocol):
    """What a framework provides so the compressors can work on its tensors."""

    def dtype_name(self, tensor: Any) -> str:
        """Canonical dtype name (``'float32'``, ``'bfloat16'``, ...) of ``tensor``."""

    def cast(self, tensor: Any, name: str) -> Any:
        """``tensor`` converted to the dtype called ``name`` (differentiable where possible)."""


def none_compress(tensor: Any, hook: DtypeHook) -> tuple[Any, Any]:
    """Identity: ``(tensor, None)``."""
    return tensor, None


def none_decompress(tensor: Any, ctx: Any, hook: DtypeHook) -> Any:
    """Identity."""
    return tensor


def fp16_compress(tensor: Any, hook: DtypeHook) -> tuple[Any, Any]:
    """Floating-point tensors are cast to float16 (ctx: the original dtype name); others pass
    through with ctx None. A float16 tensor is returned as is (ctx ``'float16'``)."""
    name = hook.dtype_name(tensor)
    if name not in FLOATING:
        return tensor, None
    return (tensor if name == "float16" else hook.cast(tensor, "float16")), name


def fp16_decompress(tensor: Any, ctx: Any, hook: DtypeHook) -> Any:
    """Undo :func:`fp16_compress`: cast back to the original floating dtype."""
    if ctx is None or ctx == "float16":
        return tensor
    return hook.cast(tensor, ctx)


class _NumpyHook:
    def dtype_name(self, tensor: Any) -> str:
        return dtype_name(np.asarray(tensor).dtype)

    def cast(self, tensor: Any, name: str) -> Any:
        return np.asarray(tensor).astype(to_dtype(name))


NUMPY: DtypeHook = _NumpyHook()
"""The :class:`DtypeHook` for numpy arrays."""


# ---- Horovod's compressor classes, once; an adapter subclasses them with its hook --------------
class Compressor:
    """Interface for compressing and decompressing a tensor (Horovod's): ``compress(tensor)
    -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``. A user-defined compressor is
    any class with those two static methods."""

    hook: DtypeHook = NUMPY
    """The adapter's tensor dtypes (set by each adapter's subclasses)."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Compress a tensor; returns it with the context needed to decompress it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Decompress the tensor with the given context."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Default: no compression."""

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        return none_compress(tensor, cls.hook)

    @classmethod
    def decompress(cls, tensor: Any, ctx: Any) -> Any:
        return none_decompress(tensor, ctx, cls.hook)


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 and are cast back afterwards."""

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        return fp16_compress(tensor, cls.hook)

    @classmethod
    def decompress(cls, tensor: Any, ctx: Any) -> Any:
        return fp16_decompress(tensor, ctx, cls.hook)



def adapter_classes(compressor: type[Compressor]) -> tuple[Any, Any, Any]:
    """Horovod's ``NoneCompressor``, ``FP16Compressor`` and ``Compression`` for one adapter,
    from its ``Compressor`` (a subclass of :class:`Compressor` that sets ``hook``); made in
    the adapter's module, so they print, pickle and document as that module's classes::

        class Compressor(core.Compressor):
            hook = TORCH_DTYPES
        NoneCompressor, FP16Compressor, Compression = core.adapter_classes(Compressor)
    """
    module = compressor.__module__

    def make(name: str, bases: tuple[type, ...], namespace: dict[str, Any]) -> type:
        return type(name, bases, {"__module__": module, "__qualname__": name, **namespace})

    none = make("NoneCompressor", (NoneCompressor, compressor),
                {"__doc__": NoneCompressor.__doc__})
    fp16 = make("FP16Compressor", (FP16Compressor, compressor),
                {"__doc__": FP16Compressor.__doc__})
    compression = make("Compression", (), {
        "__doc__": "Optional gradient compression (Horovod's): ``Compression.none`` (the "
                   "default) or ``Compression.fp16`` (floating-point tensors travel as "
                   "float16).",
        "none": none, "fp16": fp16})
    return none, fp16, compression


__all__ = ["Compressor", "DtypeHook", "FLOATING", "FP16Compressor", "NUMPY", "NoneCompressor",
           "adapter_classes", "fp16_compress", "fp16_decompress", "none_compress",
           "none_decompress"]
