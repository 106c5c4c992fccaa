"""The host forms of the collectives other than allreduce: host arrays, over any route.

Each is a row of the executor's dispatch table (:data:`hora.core.data.executor._FORMS`), beside
its device form (:mod:`hora.core.data.device_exec`), and has one signature: (the executor that
runs it, the set's route, the response, this rank's op) -> the op's result. Allreduce is not
here: it fuses (:meth:`hora.core.data.executor.Executor._allreduce`).
"""

from __future__ import annotations

import numpy as np

from hora.collectives.ops import ReduceOp, scale_inplace
from hora.core.data import aligned
from hora.core.data.device_exec import Site, reducescatter_rows
from hora.core.data.routing import Route
from hora.core.op.entry import Buffer, Entry
from hora.core.op.messages import Response


def host(x: Buffer | None) -> np.ndarray:
    """``x`` as the host array the host forms work on (device buffers were staged before)."""
    assert isinstance(x, np.ndarray), "a host form got a device buffer"
    return x


def allgather(site: Site, route: Route, resp: Response, entry: Entry) -> Buffer:
    x = host(entry.tensor)
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    dims = resp.first_dims[0]
    out = aligned.empty((sum(dims),) + tuple(x.shape[1:]), x.dtype)
    route.allgather(x.reshape(-1), [d * row for d in dims], out.reshape(-1))
    return out


def broadcast(site: Site, route: Route, resp: Response, entry: Entry) -> Buffer:
    root = site.root_index(resp)
    x = host(entry.tensor)
    out = host(entry.output) if entry.output is not None else aligned.empty_like(x)
    if out is not x:
        np.copyto(out, x)
    route.broadcast(out.reshape(-1), root)
    return out


def alltoall(site: Site, route: Route, resp: Response, entry: Entry) -> tuple[Buffer, np.ndarray]:
    comm = route.comm
    x = host(entry.tensor)
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    matrix = resp.splits[0]
    me = comm.rank
    send = [s * row for s in matrix[me]]
    recv_rows = [matrix[j][me] for j in range(comm.size)]
    out = aligned.empty((sum(recv_rows),) + tuple(x.shape[1:]), x.dtype)
    route.alltoall(x.reshape(-1), send, out.reshape(-1), [r * row for r in recv_rows])
    return out, np.asarray(recv_rows, dtype=np.int32)


def reducescatter(site: Site, route: Route, resp: Response, entry: Entry) -> Buffer:
    comm = route.comm
    rows = reducescatter_rows(entry.tensor.shape[0], comm.size)
    x = host(entry.tensor)
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    buf = x.reshape(-1).copy()
    scale_inplace(buf, resp.prescale)
    out = aligned.empty((rows[comm.rank],) + tuple(x.shape[1:]), x.dtype)
    route.reducescatter(buf, [r * row for r in rows], ReduceOp(resp.op), out.reshape(-1),
                        site.scratch_for(buf.nbytes))
    postscale = resp.postscale / (comm.size if resp.op == ReduceOp.Average else 1)
    scale_inplace(out, postscale)
    return out


__all__ = ["allgather", "alltoall", "broadcast", "host", "reducescatter"]
