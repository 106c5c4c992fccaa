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
        in_bytes = [int(np.prod(shape)) * dt.itemsize for shape, dt in self.ins]
        # per operand: where its buffer is (the result XLA aliased to it, else the argument),
        # and how to view it; per viewed result the same (everything but addresses is fixed)
        self.operand_views = [
            (_RETS if alias is not None else _ARGS, k if alias is None else alias, shape,
             dtype, C.c_char * n if n else None, alias is not None, n)
            for k, ((shape, dtype), alias, n) in enumerate(zip(self.ins, self.aliases,
                                                                in_bytes))]
        self.result_views = [(k, self.outs[k][0], self.outs[k][1],
                              C.c_char * self.nbytes[k] if self.nbytes[k] else None)
                             for k in self.views]
        self.pieces = list(pieces) if pieces is not None else None
        # with pieces: (result, buffer, byte offset, bytes, operand aliased to the result:
        # its bytes are already there when the function returns that operand's view) of each
        # non-empty result, and the bytes each buffer must hold
        aliased = {j: k for k, j in enumerate(self.aliases) if j is not None}
        self.copies = [(k, b, offset, self.nbytes[k],
                        b if offset == 0 and aliased.get(k) == b else None)
                       for k, (b, offset) in enumerate(self.pieces or []) if self.nbytes[k]]
        self.need: dict[int, int] = {}
        for _, b, offset, n, _ in self.copies:
            self.need[b] = max(self.need.get(b, 0), offset + n)


_CALLS: dict[int, _Call] = {}
_KEYS = itertools.count(1)
_LOCK = threading.Lock()

# The execute stage reads the call frame with as few Python objects as it can: the frame is
# passed as an address, and a pointer-sized field at an aligned address is read by indexing
# one ctypes pointer (a ctypes structure or ``from_address`` per field costs 3-10x more, and
# the handler runs after the backward pass, when little of Python is still in cache).
_WORD = C.sizeof(_P)
_WORDS = C.cast(_WORD, C.POINTER(_P))
_ARGS = _CallFrame.args.offset + _List.items.offset
_RETS = _CallFrame.rets.offset + _List.items.offset
_ATTRS = _CallFrame.attrs.offset + _Attrs.attrs.offset
_EXTENSION = _CallFrame.extension_start.offset
_STAGE = _CallFrame.stage.offset
_SCALAR_VALUE = _Scalar.value.offset
_API = _CallFrame.api.offset
_DATA_WORD = _DATA_OFFSET // _WORD - 1
"""``_WORDS[buffer // _WORD + _DATA_WORD]``: the data address of the buffer struct at
``buffer`` (its ``data`` field is pointer-aligned)."""
assert _DATA_OFFSET % _WORD == 0


def _word(address: int) -> int:
    """The pointer-sized word at the pointer-aligned ``address`` (0 for NULL)."""
    return _WORDS[address // _WORD - 1] or 0


def _buffer(items: int, index: int) -> int:
    """The data address of buffer ``index`` of the frame's arguments or results (``items``:
    the word at ``frame + _ARGS`` or ``frame + _RETS``)."""
    return _word(_word(items + index * _WORD) + _DATA_OFFSET)


def _operands(frame: int, call: _Call) -> tuple[list[np.ndarray], list[int]]:
    """Read-only views of the operands (and their addresses); for an aliased operand, a
    writable view of the result XLA aliased to it (it holds the operand's values)."""
    views, addresses = [], []
    tables = {_ARGS: _word(frame + _ARGS), _RETS: _word(frame + _RETS)}
    for table, index, shape, dtype, raw, writable, _ in call.operand_views:
        address = _buffer(tables[table], index) if raw is not None else 0
        if raw is None or not address:  # zero-size operand
            view = np.empty(shape, dtype)
        else:
            view = np.ndarray(shape, dtype, raw.from_address(address))
            if not writable:
                view.flags.writeable = False
        views.append(view)
        addresses.append(address)
    return views, addresses


def _outputs(frame: int, call: _Call) -> list[np.ndarray | None]:
    """Writable views of XLA's result buffers ``call.views`` (None for the others), for
    ``into``."""
    views: list[np.ndarray | None] = [None] * len(call.outs)
    rets = _word(frame + _RETS)
    for k, shape, dtype, raw in call.result_views:
        address = _buffer(rets, k) if raw is not None else 0
        views[k] = (np.ndarray(shape, dtype, raw.from_address(address))
                    if raw is not None and address else np.empty(shape, dtype))
    return views


def _store(frame: int, call: _Call, results: Sequence[np.ndarray],
           operands: Sequence[np.ndarray] = (), addresses: Sequence[int] = (),
           outputs: Sequence[np.ndarray | None] = ()) -> None:
    """Copy ``results`` into XLA's result buffers (each checked against its spec), or, with
    ``pieces``, each result's bytes out of the buffers ``results``; bytes already where they
    belong (an ``into`` call's function wrote XLA's buffer itself, or returned an aliased
    operand's view: ``operands`` and ``outputs`` are the views it was given, ``addresses``
    the operands') are not copied."""
    if call.pieces is not None:
        bases: dict[int, tuple[int, int]] = {}
        for b, n in call.need.items():
            buffer = results[b]
            if b < len(operands) and buffer is operands[b]:
                bases[b] = (addresses[b], call.operand_views[b][6])
            else:
                bases[b] = _base(buffer)
            if bases[b][1] < n:
                raise ValueError(f"hora.jax host call: buffer {b} holds {bases[b][1]} bytes, "
                                 f"{n} expected")
        memmove, words, starts = C.memmove, _WORDS, {b: at for b, (at, _) in bases.items()}
        items = _word(frame + _RETS) // _WORD - 1  # words[items + k]: result k's buffer struct
        for k, b, offset, n, alias in call.copies:  # the hot loop of a packed tree (inlined)
            if alias is not None and results[b] is operands[b]:
                continue  # reduced in place: XLA's result buffer already
            if outputs and offset == 0 and results[b] is outputs[k]:
                continue  # written into XLA's result buffer by the function
            target = words[words[items + k] // _WORD + _DATA_WORD] or _null()
            source = starts[b] + offset
            if target != source:
                memmove(target, source, n)
        return
    if len(results) != len(call.outs):
        raise ValueError(f"hora.jax host call: {len(results)} results, {len(call.outs)} "
                         "expected")
    for k, (result, (shape, dtype)) in enumerate(zip(results, call.outs)):
        if outputs and result is outputs[k]:
            continue  # the function wrote XLA's result buffer itself
        out = np.asarray(result)
        if out.shape != shape:
            raise ValueError(f"hora.jax host call: result {k} has shape {out.shape}, "
                             f"{shape} expected")
        if out.dtype != dtype:
            out = out.astype(dtype)
        if call.nbytes[k]:
            target, source = _buffer(_word(frame + _RETS), k) or _null(), _base(out)[0]
            if target != source:
                C.memmove(target, source, call.nbytes[k])


def _null() -> int:
    raise ValueError("hora.jax host call: XLA passed a result buffer without memory")


def _base(array: np.ndarray) -> tuple[int, int]:
    """The address and byte size of a C-contiguous copy-free view of ``array``."""
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return int(array.__array_interface__["data"][0]), int(array.nbytes)


def _error(frame: int, exc: BaseException) -> int | None:
    """An XLA_FFI_Error carrying ``exc``'s text (XLA raises it as the JAX runtime error)."""
    create = _ERROR_CREATE(_word(_word(frame + _API) + _API_ERROR_CREATE_OFFSET))
    message = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
    args = _ErrorCreateArgs(C.sizeof(_ErrorCreateArgs), None, message, _INTERNAL)
    result: int | None = create(C.byref(args))
    return result


def _metadata(extension: int) -> bool:
    """Answer XLA's metadata query when ``extension`` (the frame's first) is one."""
    if _ExtensionBase.from_address(extension).type != _METADATA:
        return False
    meta = _MetadataExtension.from_address(extension).metadata.contents
    meta.api_version.major, meta.api_version.minor = _API_VERSION
    if meta.struct_size >= _Metadata.traits.offset + 4:
        meta.traits = 0
    return True


def _handle(frame: int) -> int | None:
    """The FFI handler (``frame``: the call frame's address): answers XLA's metadata query,
    runs the call at the execute stage."""
    try:
        extension = _word(frame + _EXTENSION)
        if extension and _metadata(extension):
            return None
        if C.c_int.from_address(frame + _STAGE).value != _EXECUTE:
            return None
        call = _CALLS[C.c_int64.from_address(
            _word(_word(_word(frame + _ATTRS)) + _SCALAR_VALUE)).value]
        operands, addresses = _operands(frame, call)
        if call.into:
            outputs = _outputs(frame, call)
            _store(frame, call, call.fn(operands, outputs), operands, addresses, outputs)
        else:
            _store(frame, call, call.fn(operands), operands, addresses)
        return None
    except BaseException as exc:  # noqa: BLE001 - every error goes back to XLA, none escapes
        try:
            return _error(frame, exc)
        except BaseException:  # noqa: BLE001 - no API to report through: log, fail loudly
            log.exception("hora.jax host call failed and could not report it to XLA")
            raise


_HANDLER = C.CFUNCTYPE(_P, _P)(_handle)
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
