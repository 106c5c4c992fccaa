"""The engine's timeline marks for negotiation (Horovod's NEGOTIATE_* phases and QUEUE)."""

from __future__ import annotations

from hora.core.op.messages import OpKind, Request, Response
from hora.core.op.process_set import Registry
from hora.timeline.writer import QUEUE, Timeline


def negotiation_ready(tl: Timeline, registry: Registry, requests: list[Request]) -> None:
    """Rank 0: one readiness tick per request (rank within its process set)."""
    if not tl.recording:
        return
    for req in requests:
        if req.kind is OpKind.JOIN:
            continue
        members = registry.members(req.set_id) or ()
        rank = members.index(req.rank) if req.rank in members else req.rank
        tl.negotiate_rank_ready(req.name, rank, req.kind)


def negotiation_done(tl: Timeline, responses: list[Response]) -> None:
    """Negotiation is over: each op starts (waiting in QUEUE until it runs) or failed."""
    if not tl.recording:
        return
    for resp in responses:
        if resp.kind is OpKind.JOIN:
            continue
        for name in resp.names:
            tl.negotiate_end(name)
            if resp.kind is OpKind.ERROR:
                tl.error(name, resp.error)
            else:
                tl.op_start(name, resp.kind)
                tl.activity_start(name, QUEUE)
