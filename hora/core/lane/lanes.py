"""This rank's fast lanes: which op goes into one, and each lane's life (one per process set).

A lane (:mod:`hora.core.lane.fastlane`) opens on every member of a set at the set's first negotiated
allreduce or allgather on a shared-memory route; it closes for ``join`` and
``remove_process_set`` (after flushing what this rank logged) and when rank 0 asks (a suspected
deadlock); a completed ``join`` reopens it with the same slots. The engine owns one
:class:`Lanes` and calls it from user threads (:meth:`Lanes.offer`, :meth:`Lanes.before_join`)
and from its thread (the rest); each lane talks back to the engine through one
:class:`~hora.core.lane.engine_side.EngineSide` (which thread calls what:
:mod:`hora.core.lane.engine_side`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hora._util.log import get_logger
from hora.config import Config
from hora.core.data.executor import Executor
from hora.core.data.routing import Route
from hora.core.lane.engine_side import EngineSide
from hora.core.lane.fastlane import FastLane
from hora.core.op.entry import Entry
from hora.core.op.messages import OpKind, Response
from hora.core.op.process_set import Registry
from hora.errors import ShutdownError
from hora.transports.base import Transport

log = get_logger(__name__)

SETTLE_S = 3.0
"""On a peer's shutdown notice, how long a lane batch already running may take to finish
before it is failed (a batch the departed rank never joined then fails within this)."""


class Lanes:
    """The fast lanes of one rank, by process set.

    Args:
        transport: its global data plane (a lane's executor is built over it, then adopts the
            lane's own route).
        registry: the process sets.
        config: cache capacity, fusion threshold, stall time (autotune: :meth:`retune`).
        job_id: names a reopened lane's shared memory.
        engine: what every lane may ask of the engine (:class:`EngineSide`: hand ops back,
            report a failure, report a blocked flush).
    """

    def __init__(self, transport: Transport, registry: Registry, config: Config, job_id: str,
                 engine: EngineSide) -> None:
        self._transport = transport
        self._registry = registry
        self._config = config
        self._job_id = job_id
        self._engine = engine
        # set -> its lane; the submit path reads it without the lock: a lane replaced meanwhile
        # is closed and refuses the ops (which then go to the negotiated path)
        self.by_set: dict[int, FastLane] = {}
        self._lock = threading.Lock()  # orders allreduce submissions and lane creation
        self._positions: dict[int, int] = {}  # set -> lane ops submitted (log positions)
        self._joining: set[int] = set()  # sets this rank joined (until every member has)
        # rank 0 with autotune on: sees every op its lanes run (hora.core.autotune.autotune's
        # Observed; lanes opened later get it too)
        self.observe: Callable[[Response], None] | None = None

    def get(self, set_id: int) -> FastLane | None:
        return self.by_set.get(set_id)

    # ---- user threads ------------------------------------------------------------------------
    def offer(self, entries: list[Entry]) -> bool:
        """A unit of ops of a kind in :data:`~hora.core.lane.fastlane.KINDS` was submitted (one op,
        or a grouped call's members): True if the set's lane took it (it runs there, no
        negotiation), False if the caller must negotiate it (no lane, or the lane refused it).

        While the set has a lane, the engine submits to it directly (:attr:`by_set`): the
        count of positions only matters for a lane opened later, and once a set had a lane it
        never opens one from that count again (a completed join starts its new lane at 0)."""
        set_id = entries[0].request.set_id
        with self._lock:  # ops counted before a lane opens are its first positions (misses)
            self._positions[set_id] = self._positions.get(set_id, 0) + len(entries)
            lane = self.by_set.get(set_id)
        # (not under the lock: submit may wait for room in the log, and the engine thread takes
        # the lock to open a lane; a lane replaced meanwhile is closed, so it refuses the ops)
        return lane is not None and lane.offer(entries)

    def before_join(self, kind: OpKind, set_id: int) -> None:
        """A ``join`` (of ``set_id``) or ``remove_process_set`` (of set ``set_id``) is about to
        be negotiated: the ops this rank logged in that set's lane must reach the coordinator
        first, so the lane closes its log and drains it."""
        with self._lock:
            if kind is OpKind.JOIN:
                self._joining.add(set_id)
            lane = self.by_set.get(set_id)
        if lane is not None:
            lane.close_log()
            lane.flush()

    # ---- engine thread -----------------------------------------------------------------------
    def learn(self, route: Route, resp: Response) -> None:
        """Before a negotiated allreduce or allgather of a set this rank is in runs (``route``:
        the set's): open the set's lane if it has none and the route has a lane group, then the
        lane learns the response's slots. Every lane learns here and only here (a lane reopened
        after ``join`` adopts its predecessor's slots)."""
        lane = self.by_set.get(resp.set_id)
        if lane is None and route.lane_group is not None:
            with self._lock:  # lane ops submitted before now were not logged: the lane counts
                # them as misses, so position n stays the n-th lane op everywhere
                lane = self._new(resp.set_id, route, self._positions.get(resp.set_id, 0))
                if resp.set_id in self._joining:  # joined before its lane existed: it logs
                    lane.close_log()  # nothing, so the others must not wait for it
                self.by_set[resp.set_id] = lane
            log.info("process set %d: fast lane on (allreduces and allgathers negotiated once "
                     "skip rank 0; up to %d names)", resp.set_id, self._config.cache_capacity)
            lane.start()
        if lane is not None:
            lane.learn(resp)

    def lane_executor(self) -> Executor:
        """The factory of a lane's own executor (engine thread, as a lane opens): over the
        global comm, without a timeline (a lane exists only without one), seeing what
        autotune's :attr:`observe` wants; the lane then points it at its own route. Only the
        thread driving that lane uses it."""
        executor = Executor(self._transport.comm(), self._registry, self._config)
        executor.observe = self.observe
        return executor

    def _new(self, set_id: int, route: Route, start: int) -> FastLane:
        """A lane over ``route.lane_group`` with its own executor (not started)."""
        return FastLane(set_id, route, self._config, self.lane_executor(), self._engine,
                        start=start)

    def retune(self, config: Config) -> None:
        """Autotune: every lane's leader fuses up to ``config``'s fusion threshold from its
        next decision on (one party decides each fusion, so no member needs to switch at the
        same time as the others); lanes opened later start with it."""
        self._config = config
        for lane in list(self.by_set.values()):
            lane.retune(config.fusion_threshold)

    def joined(self, set_id: int, route: Route | None) -> None:
        """Every member joined (each closed its log and flushed it): start a fresh lane.

        Runs on every member at the same response, so the new lane's shared-memory group can be
        built collectively; the slots carry over.
        """
        with self._lock:  # submissions go to the negotiated path until the new lane exists
            old = self.by_set.pop(set_id, None)
            self._joining.discard(set_id)
        if old is None or route is None:
            return
        old.stop()
        if not route.renew_lane_group(self._job_id):
            return
        lane = self._new(set_id, route, 0)
        lane.adopt_cache(old)
        with self._lock:  # every member starts its new log at position 0 here
            self.by_set[set_id] = lane
        lane.start()

    def join_failed(self, set_id: int) -> None:
        """This rank's join of ``set_id`` failed (a deadlock): it is back in the set."""
        with self._lock:
            self._joining.discard(set_id)

    def close(self, set_id: int) -> None:
        """Rank 0 asked (a suspected deadlock): log nothing more; the leader turns it off."""
        lane = self.by_set.get(set_id)
        if lane is not None:
            lane.close_log()

    def remove(self, set_id: int) -> None:
        """The process set was removed."""
        lane = self.by_set.pop(set_id, None)
        if lane is not None:
            lane.stop()

    def stop_all(self, error: BaseException | None) -> None:
        """Shutdown or failure: every lane stops (its pending ops fail with ``error``). On a
        peer's shutdown notice (a :class:`ShutdownError`) a batch already running finishes
        first, for up to :data:`SETTLE_S`: the departed rank completed it."""
        settle = SETTLE_S if isinstance(error, ShutdownError) else 0.0
        for lane in list(self.by_set.values()):
            if error is not None:
                lane.abort(error, settle)
            lane.stop()
        self.by_set.clear()
