"""One rule for "do these ops agree" and "may these ops fuse", for both paths an op can take.

The coordinator (the negotiated path) checks that every rank's request for a name has the same
:func:`signature`, and fuses consecutive allreduces whose :func:`fusion_key` is equal. The fast
lane (the cached path, :mod:`hora.core.lane.fastlane`) treats a new request as a *hit* only if its
signature equals the cached response's, and fuses cached ops by the same fusion key. So a field
that must agree on the negotiated path (the device included) can never be skipped by a cached
name: a request that differs is a miss, negotiated, and fails there with the coordinator's
message on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from hora.core.op.messages import OpKind, Request, Response

Signature = tuple[object, ...]
"""What every rank's request for one name must agree on."""

_FIRST_DIM_FREE = (OpKind.ALLGATHER, OpKind.ALLTOALL)  # dimension 0 may differ across ranks


def signature(kind: OpKind, dtype: str, device: str, shape: Sequence[int], op: int,
              prescale: float, postscale: float, root: int) -> Signature:
    """The fields that must be equal on every rank (allgather / alltoall: all dimensions but
    the first)."""
    dims = tuple(shape[1:]) if kind in _FIRST_DIM_FREE else tuple(shape)
    return (kind, dtype, device, dims, len(shape), op, prescale, postscale, root)


def request_signature(r: Request) -> Signature:
    """:func:`signature` of one rank's request."""
    return signature(r.kind, r.dtype, r.device, r.shape, r.op, r.prescale, r.postscale, r.root)


def agrees(sig: Signature, r: Request) -> bool:
    """``request_signature(r) == sig``, without building the tuple (the fast lane's hit test
    runs this for every allreduce)."""
    kind, dtype, device, dims, ndim, op, prescale, postscale, root = sig
    shape = r.shape
    return (r.kind is kind and r.dtype == dtype and r.device == device and len(shape) == ndim
            and r.op == op and r.prescale == prescale and r.postscale == postscale
            and r.root == root
            and tuple(shape[1:] if kind in _FIRST_DIM_FREE else shape) == dims)


def response_signature(resp: Response, index: int = 0) -> Signature:
    """:func:`signature` of the agreed request behind ``resp.names[index]`` (for the fast
    lane's cache: a later request is a hit only if its signature equals this)."""
    return signature(resp.kind, resp.dtype, resp.device, resp.shapes[index], resp.op,
                     resp.prescale, resp.postscale, resp.root)


class FusionKey(NamedTuple):
    """Allreduces fuse into one buffer only if these are equal: one process set, dtype,
    device, op and pair of scale factors per collective, and with
    ``HORA_DISABLE_GROUP_FUSION`` the group (:attr:`Response.group`)."""

    kind: OpKind
    set_id: int
    dtype: str
    device: str
    op: int
    prescale: float
    postscale: float
    group: str


def fusable(resp: Response) -> bool:
    """Whether ``resp`` may be fused with others of its :class:`FusionKey` by the coordinator:
    allreduces, except a joined set's (zeros stand in for the joined ranks). Fused Adasum
    tensors keep their own coefficients (the executor passes their sizes), as Horovod's."""
    return resp.kind is OpKind.ALLREDUCE and not resp.joined


def lane_fusable(resp: Response) -> bool:
    """Whether ``resp`` may run (and fuse) in the fast lane: :func:`fusable` (Adasum included:
    in a lane it is gathered over the lane's shared memory, never sent over the set's TCP
    comm, which is the engine thread's)."""
    return fusable(resp)


def fusion_key(resp: Response) -> FusionKey:
    """The :class:`FusionKey` of a response."""
    return FusionKey(resp.kind, resp.set_id, resp.dtype, resp.device, resp.op, resp.prescale,
                     resp.postscale, resp.group)
