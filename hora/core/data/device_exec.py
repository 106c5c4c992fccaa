"""The executor's forms for device buffers: each collective of a response whose ops stay on
their device (:mod:`hora.core.op.device`), over a route that takes them (the torch data plane).

The same steps as the host forms in :mod:`hora.core.data.executor`, in the buffer's own kernels:
fused allreduces are packed into one buffer on the device (a rank that has joined contributes
zeros there), scaled (prescale before, postscale and Average's division after, with Horovod's
arithmetic), reduced by the plane, and cut back into each op's output; the other collectives
get outputs allocated on the device. Every member of a set runs the same plane calls in the same
order whichever form each rank uses, so a rank whose ops are host arrays (a joined rank with no
device allocator, hora's numpy API on the CPU) meets the others. Where a device buffer meets a
route that moves host memory only, :func:`stage` turns it into a host array first.

The forms of the collectives other than allreduce share one signature, :data:`Form`: the
executor's dispatch table (:data:`hora.core.data.executor._FORMS`) pairs each with its host form.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from hora.collectives.comm import Comm
from hora.collectives.ops import ReduceOp, to_dtype
from hora.core.data import aligned
from hora.core.op.device import DeviceBuffer, allocator, scale
from hora.core.op.entry import Entry
from hora.core.op.messages import Response

Done = Callable[[Entry, Any], None]


class DeviceRoute(Protocol):
    """A route whose collectives take device buffers as they are (``native``, e.g.
    :class:`~hora.core.data.plane_route.PlaneRoute` over the torch plane)."""

    comm: Comm

    def allreduce(self, buf: DeviceBuffer, op: ReduceOp, scratch: np.ndarray,
                  counts: Sequence[int] | None = None, *, postscale: float = 1.0) -> None: ...

    def allgather(self, sendbuf: DeviceBuffer, counts: Sequence[int],
                  out: DeviceBuffer) -> None: ...

    def broadcast(self, buf: DeviceBuffer, root: int) -> None: ...

    def alltoall(self, sendbuf: DeviceBuffer, send_counts: Sequence[int],
                 recvbuf: DeviceBuffer, recv_counts: Sequence[int]) -> None: ...

    def reducescatter(self, buf: DeviceBuffer, counts: Sequence[int], op: ReduceOp,
                      out: DeviceBuffer, scratch: np.ndarray) -> None: ...


class Site(Protocol):
    """What a form asks of the executor that runs it."""

    def root_index(self, resp: Response) -> int:
        """A broadcast's root as an index into its set's members."""
        ...

    def scratch_for(self, nbytes: int) -> np.ndarray:
        """A scratch buffer of at least ``nbytes``."""
        ...


Form = Callable[[DeviceRoute, Response, Entry, Site], Any]
"""A device form of one collective (not allreduce): (route, response, this rank's op, the
executor) -> the op's result."""


def reducescatter_rows(rows: int, size: int) -> list[int]:
    """Horovod's split of ``rows`` among ``size`` ranks: the first ``rows % size`` get one more."""
    base, extra = divmod(rows, size)
    return [base + (1 if i < extra else 0) for i in range(size)]


def _buffer(x: Any) -> DeviceBuffer:
    assert isinstance(x, DeviceBuffer), "a device form got a host array"
    return x


def template(resp: Response, local: Sequence[Entry | None]) -> DeviceBuffer | None:
    """A device buffer to allocate the response's buffers like: one of this rank's inputs, or
    (a rank that joined) an empty one from the allocator of the agreed device; None when this
    rank has neither (it then runs the host form)."""
    for entry in local:
        if entry is not None and isinstance(entry.tensor, DeviceBuffer):
            return entry.tensor
    make = allocator(resp.device)
    return None if make is None else make((0,), to_dtype(resp.dtype))


def allreduce(route: DeviceRoute, resp: Response, local: Sequence[Entry | None], like: DeviceBuffer,
              scratch: np.ndarray, done: Done) -> None:
    """:meth:`Executor._allreduce` on device buffers (``like``: :func:`template`)."""
    sizes = [math.prod(s) for s in resp.shapes]
    total = sum(sizes)
    single = len(resp.names) == 1 and not resp.joined
    if single:
        entry = local[0]
        assert entry is not None and entry.output is not None
        out = _buffer(entry.output)
        if out is not entry.tensor:
            out.assign(_buffer(entry.tensor))
        buf = out.view((total,))
    else:  # one copy in (a rank that joined contributes zeros for what it lacks)
        buf = like.pack([None if e is None else _buffer(e.tensor) for e in local], sizes)
    op = ReduceOp(resp.op)
    postscale = resp.postscale / (route.comm.size if op is ReduceOp.Average else 1)
    scale(buf, resp.prescale)
    route.allreduce(buf, op, scratch,
                    counts=sizes if op is ReduceOp.Adasum and not single else None,
                    postscale=postscale)
    if single:
        assert local[0] is not None
        done(local[0], local[0].output)
        return
    outs: list[DeviceBuffer | None] = []
    offset = 0
    for entry, n in zip(local, sizes):
        if entry is None:  # joined: its piece stays where it is (and the others are copies)
            outs.append(buf.part(offset, offset + n))
        else:
            outs.append(None if entry.output is None else _buffer(entry.output))
        offset += n
    pieces = buf.unpack(sizes, [tuple(s) for s in resp.shapes], outs)
    for entry, piece in zip(local, pieces):
        if entry is not None:
            entry.output = piece
            done(entry, piece)


def allgather(route: DeviceRoute, resp: Response, entry: Entry, site: Site) -> DeviceBuffer:
    x = _buffer(entry.tensor)
    row = math.prod(x.shape[1:])
    dims = resp.first_dims[0]
    out = x.empty((sum(dims),) + tuple(x.shape[1:]))
    route.allgather(x.view((x.size,)), [d * row for d in dims],
                    out.view((out.size,)))
    return out


def broadcast(route: DeviceRoute, resp: Response, entry: Entry, site: Site) -> DeviceBuffer:
    root = site.root_index(resp)
    x = _buffer(entry.tensor)
    out = _buffer(entry.output) if entry.output is not None else x.empty(x.shape)
    if out is not x:
        out.assign(x)
    route.broadcast(out.view((out.size,)), root)
    return out


def alltoall(route: DeviceRoute, resp: Response, entry: Entry,
             site: Site) -> tuple[DeviceBuffer, np.ndarray]:
    comm = route.comm
    x = _buffer(entry.tensor)
    row = math.prod(x.shape[1:])
    matrix = resp.splits[0]
    me = comm.rank
    recv_rows = [matrix[j][me] for j in range(comm.size)]
    out = x.empty((sum(recv_rows),) + tuple(x.shape[1:]))
    route.alltoall(x.view((x.size,)), [s * row for s in matrix[me]],
                   out.view((out.size,)), [r * row for r in recv_rows])
    return out, np.asarray(recv_rows, dtype=np.int32)


def reducescatter(route: DeviceRoute, resp: Response, entry: Entry, site: Site) -> DeviceBuffer:
    comm = route.comm
    rows = reducescatter_rows(entry.tensor.shape[0], comm.size)
    scratch = site.scratch_for(entry.tensor.nbytes)
    x = _buffer(entry.tensor)
    row = math.prod(x.shape[1:])
    buf = x.empty((x.size,))
    buf.assign(x)
    scale(buf, resp.prescale)
    out = x.empty((rows[comm.rank],) + tuple(x.shape[1:]))
    op = ReduceOp(resp.op)
    route.reducescatter(buf, [r * row for r in rows], op,
                        out.view((out.size,)), scratch)
    scale(out, resp.postscale / (comm.size if op is ReduceOp.Average else 1))
    return out


def stage(entry: Entry) -> None:
    """Turn ``entry``'s device buffers into host arrays, for a path that moves host memory
    only; its result is copied back onto the device when the op completes (an in-place op's
    into its own buffer, an allreduce's or broadcast's into its output; the results of the
    others reach the adapter as host arrays, which it places like the input)."""
    dev = entry.tensor
    if not isinstance(dev, DeviceBuffer):
        return
    host = dev.to_host()
    out = entry.output
    target = out if isinstance(out, DeviceBuffer) else None
    entry.tensor = host
    if out is dev:
        entry.output = host
    elif target is not None:
        entry.output = aligned.empty(target.shape, target.dtype)
    after = entry.finish

    def finish(result: Any) -> Any:
        if target is not None:
            target.load(result)
            result = target
        return after(result) if after is not None else result

    entry.finish = finish


def holds_device(entry: Entry | None) -> bool:
    """Whether ``entry`` carries a device buffer."""
    return entry is not None and isinstance(entry.tensor, DeviceBuffer)


__all__ = ["DeviceRoute", "Form", "Site", "allgather", "allreduce", "alltoall", "broadcast",
           "holds_device", "reducescatter", "reducescatter_rows", "stage", "template"]
