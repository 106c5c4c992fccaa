"""Tensor fusion on the negotiated path: ready allreduces packed into one, up to a threshold.

Rank 0's coordinator (:mod:`hora.core.engine.coordinator`) merges the allreduce responses that
became ready together when they may fuse (:func:`~hora.core.op.agreement.fusion_key`: the same
process set, dtype, op and scale factors) and their bytes stay within
``HOROVOD_FUSION_THRESHOLD``. The fast lane fuses cached ops by the same key in
:mod:`hora.core.lane.lane_leader`.
"""

from __future__ import annotations

from hora.collectives.ops import to_dtype
from hora.core.op.agreement import fusable, fusion_key
from hora.core.op.messages import Response


def fuse(responses: list[Response], threshold: int) -> list[Response]:
    """``responses`` with the allreduces that agree on set/dtype/op/scales merged, in order,
    each merged response at most ``threshold`` bytes (0 or less: nothing is merged). A response
    is merged into the first open one of its key; the merged responses keep the position of
    their first member."""
    if threshold <= 0:
        return responses
    out: list[Response] = []
    open_: dict[tuple[object, ...], tuple[Response, int]] = {}
    for resp in responses:
        if not fusable(resp):
            out.append(resp)
            continue
        nbytes = nelems(resp.shapes[0]) * to_dtype(resp.dtype).itemsize
        key = fusion_key(resp)
        current = open_.get(key)
        if current is not None and current[1] + nbytes <= threshold:
            fused, size = current
            fused.names.extend(resp.names)
            fused.shapes.extend(resp.shapes)
            open_[key] = (fused, size + nbytes)
            continue
        out.append(resp)
        open_[key] = (resp, nbytes)
    return out


def nelems(shape: list[int]) -> int:
    """Elements of a tensor of ``shape``."""
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = ["fuse", "nelems"]
