"""Autotune (``HOROVOD_AUTOTUNE=1``): the tunables in force on every rank, chosen by rank 0.

Every rank's engine owns one :class:`Tuning`. It holds the setting in force (fusion threshold,
cycle time, hierarchical allreduce and allgather:
:class:`~hora.core.autotune.autotune_search.Params`)
and hands each new setting to the parts that read them (:class:`Retunable`: rank 0's
coordinator fuses and holds responses by it, the fast lanes' leaders fuse by it, the executor
builds routes by it). On rank 0 it sees the collectives run through the parts that run them
(:class:`Observed`: the engine's executor and the fast lanes). The engine names both lists
when it builds its :class:`Tuning`; autotune reaches nothing else.

**Who decides.** Only rank 0 tunes (:mod:`hora.core.autotune.autotune_search` measures windows of
the setting in force from the collectives it runs, the setting tried alternating with the starting
one, and picks the next; the optimiser runs on a helper thread, so the engine never waits for
it). Rank 0 sends every new setting (each window's) to the other ranks as a
:data:`~hora.core.op.messages.MSG_PARAMS` control message and applies it itself, both on its engine
thread between two batches of responses. A worker applies it on its engine thread when the
message arrives: after the responses rank 0 sent before it and before those it sent after, so
every rank switches at the same point of the response order. Fusion stays consistent whatever
the timing, because one party decides each fusion (the coordinator, or a lane's leader); a
route (hierarchical or not) is rebuilt by all members of its set at the same response.

When the search is over, the chosen setting is broadcast as the final one (``active`` False)
and kept for the rest of the job.

:meth:`Tuning.request` (rank 0, hora-only, for benchmarks and tests) imposes a setting through
the same path, whether autotune is on or not.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

from hora._util.log import get_logger
from hora.collectives.ops import to_dtype
from hora.config import Config
from hora.core.autotune.autotune_search import (
    PAIRS,
    CsvLog,
    PairedSample,
    Params,
    Sampler,
    Search,
    fixed_by_user,
)
from hora.core.autotune.bayesopt import require_sklearn
from hora.core.op.messages import MSG_PARAMS, OpKind, Response, encode
from hora.errors import HoraTimeoutError
from hora.transports.base import Transport

log = get_logger(__name__)

REQUEST_TIMEOUT_S = 30.0
"""How long :meth:`Tuning.request` waits for the engine thread to apply a setting."""


class Retunable(Protocol):
    """A part of the engine that reads tunables: told the new config at each change (the engine
    thread, at the same point of the response order on every rank)."""

    def retune(self, config: Config) -> None: ...


class Observed(Protocol):
    """A part of the engine that runs collectives: rank 0's tuner sets its ``observe``, which it
    calls with each allreduce and allgather response it runs (from whichever thread runs it)."""

    observe: Callable[[Response], None] | None


def spans_hosts(hostnames: Sequence[str] | None) -> bool:
    """Whether ranks on ``hostnames`` span several hosts with several ranks on some host (where
    hierarchical collectives apply)."""
    hosts = set(hostnames or ())
    return 1 < len(hosts) < len(hostnames or ())


class Tuning:
    """This rank's tunables, and on rank 0 with autotune on, the tuner.

    Args:
        config: the job's configuration (autotune knobs, starting tunables).
        transport: rank 0 sends new settings to the others over its control plane.
        departed: ranks that left cleanly (sent nothing more).
        hostnames: every rank's host (hierarchical choices apply only across hosts).
        retunables: the parts that read tunables, told each new setting in this order.
        observed: the parts that run collectives: on rank 0 with autotune on, each gets
            :meth:`observe` as its ``observe``.
        env: where to see which tunables the user set explicitly (default ``os.environ``).

    Raises:
        ConfigError: rank 0 with autotune on: scikit-learn is missing, or the log file cannot
            be written.
    """

    def __init__(self, config: Config, transport: Transport, departed: AbstractSet[int],
                 hostnames: Sequence[str] | None, *, retunables: Sequence[Retunable],
                 observed: Sequence[Observed] = (),
                 env: Mapping[str, str] | None = None) -> None:
        self._config = config
        self._transport = transport
        self._departed = departed
        self._targets = list(retunables)
        self.current = Params.of(config, active=config.autotune)
        self.applied: list[Params] = []  # every setting applied here, in order (tests, logs)
        self._lock = threading.Lock()
        self._requested: Params | None = None
        self._request_done = threading.Event()
        self._pending: Params | None = None  # computed, to apply and send (engine thread)
        self._logged = 0  # samples written to the log file
        self._search: Search | None = None
        self._reference: Params | None = None  # the starting setting: every sample's yardstick
        self._sample: PairedSample | None = None  # the sample being measured
        self._sampler: Sampler | None = None
        self._log: CsvLog | None = None
        if config.autotune and transport.rank == 0:
            self._start_search(config, hostnames, os.environ if env is None else env)
        if self._sampler is not None:
            for part in observed:
                part.observe = self.observe

    @property
    def active(self) -> bool:
        """Whether autotune is still trying settings (False when off or finished)."""
        return self.current.active

    @property
    def observing(self) -> bool:
        """Whether :meth:`observe` wants to see the collectives this rank runs."""
        return self._sampler is not None

    def _start_search(self, config: Config, hostnames: Sequence[str] | None,
                      env: Mapping[str, str]) -> None:
        require_sklearn("autotune (HOROVOD_AUTOTUNE=1, hora run --autotune)")
        auto = spans_hosts(hostnames)
        fixed = fixed_by_user(env)
        search = Search(self.current, fixed=fixed,
                        categorical=("hierarchical_allreduce", "hierarchical_allgather")
                        if auto else (), auto_hierarchical=auto,
                        warmup=config.autotune_warmup_samples,
                        max_samples=config.autotune_bayes_opt_max_samples,
                        noise=config.autotune_gaussian_process_noise)
        if config.autotune_log:
            self._log = CsvLog(config.autotune_log, auto, config.cache_capacity > 0)
        self._search = search
        if search.nothing_to_tune:
            log.warning("autotune: nothing to tune: every tunable was set explicitly (%s)",
                        ", ".join(sorted(fixed)))
            self._pending = search.finish()
            return
        self._sampler = Sampler(config.autotune_steps_per_sample)
        self._reference = search.current
        self._sample = PairedSample(search.current, search.current)
        self._pending = search.current
        log.info("autotune: tuning %s from %s; %d warm-up sample(s), then %d sample(s) of %d "
                 "windows of %d steps (the setting tried alternating with the starting one)",
                 ", ".join(n for n in ("fusion_threshold", "cycle_time", "hierarchical_allreduce",
                                       "hierarchical_allgather")
                           if n not in fixed and (auto or "hier" not in n)),
                 search.current.describe(), config.autotune_warmup_samples, search.planned,
                 2 * PAIRS, config.autotune_steps_per_sample)

    # ---- rank 0, any thread that runs a collective ------------------------------------------
    def observe(self, resp: Response) -> None:
        """Rank 0 ran (or is about to run) ``resp``: count its bytes toward the window."""
        if self._sampler is None:  # tuning is over
            return
        if resp.kind is OpKind.ALLREDUCE:
            count = sum(_prod(s) for s in resp.shapes)
        elif resp.kind is OpKind.ALLGATHER and resp.shapes:
            count = sum(sum(dims) for dims in resp.first_dims) * _prod(resp.shapes[0][1:])
        else:
            return
        nbytes = count * to_dtype(resp.dtype).itemsize
        now = time.monotonic()
        with self._lock:
            sampler, sample = self._sampler, self._sample
            # (a closed window counts nothing more until the next setting opens one)
            rate = None if sampler is None else sampler.add(resp.names, nbytes, now)
            if rate is None or sample is None:
                return
            finished = sample.record(rate)
            if not finished:
                self._pending = sample.setting  # the next window's: candidate or reference
        if finished:
            threading.Thread(target=self._think, args=(sample,), name="hora-autotune",
                             daemon=True).start()
        else:
            self._transport.wake()

    def _think(self, sample: PairedSample) -> None:
        """Helper thread: the next setting from a finished sample (the optimiser may take
        ~0.1 s)."""
        search = self._search
        assert search is not None and self._reference is not None
        try:
            mine, theirs = sample.rates()
            nxt = search.tune(sample.score(), f" ({mine:.4g} bytes/us against {theirs:.4g} for "
                                              "the starting setting)")
        except Exception:  # noqa: BLE001 - a helper thread must not die silently
            log.exception("autotune: the optimiser failed; keeping the best setting so far")
            nxt = search.finish()
        with self._lock:
            self._sample = PairedSample(nxt, self._reference) if nxt.active else None
            self._pending = nxt
        try:
            self._transport.wake()
        except OSError:  # the engine stopped meanwhile: nothing more to apply
            log.debug("autotune: the engine stopped before the next setting", exc_info=True)

    # ---- rank 0, engine thread ----------------------------------------------------------------
    def poll(self) -> bool:
        """Apply and send a setting that is due (the next window's, the final one, or a
        request); True if one was applied."""
        if self._pending is None and self._requested is None:
            return False
        with self._lock:
            requested, self._requested = self._requested, None
            pending = None
            if requested is None:
                pending, self._pending = self._pending, None
        if requested is not None:
            self._send(requested)
            self.apply(requested)
            self._request_done.set()
            return True
        if pending is None:
            return False
        self._write_log(pending)
        same = pending.active and self.applied and pending.same_setting(self.current)
        if not same:  # (the same setting again, e.g. while warming up: nothing to send)
            self._send(pending)
            self.apply(pending)
        if pending.active:
            with self._lock:
                if self._sampler is not None:
                    self._sampler.start(time.monotonic())
        else:
            with self._lock:
                self._sampler = None
            search = self._search
            assert search is not None
            best = search.best[1] if search.best is not None else float("nan")
            log.info("autotune: done after %d sample(s); best: %s (score %.3f: its bytes per "
                     "second over the starting setting's)", len(search.history),
                     pending.describe(), best)
        return not same

    def _write_log(self, nxt: Params) -> None:
        """The CSV rows of the samples scored since the last call; the final row with ``nxt``
        when it is the final setting."""
        search, csv = self._search, self._log
        if search is None or csv is None:
            return
        for scored, score in search.history[self._logged:]:
            csv.row(scored, score)
        self._logged = len(search.history)
        if not nxt.active:
            if search.best is not None:
                csv.row(nxt, search.best[1])
            csv.close()
            self._log = None

    def _send(self, params: Params) -> None:
        payload = encode(MSG_PARAMS, params=params.to_wire())
        for peer in range(1, self._transport.size):
            if peer not in self._departed:
                self._transport.send_control(peer, payload)

    def request(self, params: Params, timeout: float = REQUEST_TIMEOUT_S) -> None:
        """hora-only (benchmarks, tests), rank 0: impose ``params`` on every rank now, through
        the path autotune uses; returns once rank 0 applied and sent it (an op submitted after
        this returns runs with it on every rank).

        Raises:
            ValueError: not rank 0, or autotune is still tuning.
            HoraTimeoutError: the engine thread did not apply it within ``timeout``.
        """
        if self._transport.rank != 0:
            raise ValueError("only rank 0 may impose tunables (it sends them to the others)")
        if self.active:
            raise ValueError("autotune is still tuning: wait until Tuning.active is False")
        self._request_done.clear()
        with self._lock:
            self._requested = params
        self._transport.wake()
        if not self._request_done.wait(timeout):
            raise HoraTimeoutError(f"the engine did not apply the tunables within {timeout} s")

    # ---- every rank, engine thread -------------------------------------------------------------
    def receive(self, body: Mapping[str, Any]) -> None:
        """A worker: rank 0's :data:`~hora.core.op.messages.MSG_PARAMS`: apply it now."""
        self.apply(Params.from_wire(body.get("params")))

    def apply(self, params: Params) -> None:
        """Make ``params`` the setting in force on this rank (engine thread)."""
        self._config = params.configure(self._config)
        for target in self._targets:
            target.retune(self._config)
        self.current = params
        self.applied.append(params)
        log.log(logging.DEBUG if params.active else logging.INFO, "autotune: %s (%s)",
                params.describe(), "trying" if params.active else "final")


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = ["REQUEST_TIMEOUT_S", "Observed", "Retunable", "Tuning", "spans_hosts"]
