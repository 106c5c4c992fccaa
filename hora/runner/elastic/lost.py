"""Hung workers: the members of a failed generation that their peers report lost.

Runner layer; used by the elastic driver. When a generation fails, each survivor posts the ranks
its error names (:mod:`hora.rendezvous.elastic_report`) before it says it is ready. A member
that does not say it is ready might be slow (it will fail at its next collective and rejoin) or
hung (SIGSTOP, a debugger, a host that stopped answering): it never rejoins. The rule:

* every member that has not rejoined is named by a survivor's report of this generation, and
* every other member has rejoined (or ended), and
* :data:`GRACE_S` seconds have passed since then (a healthy member that its peers named because
  it closed its connections on its own way out rejoins within that time):

then those members are dropped: the driver kills them with their process groups and forms the
next generation without them. A member no survivor names is waited for as before (up to
``--elastic-timeout``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from hora.errors import RendezvousTimeoutError
from hora.rendezvous.elastic import SCOPE
from hora.rendezvous.elastic_report import LostReport, decode_report, lost_key
from hora.rendezvous.store_client import KVStoreClient
from hora.runner.elastic.members import Member

GRACE_S = 2.0
"""Seconds a named member may still take to rejoin once every other member has."""


class LostReports:
    """The survivors' reports, and which members to drop.

    Args:
        clock: monotonic seconds.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._reports: dict[int, LostReport] = {}  # by the reporting worker's id
        self._since: float | None = None  # since when only named members are missing

    def read(self, client: KVStoreClient, wid: int) -> None:
        """Fetch worker ``wid``'s latest report, if it posted one."""
        try:
            raw = client.get(SCOPE, lost_key(wid), 0.0)
        except RendezvousTimeoutError:
            return
        report = decode_report(raw)
        if report is not None:
            self._reports[wid] = report

    def to_drop(self, generation: int, members: Sequence[Member],
                behind: Sequence[Member]) -> list[tuple[Member, str]] | None:
        """The members of ``generation`` to drop now, each with who named it and their error
        (``"worker 0, worker 2: rank 1 (host a) sent nothing ..."``), given ``behind``
        (those alive that have not rejoined). None: some of them no survivor names (wait for
        them as before); an empty list: wait (the grace period runs)."""
        why: dict[int, str] = {}
        for m in behind:
            named = [(wid, r) for wid, r in self._reports.items()
                     if r.generation == generation and m.rank in r.ranks and wid != m.wid]
            if not named:
                self._since = None
                return None
            by = ", ".join(f"worker {wid}" for wid, _ in named)
            why[m.wid] = f"{by}: {named[0][1].error}"
        if self._since is None:
            self._since = self._clock()
        if self._clock() - self._since < GRACE_S:
            return []
        self._since = None
        return [(m, why[m.wid]) for m in behind if m in members]

    def reset(self) -> None:
        """A generation was formed: the grace period starts afresh next time."""
        self._since = None


__all__ = ["GRACE_S", "LostReports"]
