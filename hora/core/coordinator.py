"""Negotiation on the coordinator (global rank 0): which named ops are ready everywhere.

Every rank sends its :class:`~hora.core.messages.Request` objects to rank 0. The coordinator
keeps a table name -> requests; a name is *ready* when every member of its process set has
submitted it (or has joined). Ready requests are validated (dtype, shape, op, root, scale factors
must agree; otherwise one ERROR response with the same text for every rank), turned into
:class:`~hora.core.messages.Response` objects, and small allreduces are fused up to the fusion
threshold. One coordinator serves every process set, so all ranks see responses in one total
order and can never execute two sets' collectives in different orders.

The stall inspector lives here too: it names tensors that some ranks submitted and others did not.
So does the deadlock detector (:meth:`Coordinator.check_deadlocks`): ranks report the ops they
have been blocked in for a while, and when no blocked rank can ever be released (each waits for
an op that some other blocked rank never submitted), the blocked ops fail on every rank at once.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from hora._util.log import get_logger
from hora.collectives.ops import ReduceOp, to_dtype
from hora.config import Config
from hora.core.agreement import fusion_key, request_signature
from hora.core.handle import BLOCKED_AFTER_S
from hora.core.messages import OpKind, Request, Response
from hora.core.process_set import Registry

log = get_logger(__name__)

_FUSABLE = (OpKind.ALLREDUCE,)
_JOIN_UNSUPPORTED = {
    OpKind.ALLGATHER: "Allgather", OpKind.BROADCAST: "Broadcast",
    OpKind.ALLTOALL: "Alltoall", OpKind.REDUCESCATTER: "Reducescatter",
}


@dataclass
class _Wait:
    """A rank blocked in a wait on one op (``count`` threads)."""

    count: int
    lane: bool  # the op was in the fast lane when the wait began (unknown to the coordinator)


@dataclass
class _Pending:
    requests: dict[int, Request] = field(default_factory=dict)
    first_seen: float = 0.0
    warned_at: float = 0.0
    joined: list[int] = field(default_factory=list)  # joined ranks when it became ready


class Coordinator:
    """Rank 0's negotiation state for every process set."""

    def __init__(self, registry: Registry, config: Config) -> None:
        self._registry = registry
        self._config = config
        self._table: dict[tuple[int, str], _Pending] = {}
        self._order: list[tuple[int, str]] = []
        self._joined: dict[int, list[int]] = {}
        self._departed: dict[int, str] = {}
        self._out: list[Response] = []
        self._ready_keys: list[tuple[int, str]] = []  # complete, in the order they completed
        self._ready_set: set[tuple[int, str]] = set()
        self._hold_until: float | None = None
        # Deadlock detection: rank -> (set, name) -> wait; a suspected deadlock and since when.
        self._waits: dict[int, dict[tuple[int, str], _Wait]] = {}
        self._suspect: tuple[object, ...] | None = None
        self._suspect_since = 0.0

    # ---- input -------------------------------------------------------------------------------
    def add(self, requests: list[Request]) -> None:
        """Record requests from one rank."""
        now = time.monotonic()
        for req in requests:
            members = self._registry.ranks(req.set_id)
            if members is None:
                self._out.append(_error(req, f"Process set {req.set_id} provided does not exist, "
                                             "or has not been registered."))
                continue
            if req.rank not in members:
                log.warning("ignoring request for '%s' from rank %d, which is not a member of "
                            "process set %d %s", req.name, req.rank, req.set_id, members)
                continue
            if req.kind is OpKind.JOIN:
                self._join(req, members)
                continue
            key = (req.set_id, req.name)
            entry = self._table.get(key)
            if entry is None:
                entry = self._table[key] = _Pending(first_seen=now)
                self._order.append(key)
            entry.requests[req.rank] = req
            gone = [r for r in members if r in self._departed]
            if gone:
                del self._table[key]
                self._order.remove(key)
                self._drop_ready(key)
                why = "; ".join(f"rank {r}: {self._departed[r]}" for r in gone)
                self._out.append(_error(
                    req, f"Horovod has been shut down: op '{req.name}' needs ranks that "
                         f"already shut down ({why}).", ERROR_SHUTDOWN))
                continue
            self._note_if_ready(key)

    def _drop_ready(self, key: tuple[int, str]) -> None:
        if key in self._ready_set:
            self._ready_set.discard(key)
            self._ready_keys.remove(key)

    def depart(self, rank: int, reason: str) -> None:
        """A rank shut down cleanly: ops that need it can never complete."""
        self._departed[rank] = reason
        for key in list(self._order):
            set_id, name = key
            members = self._registry.ranks(set_id) or []
            if rank in members and key not in self._ready_set:
                entry = self._table.pop(key)
                self._order.remove(key)
                any_req = next(iter(entry.requests.values()))
                self._out.append(_error(any_req, f"Horovod has been shut down: rank {rank} shut "
                                                 f"down ({reason}) before submitting '{name}'.",
                                      ERROR_SHUTDOWN))
        for set_id, joined in self._joined.items():  # a join it never joined can't finish
            members = self._registry.ranks(set_id) or []
            if joined and rank in members and rank not in joined:
                self._joined[set_id] = []
                self._out.append(Response(
                    kind=OpKind.ERROR, names=["join"], set_id=set_id, value=ERROR_SHUTDOWN,
                    error=f"Horovod has been shut down: rank {rank} shut down ({reason}) "
                          f"without calling join(); ranks {sorted(joined)} waited in join."))

    def _join(self, req: Request, members: list[int]) -> None:
        joined = self._joined.setdefault(req.set_id, [])
        if req.rank not in joined:
            joined.append(req.rank)
        for key in self._order:  # a join can complete tensors the joined rank never submits
            if key[0] == req.set_id:
                self._note_if_ready(key)
        if set(joined) >= set(members):
            self._joined[req.set_id] = []
            self._out.append(Response(kind=OpKind.JOIN, names=[req.name], set_id=req.set_id,
                                      value=req.rank))

    # ---- output ------------------------------------------------------------------------------
    def _complete(self, key: tuple[int, str]) -> bool:
        entry = self._table.get(key)
        members = self._registry.ranks(key[0])
        if entry is None or members is None:
            return False
        have = set(entry.requests) | set(self._joined.get(key[0], ()))
        return have >= set(members)

    def _note_if_ready(self, key: tuple[int, str]) -> None:
        if key not in self._ready_set and self._complete(key):
            entry = self._table[key]
            # Remember who had joined now: the join that completes a set resets the list.
            entry.joined = sorted(set(self._joined.get(key[0], ())) - set(entry.requests))
            self._ready_set.add(key)
            self._ready_keys.append(key)
            if self._hold_until is None:
                self._hold_until = time.monotonic() + self._config.cycle_time / 1000.0

    def next_deadline(self) -> float | None:
        """When held responses become due (``HORA_CYCLE_TIME`` > 0), as ``time.monotonic()``."""
        return self._hold_until if self._ready_keys else None

    def ready(self, now: float | None = None) -> list[Response]:
        """Pop every response that can run now, fused, in execution order.

        With ``HORA_CYCLE_TIME`` > 0, tensors that became ready are held until that many
        milliseconds after the first of them, so that more can be fused with them.
        """
        out, self._out = self._out, []
        if self._ready_keys and self._config.cycle_time > 0:
            now = time.monotonic() if now is None else now
            if self._hold_until is not None and now < self._hold_until:
                keys: list[tuple[int, str]] = []
            else:
                keys = self._ready_keys
        else:
            keys = self._ready_keys
        if keys:
            self._ready_keys, self._ready_set, self._hold_until = [], set(), None
        # JOIN responses must come after the ops that completed because of the join.
        joins = [r for r in out if r.kind is OpKind.JOIN]
        out = [r for r in out if r.kind is not OpKind.JOIN]
        if self._ready_keys:  # held back: a join must not overtake them
            self._out, joins = joins, []
        for key in keys:
            entry = self._table.pop(key, None)
            members = self._registry.ranks(key[0])
            if entry is None or members is None:
                continue
            self._order.remove(key)
            out.append(self._respond(key[1], key[0], members, entry, entry.joined))
        return _fuse(out, self._config) + joins

    def _respond(self, name: str, set_id: int, members: list[int], entry: _Pending,
                 joined: list[int]) -> Response:
        reqs = [entry.requests[r] for r in members if r in entry.requests]
        first = reqs[0]
        problem = _validate(name, reqs)
        if problem:
            return _error(first, problem)
        if joined and first.kind in _JOIN_UNSUPPORTED:
            return _error(first, f"{_JOIN_UNSUPPORTED[first.kind]} is not supported with Join "
                                 f"at this time (ranks {joined} have joined; op '{name}').")
        resp = Response(kind=first.kind, names=[name], set_id=set_id, dtype=first.dtype,
                        device=first.device, op=first.op, root=first.root,
                        prescale=first.prescale, postscale=first.postscale,
                        shapes=[list(first.shape)], joined=joined)
        if first.kind is OpKind.BROADCAST and first.root not in members:
            return _error(first, f"broadcast received invalid root rank {first.root} for "
                                 f"'{name}': it is not a member of process set {set_id} "
                                 f"{members}.")
        if first.kind is OpKind.ALLGATHER:
            resp.first_dims = [[entry.requests[r].shape[0] for r in members]]
        elif first.kind is OpKind.ALLTOALL:
            resp.splits = [[list(entry.requests[r].splits or []) for r in members]]
        elif first.kind is OpKind.ADD_PROCESS_SET:
            ranks = sorted(first.ranks or [])
            if self._registry.find(ranks) is not None:
                return _error(first, f"Attempted to add a duplicate process set: {ranks} is "
                                     "already registered.")
            resp.value = self._registry.register(ranks)
            resp.ranks = ranks
        elif first.kind is OpKind.REMOVE_PROCESS_SET:
            resp.value = first.root
        return resp

    # ---- deadlock detector ---------------------------------------------------------------------
    def waiting(self, rank: int, blocked: bool, set_id: int, name: str, lane: bool,
                now: float | None = None) -> None:
        """``rank`` started (``blocked``) or stopped waiting for op ``name`` of ``set_id``.

        A rank reports a wait only once it has lasted ``BLOCKED_AFTER_S``; its requests travel on
        the same ordered connection, so any op it submitted before blocking is already here.
        """
        ops = self._waits.setdefault(rank, {})
        key = (set_id, name)
        wait = ops.get(key)
        if blocked:
            if wait is None:
                ops[key] = _Wait(1, lane)
            else:
                wait.count += 1
        elif wait is not None:
            wait.count -= 1
            if wait.count <= 0:
                del ops[key]
        if not ops:
            del self._waits[rank]

    def has_waits(self) -> bool:
        return bool(self._waits)

    def _missing(self, key: tuple[int, str], rank: int, wait: _Wait,
                 members: list[int]) -> list[int] | None:
        """Ranks whose action the op ``key`` (that ``rank`` waits for) still needs; None when
        unknown here (the op already ran or runs now, or it sits in a fast lane)."""
        set_id, name = key
        joined = self._joined.get(set_id, [])
        if name == "join":
            return [r for r in members if r not in joined]
        entry = self._table.get(key)
        if entry is None or key in self._ready_set:
            return None
        return [r for r in members if r not in entry.requests and r not in joined]

    def _stuck(self) -> list[int]:
        """Blocked ranks that can never be released, given that ranks not blocked may still
        submit anything: a rank may progress if one of its ops can complete once every rank it
        needs (its missing ranks) progresses. The rest, if any, are deadlocked."""
        world = self._registry.ranks(0) or []
        progress = {r for r in world if r not in self._waits} | set(self._departed)
        changed = True
        while changed:
            changed = False
            for rank, ops in self._waits.items():
                if rank in progress:
                    continue
                for key, wait in ops.items():
                    members = self._registry.ranks(key[0])
                    if members is None:
                        free = True
                    else:
                        missing = self._missing(key, rank, wait, members)
                        if missing is None and wait.lane:  # in the lane: it needs some member
                            # not blocked in the same op (optimistic: one that may progress)
                            others = [r for r in members if r != rank
                                      and key not in self._waits.get(r, {})]
                            free = any(r in progress for r in others) or not others
                        else:
                            free = missing is None or all(r in progress for r in missing)
                    if free:
                        progress.add(rank)
                        changed = True
                        break
        return sorted(r for r in self._waits if r not in progress)

    def check_deadlocks(self, now: float | None = None) -> tuple[list[Response], list[int]]:
        """Fail the ops of ranks that are certainly deadlocked.

        Returns the ERROR responses to dispatch and the process sets whose fast lanes must close
        first: before a decision, because an op waiting in a lane is invisible here (closing
        the lane hands it over, and a later check decides); with a decision, because the failed
        ops leave the members' lane logs out of step. A deadlock is declared only once the same
        ranks have been stuck in the same ops for ``HORA_DEADLOCK_TIME_SECONDS`` less the report
        delay.
        """
        limit = self._config.deadlock_time_seconds
        if not self._waits or limit <= 0:
            self._suspect = None
            return [], []
        now = time.monotonic() if now is None else now
        stuck = self._stuck()
        if not stuck:
            self._suspect = None
            return [], []
        signature = tuple((r, tuple(sorted(self._waits[r]))) for r in stuck)
        if signature != self._suspect:
            self._suspect, self._suspect_since = signature, now
            return [], []
        hidden = {key[0] for r in stuck for key, w in self._waits[r].items()
                  if w.lane and key[1] != "join" and key not in self._table}
        if hidden:  # (asked again at every check until the ops show up: closing is idempotent)
            return [], sorted(hidden)
        if now - self._suspect_since < max(0.0, limit - BLOCKED_AFTER_S):
            return [], []
        self._suspect = None
        failed = self._declare(stuck, now)
        # The ranks' fast-lane logs no longer line up (an allreduce some ranks logged failed):
        # close those lanes before anyone hears of the failure (a completed join reopens them).
        return failed, sorted({resp.set_id for resp in failed})

    def _group_siblings(self, key: tuple[int, str]) -> list[tuple[int, str]]:
        """The other pending members of a grouped op (``<base>_<i>of<n>``): a group completes
        as a whole, so a deadlock in one member fails them all."""
        match = _GROUP_MEMBER.match(key[1])
        if match is None:
            return []
        base, n = match.group(1), int(match.group(3))
        return [sibling for i in range(1, n + 1)
                if (sibling := (key[0], f"{base}_{i}of{n}")) != key and sibling in self._table]

    def _declare(self, stuck: list[int], now: float) -> list[Response]:
        parts: list[str] = []
        keys: list[tuple[int, str]] = []
        for rank in stuck:
            for key, wait in sorted(self._waits[rank].items()):
                members = self._registry.ranks(key[0]) or []
                missing = self._missing(key, rank, wait, members) or []
                verb = "never joined" if key[1] == "join" else "never submitted"
                where = f" of process set {key[0]}" if key[0] != 0 else ""
                who = _ranks_text(missing)
                parts.append(f"rank {rank} waits in {key[1]}{where}, which {who} {verb}")
                for member in [key, *self._group_siblings(key)]:
                    if member not in keys:
                        keys.append(member)
        message = (
            f"Deadlock: ranks {stuck} are all blocked and none of their ops can ever complete: "
            + "; ".join(parts) + f". hora fails these ops on every rank instead of hanging "
            f"(HORA_DEADLOCK_TIME_SECONDS={self._config.deadlock_time_seconds:g}). HINT: every "
            "rank must run the same collectives in the same order; a rank that skipped one (an "
            "exception it caught, a rank-dependent branch, an early exit from a loop) leaves the "
            "others waiting.")
        log.error("%s", message)
        out: list[Response] = []
        for set_id, name in keys:
            if name == "join":
                self._joined[set_id] = []
            elif (set_id, name) in self._table:
                del self._table[(set_id, name)]
                self._order.remove((set_id, name))
                self._drop_ready((set_id, name))
            out.append(Response(kind=OpKind.ERROR, names=[name], set_id=set_id, error=message,
                                value=ERROR_DEADLOCK))
        return out

    # ---- stall inspector -----------------------------------------------------------------------
    def check_stalls(self, now: float | None = None) -> list[Response]:
        """Warn about tensors waiting for some ranks; fail them past the shutdown time."""
        cfg = self._config
        if cfg.stall_check_disable:
            return []
        now = time.monotonic() if now is None else now
        warn_after, fail_after = cfg.stall_check_time_seconds, cfg.stall_shutdown_time_seconds
        missing_by_rank: dict[int, list[str]] = {}
        hints: list[str] = []
        failed: list[Response] = []
        for key in list(self._order):
            set_id, name = key
            entry = self._table[key]
            age = now - entry.first_seen
            if age < warn_after or now - entry.warned_at < warn_after:
                continue
            members = self._registry.ranks(set_id) or []
            missing = [r for r in members if r not in entry.requests
                       and r not in self._joined.get(set_id, ())]
            if key in self._ready_set:
                continue
            elsewhere = self._other_sets(name, set_id, missing)
            if fail_after > 0 and age >= fail_after:
                del self._table[key]
                self._order.remove(key)
                failed.append(_error(next(iter(entry.requests.values())),
                                     f"Stalled for {age:.0f} s: tensor '{name}' was submitted by "
                                     f"ranks {sorted(entry.requests)} but never by ranks {missing}"
                                     f" (HORA_STALL_SHUTDOWN_TIME_SECONDS={fail_after:g})."
                                     + elsewhere, ERROR_STALL))
                continue
            entry.warned_at = now
            if elsewhere:
                hints.append(f"'{name}':{elsewhere}")
            for r in missing:
                missing_by_rank.setdefault(r, []).append(name)
        if missing_by_rank:
            lines = "\n".join(f"{r}: [{', '.join(names[:6])}{', ...' if len(names) > 6 else ''}]"
                              for r, names in sorted(missing_by_rank.items()))
            log.warning(
                "One or more tensors were submitted to be reduced, gathered or broadcasted by "
                "subset of ranks and are waiting for remainder of ranks for more than %g "
                "seconds. This may indicate that different ranks are trying to submit different "
                "tensors or that only subset of ranks is submitting tensors, which will cause "
                "deadlock.\nMissing ranks:\n%s%s", warn_after, lines,
                "".join(f"\n{h}" for h in hints))
        return failed

    def _other_sets(self, name: str, set_id: int, missing: list[int]) -> str:
        """A hint when missing ranks submitted ``name`` to another process set (a mismatch of
        the process-set field, which name-based matching can only see as a stall)."""
        found = []
        for (other, other_name), entry in self._table.items():
            if other_name == name and other != set_id:
                ranks = sorted(r for r in missing if r in entry.requests)
                if ranks:
                    found.append(f"ranks {ranks} submitted it to process set {other}")
        if not found:
            return ""
        return (f" Mismatched process set: {'; '.join(found)}, the others to process set "
                f"{set_id}. HINT: pass the same process_set= on every rank.")

    def pending_names(self) -> list[str]:
        return [name for _, name in self._order]


ERROR_MISMATCH, ERROR_SHUTDOWN, ERROR_STALL, ERROR_DEADLOCK = 0, 1, 2, 3

_GROUP_MEMBER = re.compile(r"^(.*)_(\d+)of(\d+)$")
"""A member of a grouped op: ``grouped_allreduce.<base>_<i>of<n>`` (hora.core.api)."""
"""Codes carried in an ERROR response's ``value``: which exception type the ranks raise."""


def _error(req: Request, message: str, code: int = ERROR_MISMATCH) -> Response:
    return Response(kind=OpKind.ERROR, names=[req.name], set_id=req.set_id, error=message,
                    value=code)


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {ranks}"


def _fmt(value: object) -> str:
    return str(list(value)) if isinstance(value, (list, tuple)) else str(value)


def _validate(name: str, reqs: list[Request]) -> str:
    """Return a mismatch message (identical on every rank) or '' if all requests agree."""
    first = reqs[0]
    mine = request_signature(first)
    if len(reqs) == 1 or all(request_signature(r) == mine for r in reqs[1:]):
        # The common case: everything that must agree does. Only scalars need a closer look.
        if not (first.kind in (OpKind.ALLGATHER, OpKind.ALLTOALL, OpKind.REDUCESCATTER)
                and len(first.shape) == 0):
            return ""
    kind = first.kind.value

    def differ(field_name: str, label: str, horovod: str, hint: str) -> str:
        groups: dict[str, list[int]] = {}
        for r in reqs:
            groups.setdefault(_fmt(getattr(r, field_name)), []).append(r.rank)
        if len(groups) < 2:
            return ""
        values = list(groups)
        detail = "; ".join(f"ranks {ranks} had {val}" for val, ranks in groups.items())
        return (f"{horovod.format(a=values[0], b=values[1])} Mismatched {label} for tensor "
                f"'{name}': {detail}. HINT: {hint}")

    checks = [
        ("kind", "operation", "Mismatched operations: One rank did an {a}, but another rank did "
         "an {b}.", "every rank must run the same collective under the same name."),
        ("dtype", "data type", "Mismatched data types: One rank had type {a}, but another rank "
         "had type {b}.", "cast the tensor to the same dtype on every rank."),
        ("device", "device", f"Mismatched {kind} CPU/GPU device selection: One rank used {{a}}, "
         "another {b}.", "put the tensor on the same kind of device on every rank."),
    ]
    if first.kind in (OpKind.ALLREDUCE, OpKind.BROADCAST, OpKind.REDUCESCATTER):
        checks.append(("shape", "shape", f"Mismatched {kind} tensor shapes: One rank sent a tensor "
                       "of shape {a}, but another rank sent a tensor of shape {b}.",
                       "every rank must pass a tensor of the same shape."))
    if first.kind in (OpKind.ALLREDUCE, OpKind.REDUCESCATTER):
        checks.append(("op", "reduction operation", "Mismatched reduction operation: One rank "
                       "used op {a}, but another rank used op {b}.",
                       "pass the same op= on every rank (ops: "
                       + ", ".join(f"{o.name}={o.value}" for o in ReduceOp) + ")."))
        checks.append(("prescale", "prescale factor", "Mismatched prescale and/or postscale "
                       "factors: {a} vs {b}.", "pass the same prescale_factor on every rank."))
        checks.append(("postscale", "postscale factor", "Mismatched prescale and/or postscale "
                       "factors: {a} vs {b}.", "pass the same postscale_factor on every rank."))
    if first.kind is OpKind.BROADCAST:
        checks.append(("root", "root rank", "Mismatched BROADCAST root ranks: One rank specified "
                       "root rank {a}, but another rank specified root rank {b}.",
                       "pass the same root_rank on every rank."))
    for field_name, label, horovod, hint in checks:
        msg = differ(field_name, label, horovod, hint)
        if msg:
            return msg
    if first.kind in (OpKind.ALLGATHER, OpKind.ALLTOALL, OpKind.REDUCESCATTER):
        if len(first.shape) == 0:
            return (f"Process-set rank zero tried to {kind} a rank-zero tensor '{name}'. HINT: "
                    "reshape scalars to shape [1].")
    if first.kind in (OpKind.ALLGATHER, OpKind.ALLTOALL):
        ndims = {len(r.shape) for r in reqs}
        if len(ndims) > 1:
            return differ("shape", "tensor rank (number of dimensions)",
                          f"Mismatched {kind} tensor shapes: One rank sent a tensor of rank "
                          f"{len(reqs[0].shape)}, but another rank sent a tensor of a different "
                          "rank.", "every rank must pass tensors with the same number of "
                          "dimensions.")
        for dim in range(1, len(first.shape)):
            sizes = {r.shape[dim] for r in reqs}
            if len(sizes) > 1:
                per = "; ".join(f"rank {r.rank} has {r.shape[dim]}" for r in reqs)
                return (f"Mismatched {kind} tensor shapes: One rank sent a tensor with dimension "
                        f"{dim} equal to {reqs[0].shape[dim]}, but another rank sent a tensor "
                        f"with dimension {dim} equal to a different value, for tensor '{name}': "
                        f"{per}. HINT: only the first dimension may differ across ranks.")
    return ""


def _fuse(responses: list[Response], config: Config) -> list[Response]:
    """Merge allreduce responses that agree on set/dtype/op/scales, up to the fusion threshold."""
    limit = config.fusion_threshold
    if limit <= 0:
        return responses
    out: list[Response] = []
    open_: dict[tuple[object, ...], tuple[Response, int]] = {}
    for resp in responses:
        if resp.kind not in _FUSABLE or resp.joined:
            out.append(resp)
            continue
        nbytes = _nelems(resp.shapes[0]) * to_dtype(resp.dtype).itemsize
        key = fusion_key(resp)
        current = open_.get(key)
        if current is not None and current[1] + nbytes <= limit:
            fused, size = current
            fused.names.extend(resp.names)
            fused.shapes.extend(resp.shapes)
            open_[key] = (fused, size + nbytes)
            continue
        out.append(resp)
        open_[key] = (resp, nbytes)
    return out


def _nelems(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
