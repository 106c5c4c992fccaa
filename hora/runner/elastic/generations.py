"""How the elastic driver forms generations: :class:`Generations`, a part of
:class:`~hora.runner.elastic.driver.ElasticDriver` (the driver's loop calls :meth:`_decide` every
tick).

Runner layer. A generation is formed

* at start, from the first ``-np`` workers ready (within ``--elastic-timeout``);
* after a failure, from the members that rejoined (their collectives failed, they rolled back)
  plus the newcomers ready, once every other member has ended, rejoined, or was dropped: a
  member its peers report lost that does not rejoin (:mod:`.lost`) is killed and left out; one
  nobody names is waited for up to ``--elastic-timeout``;
* after a notice (a newcomer is ready, a host was removed), when every member stopped at the
  same commit and rejoined.

With fewer than ``--min-np`` candidates the driver waits ``--elastic-timeout`` for more (or
fails at once when no worker can ever be added, :mod:`.hostpolicy`). Each change is logged with
who left and who joined.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from hora.rendezvous import elastic as proto
from hora.rendezvous.store_client import KVStoreClient
from hora.runner import launch as launch_mod
from hora.runner.elastic.discovery import FixedHosts, describe
from hora.runner.elastic.hostpolicy import HostPolicy
from hora.runner.elastic.lost import GRACE_S, LostReports
from hora.runner.elastic.members import Member, form_generation, summary
from hora.runner.elastic.options import ElasticOptions
from hora.runner.elastic.spawner import Spawner


class Generations:
    """The generation-forming half of the elastic driver (state lives in the driver)."""

    spec: launch_mod.LaunchSpec
    options: ElasticOptions
    names: Mapping[str, str]
    spawner: Spawner
    hosts: HostPolicy
    members: dict[int, Member]
    generation: int
    resets: int
    _client: KVStoreClient
    _lost: LostReports
    _running: list[Member]
    _notice: proto.HostUpdateResult
    _reset_since: float | None
    _short_since: float | None
    timeout: float

    def _usable(self) -> dict[str, int]:
        raise NotImplementedError

    def _tell(self, m: Member, answer: proto.Assignment | proto.Stop) -> None:
        raise NotImplementedError

    def _fail(self, message: str) -> int:
        raise NotImplementedError

    def _timeout_text(self) -> str:
        raise NotImplementedError

    def _say(self, text: str, *, verbose_only: bool = False) -> None:
        raise NotImplementedError

    def _decide(self, started: float) -> int | None:
        members = [m for m in self.members.values() if m.current == self.generation
                   and self.generation > 0]
        ready = [m for m in self.members.values() if m.waiting and m.leaving is None]
        newcomers = [m for m in ready if m.ready_after == 0 and m.current is None]
        if self.generation == 0:
            pending = [m for m in self.members.values() if m.alive and not m.waiting
                       and m.leaving is None]
            if not pending and len(newcomers) >= self.spec.np:
                return self._form(newcomers, [])
            if time.monotonic() - started > self.timeout:
                return self._fail(f"only {len(newcomers)} of the {self.spec.np} workers needed "
                                  f"to start ({self.names['np']}) were ready after "
                                  f"{self._timeout_text()}")
            return None
        failing = [m for m in members if not m.alive or m.waiting]
        if not failing:
            self._post_notice(members, newcomers)
            return None
        if self._reset_since is None:
            self._reset_since = time.monotonic()
        behind = [m for m in members if m.alive and not m.waiting and m.lost is None]
        drop = self._lost.to_drop(self.generation, members, behind) if behind else []
        for m, why in drop or []:
            self._drop(m, why)
        behind = [m for m in behind if m.lost is None]
        if behind:
            if drop is None and time.monotonic() - self._reset_since > self.timeout:
                self._say(f"{summary(behind)} did not rejoin within {self._timeout_text()}; "
                          "stopping them")
                for m in behind:
                    self._tell(m, proto.Stop("failed", "did not rejoin the elastic job in "
                                                       "time"))
            return None
        survivors = [m for m in members if m.waiting and m.leaving is None]
        if not survivors:
            return self._fail("no worker of the previous generation is left, so no one holds "
                              "the trained state to broadcast (every member failed)")
        return self._form(survivors + newcomers, members)

    def _drop(self, m: Member, why: str) -> None:
        """Kill a hung member with its process group; the next generation forms without it."""
        m.lost = why
        self._say(f"{m.describe()} (rank {m.rank}) is lost: its peers report it ({why}) and it "
                  f"did not rejoin within {GRACE_S:g} s of them; killing it with its process "
                  "group and going on without it")
        if m.process is not None:  # stopping may block briefly: not on the driver's loop
            kill = getattr(self.spawner, "kill", self.spawner.stop)
            threading.Thread(target=kill, args=(m.process,), daemon=True,
                             name="hora-kill-lost").start()

    def _form(self, candidates: list[Member], previous: list[Member]) -> int | None:
        usable = self._usable()
        for m in candidates:
            if m.host not in usable:
                self._tell(m, proto.Stop("removed", f"host {m.host} left the job"))
        chosen = [m for m in candidates if m.leaving is None]
        chosen = chosen[:self.options.max_np] if self.options.max_np else chosen
        if len(chosen) < self.options.min_np:
            if self._short_since is None:
                self._short_since = time.monotonic()
                self._say(f"{len(chosen)} worker(s) ready, fewer than {self.names['min_np']} "
                          f"{self.options.min_np}; waiting up to {self._timeout_text()} for "
                          "more")
            stuck = self.hosts.stuck(usable, isinstance(self.options.discovery, FixedHosts))
            if stuck and not any(m.alive and m.leaving is None and m.current is None
                                 and m not in candidates for m in self.members.values()):
                return self._fail(
                    f"only {len(chosen)} worker(s) ({summary(chosen)}) are left, fewer than "
                    f"{self.names['min_np']} {self.options.min_np}, and no worker can be added: "
                    f"{stuck}")
            if time.monotonic() - self._short_since > self.timeout:
                return self._fail(
                    f"only {len(chosen)} worker(s) ({summary(chosen)}) were ready, fewer than "
                    f"{self.names['min_np']} {self.options.min_np}, for {self._timeout_text()}; "
                    f"no new host slots appeared (hosts now: {describe(usable)})")
            return None
        if previous:
            limit = self.options.reset_limit
            if limit is not None and self.resets >= limit:
                return self._fail("Horovod was shutdown because number of resets during "
                                  f"elastic job exceeded limit: {limit} "
                                  f"({self.names['reset_limit']})")
            self.resets += 1
        self._short_since = None
        self.generation += 1
        assignments = form_generation(chosen, self.generation)
        for m in chosen:
            if m.generation is None:
                m.generation = self.generation
            m.current, m.rank = self.generation, assignments[m.wid].rank
            self._tell(m, assignments[m.wid])
        self._notice = proto.HostUpdateResult.no_update
        self._lost.reset()
        left = [m for m in self._running if m not in chosen]
        joined = [m for m in chosen if m.generation == self.generation and previous]
        cause = ("failure" if any(m.exit_code or m.lost for m in self._running)
                 else "interruption")
        self._running = list(chosen)
        since = (f", {time.monotonic() - self._reset_since:.2f} s after the {cause}"
                 if self._reset_since is not None else "")
        self._reset_since = None
        change = "" if not previous else (
            f" (left: {summary(left)}; joined: {summary(joined)})")
        self._say(f"generation {self.generation}: {len(chosen)} worker(s){change}{since}",
                  verbose_only=not previous)
        if self.spec.verbose:
            order = sorted(chosen, key=lambda m: assignments[m.wid].rank)
            self._say("ranks: " + ", ".join(f"{assignments[m.wid].rank}=worker {m.wid}@{m.host}"
                                            for m in order), verbose_only=True)
        return None

    def _post_notice(self, members: list[Member], newcomers: list[Member]) -> None:
        update = proto.HostUpdateResult.no_update
        room = (self.options.max_np or 1 << 30) - len(members)
        if newcomers and room > 0:
            update |= proto.HostUpdateResult.added
        usable = self._usable()
        if any(m.host not in usable or (m.alive and m.leaving) for m in self._running):
            update |= proto.HostUpdateResult.removed
        if self._notify(update):
            self._say(f"notifying generation {self.generation}: hosts "
                      f"{self._notice.name or 'changed'} (takes effect at its next commit)",
                      verbose_only=True)

    def _notify(self, update: proto.HostUpdateResult) -> bool:
        """Post ``update`` for the running generation (rank 0 reads it at its next commit);
        False when there is none or nothing new."""
        if not update or self.generation == 0 or (self._notice | update) == self._notice:
            return False
        self._notice |= update
        self._client.set(proto.SCOPE, proto.notice_key(self.generation),
                         str(int(self._notice)).encode())
        return True


__all__ = ["Generations"]
