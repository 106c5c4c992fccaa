"""A host function inside a jitted program through one XLA FFI custom call (``jax.ffi``):
the host callback of :mod:`hora.jax` on CPU, cheaper than ``jax.pure_callback``.

``jax.pure_callback`` copies every operand into a new ``jax.Array`` (``device_put``) before
the Python function sees it, and checks and canonicalizes every result in Python before XLA
copies it. Here one FFI target, ``hora_host_call``, is registered once per process; its handler
(a ``ctypes`` function, so XLA calls into Python holding the GIL) looks up the traced call's
Python function by an integer attribute, hands it read-only numpy views of XLA's operand
buffers (no copy) and copies each result straight into XLA's result buffer (one ``memmove``),
or, with ``into``, hands it writable views of XLA's result buffers to fill itself (no copy at
all: the collective writes there). The per-call costs against ``pure_callback`` are in
docs/benchmarks.md ("Measurements behind the code's constants").

The handler speaks the XLA FFI C API (``xla/ffi/api/c_api.h``: a stable, versioned ABI);
:func:`available` is False, and callers keep ``pure_callback``, when the backend is not CPU or
the target could not be registered. A handler's views are valid during the call only: the
function must not keep them (hora's collectives finish before they return).
"""

from __future__ import annotations

import ctypes as C
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from hora._util.log import get_logger

HostFn = Callable[..., list[np.ndarray]]
"""``fn(operands) -> results``; with ``into``, ``fn(operands, outputs) -> results``."""

TARGET = "hora_host_call"
_API_VERSION = (0, 3)  # the XLA FFI C API this handler implements (jaxlib 0.10's header)
TESTED_JAX = "0.10."
"""The jax releases whose call frame layout the handler was checked against; with any other
release (the C structs could differ) jitted host calls use ``jax.pure_callback``."""
_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
_METADATA = 1  # XLA_FFI_Extension_Metadata
_INTERNAL = 13  # XLA_FFI_Error_Code_INTERNAL
_P = C.c_void_p
log = get_logger(__name__)


class _ExtensionBase(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("type", C.c_int), ("next", _P)]


class _ApiVersion(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", _P), ("major", C.c_int),
                ("minor", C.c_int)]


class _Metadata(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("api_version", _ApiVersion),
                ("traits", C.c_uint32), ("state_type_id", C.c_int64)]


class _MetadataExtension(C.Structure):
    _fields_ = [("base", _ExtensionBase), ("metadata", C.POINTER(_Metadata))]


class _List(C.Structure):  # XLA_FFI_Args and XLA_FFI_Rets
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", _P), ("size", C.c_int64),
                ("types", _P), ("items", C.POINTER(_P))]


class _Attrs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", _P), ("size", C.c_int64),
                ("types", _P), ("names", _P), ("attrs", C.POINTER(_P))]


class _CallFrame(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", _P), ("api", _P),
                ("ctx", _P), ("stage", C.c_int), ("args", _List), ("rets", _List),
                ("attrs", _Attrs), ("future", _P)]


class _Buffer(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", _P), ("dtype", C.c_int),
                ("data", _P), ("rank", C.c_int64), ("dims", _P)]


class _Scalar(C.Structure):
    _fields_ = [("dtype", C.c_int), ("value", _P)]


class _ErrorCreateArgs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", _P), ("message", C.c_char_p),
                ("errc", C.c_int)]


_ERROR_CREATE = C.CFUNCTYPE(_P, C.POINTER(_ErrorCreateArgs))
_API_ERROR_CREATE_OFFSET = C.sizeof(C.c_size_t) + C.sizeof(_P) + C.sizeof(_ApiVersion) + \
    C.sizeof(_P)  # XLA_FFI_Api: struct_size, extension_start, api_version, internal_api
_DATA_OFFSET = _Buffer.data.offset


class _Call:
    """One traced call site: its function, the operands' and results' shapes, and where
    each result lies in the function's buffers when it returns buffers (``pieces``)."""

    def __init__(self, fn: HostFn, ins: Sequence[jax.ShapeDtypeStruct],
                 outs: Sequence[jax.ShapeDtypeStruct],
                 pieces: Sequence[tuple[int, int]] | None, aliases: dict[int, int] | None = None,
                 into: bool | Sequence[int] = False) -> None:
        self.fn = fn
        self.aliases = [(aliases or {}).get(k) for k in range(len(ins))]
        """Per operand: the index of the result XLA aliased to it (its writable view is
        handed over instead of the operand), or None."""
        self.into = into is not False  # (a list, even empty: the two-argument form)
        self.views = (list(range(len(outs))) if into is True
                      else sorted(set(into)) if into else [])
        """The results an ``into`` function gets views of (the others: None)."""
        self.ins = [(tuple(s.shape), np.dtype(s.dtype)) for s in ins]
        self.outs = [(tuple(s.shape), np.dtype(s.dtype)) for s in outs]
        self.nbytes = [int(np.prod(shape)) * dt.itemsize for shape, dt in self.outs]
        self.pieces = list(pieces) if pieces is not None else None
        # with pieces: (result, buffer, byte offset, bytes) of each non-empty result, and the
        # bytes each buffer must hold
        self.copies = [(k, b, offset, self.nbytes[k])
                       for k, (b, offset) in enumerate(self.pieces or []) if self.nbytes[k]]
        self.need: dict[int, int] = {}
        for _, b, offset, n in self.copies:
            self.need[b] = max(self.need.get(b, 0), offset + n)


_CALLS: dict[int, _Call] = {}
_KEYS = itertools.count(1)
_LOCK = threading.Lock()


class _View:
    """A numpy view of ``shape`` ``dtype`` at ``address`` (``__array_interface__``),
    read-only unless ``writable``."""

    def __init__(self, address: int, shape: tuple[int, ...], dtype: np.dtype,
                 writable: bool = False) -> None:
        self.__array_interface__ = {"data": (address, not writable), "shape": shape,
                                    "typestr": dtype.str, "version": 3}


def _operands(frame: _CallFrame, call: _Call) -> list[np.ndarray]:
    """Read-only views of the operands; for an aliased operand, a writable view of the result
    XLA aliased to it (it holds the operand's values)."""
    views = []
    args, rets, pointer = frame.args.items, frame.rets.items, _P.from_address
    for (shape, dtype), alias, arg in zip(call.ins, call.aliases, args):
        buffer = arg if alias is None else rets[alias]
        address = pointer(buffer + _DATA_OFFSET).value
        if not address:  # zero-size operand
            views.append(np.empty(shape, dtype))
        else:
            views.append(np.asarray(_View(address, shape, dtype, alias is not None)).view(dtype))
    return views


def _outputs(frame: _CallFrame, call: _Call) -> list[np.ndarray | None]:
    """Writable views of XLA's result buffers ``call.views`` (None for the others), for
    ``into``."""
    views: list[np.ndarray | None] = [None] * len(call.outs)
    rets = frame.rets.items
    for k in call.views:
        shape, dtype = call.outs[k]
        address = _P.from_address(rets[k] + _DATA_OFFSET).value
        views[k] = (np.asarray(_View(address, shape, dtype, True)).view(dtype)
                    if address else np.empty(shape, dtype))
    return views


def _store(frame: _CallFrame, call: _Call, results: Sequence[np.ndarray]) -> None:
    """Copy ``results`` into XLA's result buffers (each checked against its spec), or, with
    ``pieces``, each result's bytes out of the buffers ``results``; bytes already where they
    belong (an ``into`` call's function wrote XLA's buffer itself) are not copied."""
    rets = frame.rets.items
    if call.pieces is not None:
        bases = [_base(b) for b in results]
        for b, n in call.need.items():
            if bases[b][1] < n:
                raise ValueError(f"hora.jax host call: buffer {b} holds {bases[b][1]} bytes, "
                                 f"{n} expected")
        memmove, pointer = C.memmove, _P.from_address
        for k, b, offset, n in call.copies:  # the hot loop of a packed tree: one copy a leaf
            target = pointer(rets[k] + _DATA_OFFSET).value or _null()
            if target != bases[b][0] + offset:
                memmove(target, bases[b][0] + offset, n)
        return
    if len(results) != len(call.outs):
        raise ValueError(f"hora.jax host call: {len(results)} results, {len(call.outs)} "
                         "expected")
    for k, (result, (shape, dtype)) in enumerate(zip(results, call.outs)):
        out = np.asarray(result)
        if out.shape != shape:
            raise ValueError(f"hora.jax host call: result {k} has shape {out.shape}, "
                             f"{shape} expected")
        if out.dtype != dtype:
            out = out.astype(dtype)
        if call.nbytes[k]:
            target, source = _data(rets[k]), _base(out)[0]
            if target != source:
                C.memmove(target, source, call.nbytes[k])


def _null() -> int:
    raise ValueError("hora.jax host call: XLA passed a result buffer without memory")


def _data(buffer: int) -> int:
    """The data address of the XLA_FFI_Buffer at ``buffer``."""
    address = _P.from_address(buffer + _DATA_OFFSET).value
    if not address:
        raise ValueError("hora.jax host call: XLA passed a result buffer without memory")
    return int(address)


def _base(array: np.ndarray) -> tuple[int, int]:
    """The address and byte size of a C-contiguous copy-free view of ``array``."""
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return int(array.__array_interface__["data"][0]), int(array.nbytes)


def _error(frame: _CallFrame, exc: BaseException) -> int | None:
    """An XLA_FFI_Error carrying ``exc``'s text (XLA raises it as the JAX runtime error)."""
    create = _ERROR_CREATE(_P.from_address(int(frame.api) + _API_ERROR_CREATE_OFFSET).value or 0)
    message = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
    args = _ErrorCreateArgs(C.sizeof(_ErrorCreateArgs), None, message, _INTERNAL)
    result: int | None = create(C.byref(args))
    return result


def _handle(pointer: Any) -> int | None:
    """The FFI handler: answers XLA's metadata query, runs the call at the execute stage."""
    frame = pointer.contents
    try:
        if frame.extension_start:
            ext = _ExtensionBase.from_address(frame.extension_start)
            if ext.type == _METADATA:
                meta = _MetadataExtension.from_address(frame.extension_start).metadata.contents
                meta.api_version.major, meta.api_version.minor = _API_VERSION
                if meta.struct_size >= _Metadata.traits.offset + 4:
                    meta.traits = 0
                return None
        if frame.stage != _EXECUTE:
            return None
        key = C.c_int64.from_address(_Scalar.from_address(frame.attrs.attrs[0]).value).value
        call = _CALLS[key]
        if call.into:
            _store(frame, call, call.fn(_operands(frame, call), _outputs(frame, call)))
        else:
            _store(frame, call, call.fn(_operands(frame, call)))
        return None
    except BaseException as exc:  # noqa: BLE001 - every error goes back to XLA, none escapes
        try:
            return _error(frame, exc)
        except BaseException:  # noqa: BLE001 - no API to report through: log, fail loudly
            log.exception("hora.jax host call failed and could not report it to XLA")
            raise


_HANDLER = C.CFUNCTYPE(_P, C.POINTER(_CallFrame))(_handle)
_registered: bool | None = None


def available() -> bool:
    """True when jitted code on this process's default backend can use :func:`call`
    (registers the FFI target on first use)."""
    global _registered
    if jax.default_backend() != "cpu":
        return False
    with _LOCK:
        if _registered is None and not jax.__version__.startswith(TESTED_JAX):
            log.info("hora.jax: the %s FFI handler is tested with jax %s.*, not %s; host calls "
                     "use jax.pure_callback", TARGET, TESTED_JAX.rstrip("."), jax.__version__)
            _registered = False
        if _registered is None:
            try:
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(_HANDLER),
                                            platform="cpu")
                _registered = True
            except Exception:  # noqa: BLE001 - another jaxlib: pure_callback instead
                log.warning("hora.jax: could not register the %s FFI target; host calls use "
                            "jax.pure_callback", TARGET, exc_info=True)
                _registered = False
    return bool(_registered)


def call(fn: HostFn, out_specs: Sequence[jax.ShapeDtypeStruct], operands: Sequence[Any],
         pieces: Sequence[tuple[int, int]] | None = None, inplace: bool = False,
         into: bool | Sequence[int] = False,
         aliases: dict[int, int | None] | None = None) -> list[Any]:
    """``fn`` (host arrays -> host arrays shaped like ``out_specs``) on the traced
    ``operands``, as one custom call of the jitted program (under ``vmap``: once per
    element). With ``pieces``, ``fn`` returns buffers instead and result ``k`` is
    ``out_specs[k]``'s bytes at byte offset ``pieces[k][1]`` of buffer ``pieces[k][0]``
    (a pytree cut out of packed buffers without a view per leaf). ``aliases`` (with
    ``pieces``) maps operand ``k`` to the result XLA aliases to it: ``out_specs``' index
    ``j`` (same shape and dtype) or None (an extra result of the call, not returned);
    ``inplace`` aliases every operand to an extra result. ``fn`` then gets a writable buffer
    holding an aliased operand's values and may return it, changed in place (XLA copies the
    operand first only if it is needed elsewhere, or is an argument of the jitted function
    that was not donated: a packed buffer made for the call, or a gradient computed in the
    step, is not). With ``into``, ``fn(operands, outputs)`` also gets writable views of XLA's
    result buffers (shaped like ``out_specs``; ``into`` a list of result indices: of those
    only, None for the others, since a view costs ~2 µs) and may write its results there and
    return them (or, with ``pieces``, return buffers that are those views): such bytes are
    not copied again. ``fn`` is kept for the life of the process (compiled programs may call
    it)."""
    if inplace:
        aliases = dict.fromkeys(range(len(operands)))
    if aliases and pieces is None:
        raise ValueError("hora.jax host call: aliased operands need pieces")
    ins = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in operands]
    results = list(out_specs)
    resolved: dict[int, int] = {}
    for k, j in sorted((aliases or {}).items()):
        if j is None:
            resolved[k] = len(results)
            results.append(ins[k])
        else:
            if (tuple(ins[k].shape), np.dtype(ins[k].dtype)) != \
                    (tuple(results[j].shape), np.dtype(results[j].dtype)):
                raise ValueError(f"hora.jax host call: operand {k} ({ins[k]}) cannot alias "
                                 f"result {j} ({results[j]})")
            resolved[k] = j
    key = next(_KEYS)
    _CALLS[key] = _Call(fn, ins, out_specs, pieces, resolved, into)
    outs = jax.ffi.ffi_call(TARGET, results, vmap_method="sequential",
                            input_output_aliases=resolved)(*operands, key=np.int64(key))
    return list(outs)[:len(out_specs)]


__all__ = ["TARGET", "available", "call"]
