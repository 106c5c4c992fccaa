"""The collective API on numpy arrays: what every framework adapter calls.

Every function here enqueues one named op on the engine and returns a
:class:`~hora.core.op.handle.Handle`; the synchronous forms in :mod:`hora` are
``submit(...).wait()``.

Contract shared by every collective:

* all members of the process set must submit the op with the same ``name`` (automatic names
  ``<op>.noname.<n>`` match only if every rank issues its unnamed ops in the same order);
* dtype, and the shape rules of each op, must agree across ranks, otherwise the handle fails on
  every rank with :class:`~hora.errors.MismatchError` naming the field, the values and the ranks;
* inputs may be non-contiguous (a contiguous copy is made); in-place forms write the result back
  into the caller's array;
* argument errors (unknown dtype, bad splits, not a member of the set, duplicate in-flight name)
  are raised at submit time as ``TypeError`` / ``ValueError``;
* a lost peer or a shutdown fails the handle with :class:`~hora.errors.HoraInternalError`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hora.collectives.adasum import FLOAT_DTYPES, check_set
from hora.collectives.ops import DTYPE_NAMES, ReduceOp, check_dtype, dtype_name
from hora.core.data import aligned
from hora.core.engine import context
from hora.core.op.device import DeviceBuffer
from hora.core.op.entry import Buffer, Entry
from hora.core.op.handle import Handle
from hora.core.op.messages import OpKind, Request
from hora.core.op.process_set import ProcessSet, global_process_set
from hora.errors import HorovodInternalError

_ADASUM = ReduceOp.Adasum  # (an enum member through its class costs 100-200 ns in 3.11)


def resolve_op(op: int | None, average: bool | None) -> ReduceOp:
    """Horovod's ``op`` / deprecated ``average`` arguments -> a :class:`ReduceOp`.

    Raises:
        ValueError: both given.
    """
    if average is not None:
        if op is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of "
                             "them.")
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        return ReduceOp.Average if average else ReduceOp.Sum
    return ReduceOp.Average if op is None else ReduceOp(op)


def reducescatter_op(op: int | None) -> ReduceOp:
    """Resolve a reducescatter ``op`` (None: Average); others than Sum / Average raise
    HorovodInternalError, as Horovod does."""
    resolved = resolve_op(op, None)
    if resolved not in (ReduceOp.Sum, ReduceOp.Average):
        raise HorovodInternalError("Reducescatter currently only supports AVERAGE and SUM.")
    return resolved


def _set_ranks(ctx: context.Context, process_set: ProcessSet) -> tuple[int, tuple[int, ...]]:
    set_id = process_set.process_set_id
    ranks = None if set_id is None else ctx.engine.registry.members(set_id)
    if set_id is None or ranks is None:
        raise ValueError("Process set provided does not exist, or has not been registered.")
    if ctx.rank not in ranks:
        raise ValueError(f"Rank {ctx.rank} is not a member of the provided process set "
                         f"{list(ranks)}.")
    return set_id, ranks


def _check_adasum(tensor: Any, ranks: Sequence[int]) -> None:
    dtype = dtype_name(tensor.dtype if isinstance(tensor, DeviceBuffer)
                       else np.asarray(tensor).dtype)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"Adasum reduces floating-point tensors ({', '.join(FLOAT_DTYPES)}), "
                         f"not {dtype}.")
    check_adasum_set(ranks)


def check_adasum(dtype: Any, process_set: ProcessSet = global_process_set) -> None:
    """Raise now what an Adasum allreduce of ``dtype`` (a numpy dtype) on ``process_set``
    would raise when submitted: adapters call this at trace time.

    Raises:
        ValueError: not a floating-point dtype; an unknown set, or this rank not in it.
        NotImplementedError: as :func:`check_adasum_set`.
    """
    _, ranks = _set_ranks(context.get("allreduce"), process_set)
    _check_adasum(np.empty(0, dtype), ranks)


def check_adasum_set(ranks: Sequence[int]) -> None:
    """Raise unless the set of global ``ranks`` can run Adasum: 2^k ranks, or 2^k hosts when
    its allreduce runs hierarchically (:func:`hora.collectives.adasum.check_set`).

    Raises:
        NotImplementedError: Horovod's "non-power of 2" error, with the count.
    """
    ctx = context.get("Adasum")
    hosts = ctx.hostnames or ["localhost"] * ctx.size
    if all(0 <= r < len(hosts) for r in ranks):
        check_set([hosts[r] for r in ranks], ctx.config.hierarchical_allreduce)
    else:  # a set naming ranks this job does not have: no hosts to count
        check_set(["?"] * len(ranks), False)


def _full_name(ctx: context.Context, prefix: str, name: str | None, set_id: int) -> str:
    return ctx.engine.names.name(prefix, name, set_id)


def _contiguous(tensor: Any, what: str) -> Buffer:
    """``tensor`` as a contiguous host array, or as it is when it is a device buffer (an
    adapter makes those contiguous)."""
    if isinstance(tensor, DeviceBuffer):
        check_dtype(tensor.dtype, what)
        return tensor
    arr = np.asarray(tensor)
    check_dtype(arr.dtype, what)
    # not np.ascontiguousarray: it turns a 0-d array into shape (1,)
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def _empty_like(work: Buffer) -> Buffer:
    """A new result buffer shaped like ``work``, where ``work`` lives."""
    return work.empty(work.shape) if isinstance(work, DeviceBuffer) else aligned.empty_like(work)


def _first_rows(work: Buffer, rows: int) -> Buffer:
    """The first ``rows`` rows of ``work`` (a view)."""
    if isinstance(work, DeviceBuffer):
        tail = work.shape[1:]
        return work.part(0, rows * math.prod(tail)).view((rows, *tail))
    return work[:rows]


def _entry(request: Request, tensor: Buffer, output: Buffer | None,
           finish: Callable[[Any], Any] | None = None, sync: bool = False) -> Entry:
    return Entry(request=request, tensor=tensor, output=output,
                 handle=Handle(request.name, request.set_id), finish=finish, sync=sync)


def _submit(ctx: context.Context, request: Request, tensor: Buffer,
            output: Buffer | None, finish: Callable[[Any], Any] | None = None,
            sync: bool = False) -> Handle:
    entry = _entry(request, tensor, output, finish, sync)
    ctx.engine.submit(entry)
    return entry.handle


def _writeback(target: np.ndarray, work: Buffer) -> Callable[[Any], Any] | None:
    """When ``work`` is a contiguous copy of a non-contiguous in-place target, copy back."""
    if work is target:
        return None

    def finish(result: Any) -> Any:
        np.copyto(target, result)
        return target

    return finish


REQUEST_CACHE = 4096
"""Named allreduce requests kept for reuse (a :class:`Request` is never changed once made)."""

_requests: dict[tuple[int, str], tuple[tuple[Any, ...], Request]] = {}


def _request(name: str, rank: int, set_id: int, dtype: str, shape: tuple[int, ...], op: int,
             prescale: float, postscale: float, device: str, group: str) -> Request:
    return Request(name=name, kind=OpKind.ALLREDUCE, rank=rank, set_id=set_id, dtype=dtype,
                   shape=list(shape), op=int(op), prescale=float(prescale),
                   postscale=float(postscale), device=device, group=group)


def allreduce_async(tensor: Any, *, name: str | None = None, op: int = ReduceOp.Average,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set,
                    inplace: bool = False, output: np.ndarray | None = None,
                    prefix: str = "allreduce", device: str = "cpu", sync: bool = False,
                    group: str = "") -> Handle:
    """Reduce ``tensor`` element-wise across the set: ``postscale * op(prescale * x_i)``.

    Average divides the Sum by the set size (integer dtypes truncate toward zero, as Horovod).
    Resolves to the result array (``tensor`` itself when ``inplace``; ``output`` when given).
    ``device`` is the kind of device the caller's tensor lives on (``"cpu"``, ``"cuda"``); ranks
    that disagree get Horovod's "CPU/GPU device selection" mismatch error. ``sync=True``
    promises that the caller waits for the handle at once (sync wrappers; internal).
    """
    ctx = context.current
    if ctx is None:
        ctx = context.get("allreduce")  # raises NotInitializedError
    entry = allreduce_entry(ctx, tensor, name, op, prescale_factor, postscale_factor,
                            process_set, inplace, output, prefix, device, sync, group)
    ctx.engine.submit(entry)
    return entry.handle


def allreduce_entry(ctx: context.Context, tensor: Any, name: str | None, op: int,
                    prescale_factor: float, postscale_factor: float,
                    process_set: ProcessSet, inplace: bool, output: np.ndarray | None,
                    prefix: str, device: str, sync: bool, group: str) -> Entry:
    """Check an allreduce's arguments and build its entry (see :func:`allreduce_async`; for
    calls that submit several ops, :mod:`hora.core.frontend.grouped`). Every step of a training loop
    runs this: what passes costs no call beyond the objects the op needs."""
    if type(op) is not ReduceOp:
        op = ReduceOp(op)
    set_id = process_set.process_set_id
    ranks = None if set_id is None else ctx.engine.registry.member_ranks.get(set_id)
    if set_id is None or ranks is None or ctx.rank not in ranks:
        set_id, ranks = _set_ranks(ctx, process_set)  # raises what is wrong
    if op is _ADASUM:
        _check_adasum(tensor, ranks)
    original = tensor
    if type(tensor) is np.ndarray and tensor.flags.c_contiguous:
        work: Buffer = tensor
        dtype = DTYPE_NAMES.get(tensor.dtype) or check_dtype(tensor.dtype, "allreduce input")
    else:
        work = _contiguous(tensor, "allreduce input")
        dtype = check_dtype(work.dtype)
    finish = None
    out: Buffer
    if inplace:
        if isinstance(original, np.ndarray):  # (first: no isinstance of an ABC)
            out = work
            finish = None if work is original else _writeback(original, work)
        elif isinstance(original, DeviceBuffer):  # contiguous: the result lands in it
            out = work
        else:
            raise TypeError("in-place allreduce needs a numpy array")
    elif output is not None:
        out = output
    elif type(work) is np.ndarray:
        out = aligned.empty(work.shape, work.dtype)
    else:
        out = _empty_like(work)
    if name:  # a named op's request repeats step after step: one object while it is equal
        full = f"{prefix}.{name}"
        key = (ctx.rank, dtype, work.shape, op, prescale_factor, postscale_factor, device, group)
        known = _requests.get((set_id, full))
        if known is not None and known[0] == key:
            req = known[1]
        else:
            req = _request(full, ctx.rank, set_id, dtype, work.shape, op, prescale_factor,
                           postscale_factor, device, group)
            if len(_requests) >= REQUEST_CACHE:
                _requests.clear()
            _requests[(set_id, full)] = (key, req)
    else:
        full = ctx.engine.names.name(prefix, None, set_id)
        req = _request(full, ctx.rank, set_id, dtype, work.shape, op, prescale_factor,
                       postscale_factor, device, group)
    return Entry(req, work, out, Handle(full, set_id), finish, sync)  # (positional: ~90 ns less)


def allgather_async(tensor: Any, *, name: str | None = None,
                    process_set: ProcessSet = global_process_set, prefix: str = "allgather",
                    device: str = "cpu", group: str = "", sync: bool = False) -> Handle:
    """Concatenate every rank's tensor along dimension 0, in rank order within the set.

    First dimensions may differ across ranks; the other dimensions must agree. ``sync``: the
    caller waits at once (see :func:`allreduce_async`).
    """
    ctx = context.get("allgather")
    entry = allgather_entry(ctx, tensor, name, process_set, prefix, device, group, sync)
    ctx.engine.submit(entry)
    return entry.handle


def allgather_entry(ctx: context.Context, tensor: Any, name: str | None,
                    process_set: ProcessSet, prefix: str, device: str, group: str,
                    sync: bool) -> Entry:
    """Check an allgather's arguments and build its entry (see :func:`allgather_async`)."""
    set_id, _ = _set_ranks(ctx, process_set)
    work = _contiguous(tensor, "allgather input")
    req = Request(name=_full_name(ctx, prefix, name, set_id), kind=OpKind.ALLGATHER, rank=ctx.rank,
                  set_id=set_id, dtype=check_dtype(work.dtype), shape=list(work.shape),
                  device=device, group=group)
    return _entry(req, work, None, None, sync)


def broadcast_async(tensor: Any, root_rank: int, *, name: str | None = None,
                    process_set: ProcessSet = global_process_set,
                    inplace: bool = False, device: str = "cpu") -> Handle:
    """Copy ``root_rank``'s tensor (a global rank, member of the set) to every member."""
    ctx = context.get("broadcast")
    set_id, ranks = _set_ranks(ctx, process_set)
    if root_rank not in ranks:
        raise ValueError(f"broadcast received invalid root rank {root_rank}: process set has "
                         f"ranks {list(ranks)}")
    original = tensor
    work = _contiguous(tensor, "broadcast input")
    finish = _writeback(original, work) if inplace and isinstance(original, np.ndarray) else None
    out = work if inplace else _empty_like(work)
    req = Request(name=_full_name(ctx, "broadcast", name, set_id), kind=OpKind.BROADCAST,
                  rank=ctx.rank, set_id=set_id, dtype=check_dtype(work.dtype),
                  shape=list(work.shape), root=int(root_rank), device=device)
    return _submit(ctx, req, work, out, finish)


def alltoall_async(tensor: Any, splits: Sequence[int] | None = None, *, name: str | None = None,
                   process_set: ProcessSet = global_process_set, device: str = "cpu") -> Handle:
    """Send ``splits[j]`` rows (dimension 0) to rank ``j``; resolves to
    ``(received, received_splits)``. Without ``splits`` the rows are divided evenly (the first
    dimension must then be divisible by the set size). As in Horovod, rows beyond
    ``sum(splits)`` are not sent."""
    ctx = context.get("alltoall")
    set_id, ranks = _set_ranks(ctx, process_set)
    work = _contiguous(tensor, "alltoall input")
    if work.ndim == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    n = len(ranks)
    if splits is None:
        if work.shape[0] % n:
            raise ValueError(f"splits not provided, but first dimension of tensor is not an even "
                             f"multiple of the number of workers: alltoall without splits needs "
                             f"the first dimension ({work.shape[0]}) to be divisible by the "
                             f"number of ranks ({n})")
        split_list = [work.shape[0] // n] * n
    else:
        split_list = [int(s) for s in np.asarray(splits).reshape(-1)]
        if len(split_list) != n or any(s < 0 for s in split_list):
            raise ValueError(f"alltoall splits must have one non-negative entry per rank ({n}), "
                             f"got {split_list}")
        if sum(split_list) > work.shape[0]:
            raise ValueError(f"alltoall splits sum to {sum(split_list)}, more than the first "
                             f"dimension {work.shape[0]}")
        if sum(split_list) < work.shape[0]:
            work = _first_rows(work, sum(split_list))
    req = Request(name=_full_name(ctx, "alltoall", name, set_id), kind=OpKind.ALLTOALL,
                  rank=ctx.rank, set_id=set_id, dtype=check_dtype(work.dtype),
                  shape=list(work.shape), splits=split_list, device=device)
    return _submit(ctx, req, work, None)


def reducescatter_async(tensor: Any, *, name: str | None = None, op: int = ReduceOp.Average,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set: ProcessSet = global_process_set,
                        prefix: str = "reducescatter", device: str = "cpu",
                        group: str = "") -> Handle:
    """Reduce across the set, then give rank ``i`` its share of dimension 0 (the first
    ``dim0 % size`` ranks get one extra row). Ops: Sum and Average."""
    ctx = context.get("reducescatter")
    set_id, _ = _set_ranks(ctx, process_set)
    op = reducescatter_op(op)
    work = _contiguous(tensor, "reducescatter input")
    if work.ndim == 0:
        raise ValueError("Reducescatter does not support scalar inputs: reducescatter needs a "
                         "tensor with at least one dimension")
    req = Request(name=_full_name(ctx, prefix, name, set_id), kind=OpKind.REDUCESCATTER,
                  rank=ctx.rank, set_id=set_id, dtype=check_dtype(work.dtype),
                  shape=list(work.shape), op=int(op), prescale=float(prescale_factor),
                  postscale=float(postscale_factor), device=device, group=group)
    return _submit(ctx, req, work, None)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every member of the set has called ``barrier``."""
    ctx = context.get("barrier")
    set_id, _ = _set_ranks(ctx, process_set)
    req = Request(name=_full_name(ctx, "barrier", None, set_id), kind=OpKind.BARRIER, rank=ctx.rank,
                  set_id=set_id)
    _submit(ctx, req, np.empty(0, np.uint8), None).wait()


def join(process_set: ProcessSet = global_process_set) -> int:
    """Mark this rank as out of data; returns the last rank to join once all have.

    While joined, this rank contributes zeros to other ranks' allreduces (Average keeps the full
    divisor); other collectives fail while any rank is joined.
    """
    ctx = context.get("join")
    set_id, _ = _set_ranks(ctx, process_set)
    req = Request(name="join", kind=OpKind.JOIN, rank=ctx.rank, set_id=set_id)
    return int(_submit(ctx, req, np.empty(0, np.uint8), None).wait())


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a new process set on every rank (collective: all ranks call it in order).

    Raises:
        ValueError: dynamic process sets are off, or the set already exists.
    """
    ctx = context.get("add_process_set")
    if not context.dynamic_process_sets():
        raise ValueError("add_process_set needs dynamic process sets: set "
                         "HOROVOD_DYNAMIC_PROCESS_SETS=1 or call init(process_sets='dynamic').")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.mpi_comm is not None:
        raise NotImplementedError("process sets from MPI communicators cannot be added")
    bad = [r for r in ps.ranks if not 0 <= r < ctx.size]
    if bad or not ps.ranks:
        raise ValueError(f"process set ranks {ps.ranks} must be non-empty and within "
                         f"0..{ctx.size - 1}")
    if ctx.engine.registry.find(ps.ranks) is not None:
        raise ValueError(f"Attempted to add a duplicate process set: {ps.ranks}")
    req = Request(name=f"add_process_set.{ps.ranks}", kind=OpKind.ADD_PROCESS_SET,
                  rank=ctx.rank, set_id=0, ranks=list(ps.ranks))
    ps.process_set_id = int(_submit(ctx, req, np.empty(0, np.uint8), None).wait())
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set on every rank (collective). False for the global or an unknown set."""
    ctx = context.get("remove_process_set")
    set_id = process_set.process_set_id
    if set_id in (None, 0) or ctx.engine.registry.ranks(set_id) is None:
        return False
    req = Request(name=f"remove_process_set.{set_id}", kind=OpKind.REMOVE_PROCESS_SET,
                  rank=ctx.rank, set_id=0, root=set_id)
    _submit(ctx, req, np.empty(0, np.uint8), None).wait()
    process_set.process_set_id = None
    return True


# ---- integer handles (Horovod's async API; one table shared by every adapter) ---------------
def poll(handle: int) -> bool:
    """True if the async op behind ``handle`` has finished; ``synchronize`` will not block.

    Raises:
        ValueError: unknown handle ("Handle N was not created or has been cleared.").
    """
    return bool(context.get("poll").handles.get(handle).done())


def synchronize(handle: int, timeout: float | None = None) -> Any:
    """Wait for an async op and return its output (what the adapter registered it to give: an
    array or tensor; ``(output, received_splits)`` for alltoall; a list for grouped ops). An
    unknown handle returns None, as Horovod.

    Args:
        timeout: hora extension; seconds to wait (None: until done or failed).

    Raises:
        HorovodInternalError: the op failed (mismatch across ranks, lost peer, shutdown).
    """
    h = context.get("synchronize").handles.pop(handle)
    if h is None:
        return None
    return h.wait(timeout)
