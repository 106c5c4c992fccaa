"""Negotiation on the coordinator (global rank 0): which named ops are ready everywhere.

Every rank sends its :class:`~hora.core.op.messages.Request` objects to rank 0. The coordinator
keeps a table name -> requests; a name is *ready* when every member of its process set has
submitted it (or has joined). Ready requests are validated (dtype, shape, op, root, scale factors
must agree; otherwise one ERROR response with the same text for every rank), turned into
:class:`~hora.core.op.messages.Response` objects, and small allreduces are fused up to the fusion
threshold (:mod:`hora.core.data.fusion`; autotune may change it and the cycle time while the job
runs, :meth:`Coordinator.retune`). One coordinator serves every process set, so all ranks see
responses in one total order and can never execute two sets' collectives in different orders.

The stall inspector lives here too: it names tensors that some ranks submitted and others did not.
The deadlock detector (:mod:`hora.core.engine.deadlock`) reads the same table.

Cost: a request is O(1) amortized, whatever the set's size: a name's arrivals are counted, the
members are a set cached per registered tuple, and the full check runs once per name, when the
arrivals (plus joined ranks) reach the set's size. An uncached cycle is O(N) at rank 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hora._util.log import get_logger
from hora.collectives.ops import ReduceOp
from hora.config import Config
from hora.core.data.fusion import fuse
from hora.core.engine.deadlock import DeadlockDetector
from hora.core.op.agreement import request_signature
from hora.core.op.messages import (
    ERROR_MISMATCH,
    ERROR_SHUTDOWN,
    ERROR_STALL,
    OpKind,
    Request,
    Response,
)
from hora.core.op.process_set import Registry

log = get_logger(__name__)

_JOIN_UNSUPPORTED = {
    OpKind.ALLGATHER: "Allgather", OpKind.BROADCAST: "Broadcast",
    OpKind.ALLTOALL: "Alltoall", OpKind.REDUCESCATTER: "Reducescatter",
}


@dataclass
class _Pending:
    requests: dict[int, Request] = field(default_factory=dict)  # rank -> request, members only
    first_seen: float = 0.0
    warned_at: float = 0.0
    joined: list[int] = field(default_factory=list)  # joined ranks when it became ready


class Coordinator:
    """Rank 0's negotiation state for every process set."""

    def __init__(self, registry: Registry, config: Config) -> None:
        self._registry = registry
        self._config = config
        self._table: dict[tuple[int, str], _Pending] = {}
        self._order: dict[tuple[int, str], None] = {}  # pending keys in arrival order
        self._joined: dict[int, dict[int, None]] = {}  # set -> joined ranks, in join order
        self._members: dict[int, tuple[tuple[int, ...], frozenset[int]]] = {}
        self._departed: dict[int, str] = {}
        self._out: list[Response] = []
        self._ready_keys: list[tuple[int, str]] = []  # complete, in the order they completed
        self._ready_set: set[tuple[int, str]] = set()
        self._hold_until: float | None = None
        self.deadlocks = DeadlockDetector(registry, config, self)

    # ---- input -------------------------------------------------------------------------------
    def _member_set(self, set_id: int) -> tuple[tuple[int, ...], frozenset[int]] | None:
        """The set's sorted ranks and the same as a set, without a copy (cached per registered
        tuple: a re-registered set gets a new one)."""
        ranks = self._registry.members(set_id)
        if ranks is None:
            return None
        cached = self._members.get(set_id)
        if cached is None or cached[0] is not ranks:
            cached = self._members[set_id] = (ranks, frozenset(ranks))
        return cached

    def add(self, requests: list[Request]) -> None:
        """Record requests from one rank (O(1) amortized per request)."""
        now = time.monotonic()
        for req in requests:
            found = self._member_set(req.set_id)
            if found is None:
                self._out.append(_error(req, f"Process set {req.set_id} provided does not exist, "
                                             "or has not been registered."))
                continue
            ranks, member_set = found
            if req.rank not in member_set:
                log.warning("ignoring request for '%s' from rank %d, which is not a member of "
                            "process set %d %s", req.name, req.rank, req.set_id, list(ranks))
                continue
            if req.kind is OpKind.JOIN:
                self._join(req, ranks, member_set)
                continue
            key = (req.set_id, req.name)
            entry = self._table.get(key)
            if entry is None:
                entry = self._table[key] = _Pending(first_seen=now)
                self._order[key] = None
            entry.requests[req.rank] = req
            gone = sorted(r for r in self._departed if r in member_set) if self._departed else []
            if gone:
                del self._table[key]
                del self._order[key]
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
                del self._order[key]
                any_req = next(iter(entry.requests.values()))
                self._out.append(_error(any_req, f"Horovod has been shut down: rank {rank} shut "
                                                 f"down ({reason}) before submitting '{name}'.",
                                      ERROR_SHUTDOWN))
        for set_id, joined in self._joined.items():  # a join it never joined can't finish
            members = self._registry.ranks(set_id) or []
            if joined and rank in members and rank not in joined:
                self._joined[set_id] = {}
                self._out.append(Response(
                    kind=OpKind.ERROR, names=["join"], set_id=set_id, value=ERROR_SHUTDOWN,
                    error=f"Horovod has been shut down: rank {rank} shut down ({reason}) "
                          f"without calling join(); ranks {sorted(joined)} waited in join."))

    def _join(self, req: Request, ranks: tuple[int, ...], member_set: frozenset[int]) -> None:
        joined = self._joined.setdefault(req.set_id, {})
        joined[req.rank] = None  # (members only: add checked)
        for key in list(self._order):  # a join can complete tensors the joined rank never submits
            if key[0] == req.set_id:
                self._note_if_ready(key)
        if len(joined) >= len(ranks) and member_set <= joined.keys():
            self._joined[req.set_id] = {}
            self._out.append(Response(kind=OpKind.JOIN, names=[req.name], set_id=req.set_id,
                                      value=req.rank))

    # ---- output ------------------------------------------------------------------------------
    def _complete(self, key: tuple[int, str]) -> bool:
        """Every member submitted ``key`` or joined. Counts first (O(joined)); the full check
        (O(members)) only once the counts say complete."""
        entry = self._table.get(key)
        found = self._member_set(key[0])
        if entry is None or found is None:
            return False
        ranks, member_set = found
        joined = self._joined.get(key[0])
        have = len(entry.requests)
        if joined:
            have += sum(1 for r in joined if r not in entry.requests)
        if have < len(ranks):
            return False
        return all(r in entry.requests or (joined is not None and r in joined)
                   for r in member_set)

    def _note_if_ready(self, key: tuple[int, str]) -> None:
        if key not in self._ready_set and self._complete(key):
            entry = self._table[key]
            # Remember who had joined now: the join that completes a set resets the list.
            joined = self._joined.get(key[0])
            entry.joined = sorted(r for r in joined if r not in entry.requests) if joined else []
            self._ready_set.add(key)
            self._ready_keys.append(key)
            if self._hold_until is None:
                self._hold_until = time.monotonic() + self._config.cycle_time / 1000.0

    def retune(self, config: Config) -> None:
        """Autotune: fuse and hold responses by ``config``'s fusion threshold and cycle time
        from now on (:mod:`hora.core.autotune.autotune`)."""
        self._config = config

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
            del self._order[key]
            out.append(self._respond(key[1], key[0], members, entry, entry.joined))
        return fuse(out, self._config.fusion_threshold) + joins

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
                        shapes=[list(first.shape)], joined=joined,
                        group=(first.group or name) if self._config.disable_group_fusion else "")
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

    # ---- what the deadlock detector reads (hora.core.engine.deadlock.PendingOps) ----------
    def submitted(self, key: tuple[int, str]) -> set[int] | None:
        """Ranks that submitted op ``key`` while it waits for the others; None when it is not
        waiting here (complete, running, failed, or never seen)."""
        entry = self._table.get(key)
        if entry is None or key in self._ready_set:
            return None
        return set(entry.requests)

    def is_pending(self, key: tuple[int, str]) -> bool:
        return key in self._table

    def group_siblings(self, key: tuple[int, str]) -> list[tuple[int, str]]:
        """The other pending members of the grouped op ``key`` belongs to (none if it is not a
        group member, or not pending)."""
        entry = self._table.get(key)
        group = next(iter(entry.requests.values())).group if entry and entry.requests else ""
        if not group:
            return []
        return [k for k, other in self._table.items() if k != key and k[0] == key[0]
                and any(r.group == group for r in other.requests.values())]

    def joined(self, set_id: int) -> list[int]:
        return list(self._joined.get(set_id, ()))

    def departed(self) -> set[int]:
        return set(self._departed)

    def forget(self, key: tuple[int, str]) -> None:
        """Drop op ``key`` (``join``: every pending join of the set) after it failed."""
        set_id, name = key
        if name == "join":
            self._joined[set_id] = {}
        elif key in self._table:
            del self._table[key]
            del self._order[key]
            self._drop_ready(key)

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
                del self._order[key]
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
            then = (f"they fail on every rank once waiting {fail_after:g} s" if fail_after > 0
                    else "they wait forever")
            log.warning(
                "One or more tensors were submitted to be reduced, gathered or broadcasted by "
                "subset of ranks and are waiting for remainder of ranks for more than %g "
                "seconds; %s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, hora run "
                "--stall-check-shutdown-time-seconds). Different ranks submit different tensors "
                "or only some submit.\nMissing ranks:\n%s%s", warn_after, then, lines,
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


def _error(req: Request, message: str, code: int = ERROR_MISMATCH) -> Response:
    return Response(kind=OpKind.ERROR, names=[req.name], set_id=req.set_id, error=message,
                    value=code)


def _fmt(value: object) -> str:
    return str(list(value)) if isinstance(value, (list, tuple)) else str(value)


def _validate(name: str, reqs: list[Request]) -> str:
    """Return a mismatch message (identical on every rank) or '' if all requests agree."""
    first = reqs[0]
    mine = request_signature(first)
    # The common case: everything that must agree does. Only scalars need a closer look.
    if (len(reqs) == 1 or all(request_signature(r) == mine for r in reqs[1:])) and not (
            first.kind in (OpKind.ALLGATHER, OpKind.ALLTOALL, OpKind.REDUCESCATTER)
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
    if first.kind in (OpKind.ALLGATHER, OpKind.ALLTOALL, OpKind.REDUCESCATTER) \
            and len(first.shape) == 0:
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
