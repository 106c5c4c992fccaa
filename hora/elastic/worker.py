"""The elastic training loop: ``@hvd.elastic.run`` (framework-neutral; adapters bind ``reset``).

::

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...            # collectives
            state.commit()

    train(state)

The wrapper loops: ``state.sync()`` (skipped when only hosts were removed), then ``func(state)``.

* a collective fails (:class:`~hora.errors.HorovodInternalError`: a peer died or stalled):
  the peers the error names are reported to the driver (:mod:`hora.rendezvous.elastic_report`:
  a hung peer is dropped, not waited for), ``state.restore()`` rolls back to the last commit,
  then the world is rebuilt without the lost worker and ``func`` runs again from there;
* ``commit()`` finds that hosts changed (:class:`~hora.errors.HostsUpdatedInterrupt`): no
  rollback; the world is rebuilt with the newcomers, who get the state in the next ``sync()``;
* anything else propagates (the worker exits, the driver counts a failure).

Rebuilding is ``shutdown()`` then ``init()``: the worker tells the driver it is ready and gets
its rank in the new generation (see :mod:`hora.rendezvous.elastic`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

from hora._util.log import get_logger
from hora.elastic.state import State
from hora.errors import HoraError, HorovodInternalError, HostsUpdatedInterrupt, PeerLostError
from hora.rendezvous.elastic import SCOPE, session
from hora.rendezvous.elastic_report import LostReport, encode_report, lost_key, named_ranks

log = get_logger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

MAX_FAILURES_WITHOUT_DRIVER = 5
"""Outside an elastic job nothing changes between retries: a failure that recurs this many
times in a row (no commit in between) is raised instead of retried for ever."""


def run_fn(func: F, reset: Callable[[], None]) -> F:
    """Wrap ``func(state, *args, **kwargs)`` in the elastic loop; ``reset`` rebuilds the world
    (``shutdown(); init()`` of the adapter)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"the first argument of an @elastic.run function must be an elastic "
                            f"State (TorchState, ObjectState, ...), not {type(state).__name__}")
        skip_sync = False
        failures, commits = 0, state._commit_count
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError as exc:
                failed = time.monotonic()
                log.warning("a collective failed (%s); rolling back to the last commit and "
                            "rebuilding the world", _first_line(exc))
                report_lost(exc)
                state.restore()
                skip_sync = False
                failures = failures + 1 if state._commit_count == commits else 1
                commits = state._commit_count
                if failures >= MAX_FAILURES_WITHOUT_DRIVER and session(connect=False) is None:
                    raise HorovodInternalError(
                        f"the same step failed {failures} times in a row without a commit in "
                        f"between, and this process has no elastic driver to change the world "
                        f"(not started by `hora run --min-np ...`): {exc}") from exc
            except HostsUpdatedInterrupt as exc:
                failed = time.monotonic()
                log.info("hosts changed; rebuilding the world%s",
                         " (only removals: no state sync)" if exc.skip_sync else "")
                skip_sync = exc.skip_sync
            reset()
            state.on_reset()
            log.info("world rebuilt in %.2f s", time.monotonic() - failed)

    return wrapper  # type: ignore[return-value]


def reset() -> None:
    """Leave the current world and join the next one (``shutdown()`` then ``init()``)."""
    from hora.core.engine import context

    context.shutdown()
    context.init()


def report_lost(exc: BaseException) -> None:
    """Tell the driver which peers of this generation ``exc`` names (none: nothing is posted).
    Never raises: the report only speeds up the driver's decision."""
    worker = session(connect=False)
    if worker is None:
        return
    from hora.core.engine import context

    own = context.get().rank if context.is_initialized() else None
    ranks = lost_peers(exc, own)
    if not ranks:
        return
    report = LostReport(worker.generation, ranks, _first_line(exc))
    try:
        worker.client.set(SCOPE, lost_key(worker.worker_id), encode_report(report))
    except (HoraError, OSError) as err:
        log.debug("could not report the lost peers %s to the driver: %s", ranks, err)


def lost_peers(exc: BaseException, own: int | None) -> tuple[int, ...]:
    """The peers ``exc`` says this generation lost, without ``own``: a PeerLostError's ``peer``
    first, then the peers its text names (``rank N (host H)``: the ranks' merged reasons,
    "...; other ranks report: rank 2 (host b) ...")."""
    first = [exc.peer] if isinstance(exc, PeerLostError) and exc.peer not in (None, own) else []
    return tuple(dict.fromkeys(first + list(named_ranks(str(exc), own))))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = ["report_lost", "reset", "run_fn"]
