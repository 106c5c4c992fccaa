"""The autotuner's search on rank 0: scoring the setting in force, choosing the next, the log.

Half of :mod:`hora.core.autotune.autotune` (which applies settings on every rank). Horovod's
``ParameterManager``, redone over :mod:`hora.core.autotune.bayesopt`:

* :class:`Params` is one setting of the tunables: fusion threshold, cycle time, hierarchical
  allreduce and allgather (and whether tuning goes on);
* :class:`Sampler` measures the setting in force: bytes allreduced (and allgathered) per
  microsecond over a *window* that closes when some tensor name has been seen
  ``steps_per_sample`` more times;
* :class:`PairedSample` scores a candidate setting against the starting one: their windows
  alternate, and the score is the median of the candidate's rate over the starting setting's in
  the window next to it (1.0: as fast). Horovod scores bytes per microsecond of the candidate
  alone, which a machine whose speed drifts while tuning turns into noise;
* :class:`Search` turns scores into the next setting: the first ``warmup_samples`` scores are
  discarded; then the fusion threshold and cycle time are tuned jointly (the starting setting
  and four probes first, then points proposed by Bayesian optimisation) for
  ``bayes_opt_max_samples`` samples; then each applicable on/off choice (hierarchical allreduce,
  then hierarchical allgather, for jobs spanning hosts with several ranks on a host) is tried
  the other way round with the best setting so far. The joint search's best is the measured
  setting whose score the Gaussian process estimates highest (not the single luckiest sample);
  an on/off choice is kept when its sample beats that estimate. A tunable the user set
  explicitly is fixed and left out of the search;
* :class:`CsvLog` writes ``HOROVOD_AUTOTUNE_LOG`` in Horovod's columns.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, TextIO

import numpy as np

from hora._util.log import get_logger
from hora.config import Config
from hora.core.autotune.bayesopt import BayesianOptimizer
from hora.errors import ConfigError, ProtocolError
from hora.knobs import MiB

log = get_logger(__name__)

PAIRS = 3
"""Windows of the candidate per sample, each followed by one of the reference (the starting
setting); Horovod measures 5 windows of the candidate alone."""

FUSION_MB = (0.0, 64.0)
"""Range searched for the fusion threshold, in MB (Horovod's)."""

CYCLE_MS = (0.0, 20.0)
"""Range searched for the cycle time, in ms. Horovod searches 1-100 ms of its polling period;
hora's cycle time is how long a ready tensor is held for others to join it (0: not at all), so
its useful range starts at 0 and ends far lower."""

PROBES: tuple[tuple[float, float], ...] = ((4.0, 1.0), (32.0, 10.0), (16.0, 5.0), (8.0, 2.0))
"""(fusion MB, cycle ms) measured after the starting setting, before the optimiser proposes:
Horovod's four probes, their cycle times scaled into :data:`CYCLE_MS`."""

TUNABLES = ("fusion_threshold", "cycle_time", "hierarchical_allreduce", "hierarchical_allgather")
"""The knobs autotune may change (unless the user set them explicitly)."""

HEADER = ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,"
          "cycle_time_ms,tensor_fusion_threshold,score")
"""Horovod's autotune log columns (the threshold in MB; the score in bytes per microsecond)."""


@dataclass(frozen=True)
class Params:
    """One setting of the tunables, as broadcast by rank 0.

    Attributes:
        fusion_threshold: bytes.
        cycle_time: milliseconds.
        hierarchical_allreduce: None is automatic (:mod:`hora.core.data.routing`).
        hierarchical_allgather: on or off.
        active: True while tuning goes on; False for the final (best) setting.
    """

    fusion_threshold: int
    cycle_time: float
    hierarchical_allreduce: bool | None
    hierarchical_allgather: bool
    active: bool = True

    @classmethod
    def of(cls, config: Config, *, active: bool = True) -> Params:
        return cls(config.fusion_threshold, config.cycle_time, config.hierarchical_allreduce,
                   config.hierarchical_allgather, active)

    def configure(self, config: Config) -> Config:
        """``config`` with this setting's tunables."""
        return config.replace(fusion_threshold=self.fusion_threshold, cycle_time=self.cycle_time,
                              hierarchical_allreduce=self.hierarchical_allreduce,
                              hierarchical_allgather=self.hierarchical_allgather)

    def same_setting(self, other: Params) -> bool:
        """Whether both set the tunables alike (``active`` aside)."""
        return replace(self, active=other.active) == other

    def describe(self) -> str:
        hier = {None: "auto", True: "on", False: "off"}
        return (f"fusion threshold {self.fusion_threshold / MiB:.2f} MB, cycle time "
                f"{self.cycle_time:.3f} ms, hierarchical allreduce "
                f"{hier[self.hierarchical_allreduce]}, hierarchical allgather "
                f"{hier[self.hierarchical_allgather]}")

    def to_wire(self) -> dict[str, Any]:
        return {"fusion": self.fusion_threshold, "cycle": self.cycle_time,
                "hier_allreduce": self.hierarchical_allreduce,
                "hier_allgather": self.hierarchical_allgather, "active": self.active}

    @classmethod
    def from_wire(cls, raw: Any) -> Params:
        """Parse :meth:`to_wire`'s form, type-checked.

        Raises:
            ProtocolError: malformed.
        """
        try:
            fusion, cycle = raw["fusion"], raw["cycle"]
            hier_ar, hier_ag, active = raw["hier_allreduce"], raw["hier_allgather"], raw["active"]
        except (TypeError, KeyError) as exc:
            raise ProtocolError(f"malformed autotune parameters: missing {exc}") from None
        if not (isinstance(fusion, int) and not isinstance(fusion, bool) and fusion >= 0
                and isinstance(cycle, (int, float)) and not isinstance(cycle, bool)
                and math.isfinite(cycle) and cycle >= 0
                and (hier_ar is None or isinstance(hier_ar, bool))
                and isinstance(hier_ag, bool) and isinstance(active, bool)):
            raise ProtocolError(f"malformed autotune parameters: {raw!r}")
        return cls(fusion, float(cycle), hier_ar, hier_ag, active)


def fixed_by_user(env: Any) -> frozenset[str]:
    """The tunables set explicitly in ``env`` (``HORA_*`` or ``HOROVOD_*``): autotune keeps them."""
    from hora.knobs import KNOBS_BY_NAME

    return frozenset(name for name in TUNABLES
                     if any(var in env for var in (KNOBS_BY_NAME[name].env,
                                                   KNOBS_BY_NAME[name].alias) if var))


class Sampler:
    """Measures one window of the setting in force from the collectives rank 0 runs: bytes per
    microsecond until some tensor name is seen ``steps_per_sample`` more times (the op that
    closes it is not counted: it belongs to the next window)."""

    def __init__(self, steps_per_sample: int) -> None:
        self._steps = max(1, steps_per_sample)
        self._counts: dict[str, int] = {}
        self._open = False  # nothing is counted before the first start
        self._bytes = 0
        self._start = 0.0

    def start(self, now: float) -> None:
        """Open a window at ``now`` (seconds)."""
        self._counts.clear()
        self._bytes = 0
        self._start = now
        self._open = True

    def add(self, names: Sequence[str], nbytes: int, now: float) -> float | None:
        """Count a collective of ``nbytes`` over tensors ``names`` at ``now``; the window's bytes
        per microsecond when this closes it, else None (also after that, until :meth:`start`)."""
        if not self._open:
            return None
        for name in names:
            seen = self._counts.get(name, 0)
            if seen >= self._steps:
                self._open = False
                return self._bytes / (max(now - self._start, 1e-6) * 1e6)
            self._counts[name] = seen + 1
        self._bytes += nbytes
        return None


class PairedSample:
    """One sample: windows of ``candidate`` alternating with windows of ``reference`` (C R C R
    ...), :data:`PAIRS` of each. Its score is the median over the pairs of the candidate's rate
    over the reference's in the window next to it, so a machine that speeds up or slows down
    while tuning (other jobs, turbo, thermal limits) moves both alike and cancels out."""

    def __init__(self, candidate: Params, reference: Params) -> None:
        self.candidate = candidate
        self.reference = reference
        self._rates: list[float] = []

    @property
    def setting(self) -> Params:
        """The setting of the next window."""
        return self.candidate if len(self._rates) % 2 == 0 else self.reference

    @property
    def done(self) -> bool:
        return len(self._rates) >= 2 * PAIRS

    def record(self, rate: float) -> bool:
        """The next window measured ``rate`` bytes/us; True when the sample is complete."""
        self._rates.append(rate)
        return self.done

    def score(self) -> float:
        """Median of candidate rate / reference rate over the pairs (1.0: as fast)."""
        pairs = zip(self._rates[0::2], self._rates[1::2])
        return statistics.median(c / r if r > 0 else (1.0 if c == 0 else 2.0) for c, r in pairs)

    def rates(self) -> tuple[float, float]:
        """Median bytes/us of the candidate's windows and of the reference's."""
        return statistics.median(self._rates[0::2]), statistics.median(self._rates[1::2])


class CsvLog:
    """``HOROVOD_AUTOTUNE_LOG``: Horovod's columns, one row per scored sample, then the best.

    Raises:
        ConfigError: the file cannot be written (on creation).
    """

    def __init__(self, path: str, auto_hierarchical: bool, cache_enabled: bool) -> None:
        self._auto = auto_hierarchical
        self._cache = int(cache_enabled)  # (not tuned by hora: the fast lane stays as set)
        try:
            self._file: TextIO = open(path, "w", encoding="utf-8")  # noqa: SIM115 (kept open)
            self._file.write(HEADER + "\n")
            self._file.flush()
        except OSError as exc:
            raise ConfigError(f"HOROVOD_AUTOTUNE_LOG={path!r}: cannot write the autotune log "
                              f"there: {exc}") from None

    def row(self, params: Params, score: float) -> None:
        hier = (self._auto if params.hierarchical_allreduce is None
                else params.hierarchical_allreduce)
        self._file.write(f"{int(hier)},{int(params.hierarchical_allgather)},0,{self._cache},"
                         f"{params.cycle_time:g},{params.fusion_threshold / MiB:g},"
                         f"{score:.6g}\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class Search:
    """Rank 0's choice of settings (see the module docstring). Scores are relative to the
    starting setting (:class:`PairedSample`): the starting setting's is 1 by definition, so its
    own measurement (the first sample: the noise of one sample, for the log) reaches the model
    as exactly 1, and a setting must show better scores than the noise to be preferred to it.

    Args:
        start: the setting the job started with (the first one measured).
        fixed: tunables the user set explicitly (not searched).
        categorical: the on/off tunables that apply to this job (``hierarchical_allreduce``,
            ``hierarchical_allgather``), each tried the other way round after the joint search.
        auto_hierarchical: what an automatic hierarchical allreduce amounts to in this job.
        warmup: scores discarded first.
        max_samples: settings measured by the joint search.
        noise: the Gaussian process's noise level.
        seed: the optimiser's seed.
    """

    def __init__(self, start: Params, *, fixed: frozenset[str], categorical: Sequence[str],
                 auto_hierarchical: bool, warmup: int, max_samples: int, noise: float,
                 seed: int = 0) -> None:
        self._fixed_mb = start.fusion_threshold / MiB if "fusion_threshold" in fixed else None
        self._fixed_ms = start.cycle_time if "cycle_time" in fixed else None
        self._free = [i for i, f in enumerate((self._fixed_mb, self._fixed_ms)) if f is None]
        first = (min(start.fusion_threshold / MiB, FUSION_MB[1]),
                 min(start.cycle_time, CYCLE_MS[1]))
        probes: list[tuple[float, float]] = []
        for mb, ms in (first, *PROBES):
            point = (mb if self._fixed_mb is None else self._fixed_mb,
                     ms if self._fixed_ms is None else self._fixed_ms)
            if point not in probes:
                probes.append(point)
        self._probes = probes if self._free else probes[:1]
        self._max = max(1, max_samples) if self._free else 1  # (the start, scored once)
        bounds = [(FUSION_MB, CYCLE_MS)[i] for i in self._free]
        self._bo = BayesianOptimizer(bounds, noise, seed=seed) if self._free else None
        self._categorical = [c for c in categorical if c not in fixed]
        self._auto = auto_hierarchical
        self._warmup = max(0, warmup)
        self._joint = 0  # joint settings scored
        self._tried: list[str] = []  # categorical tunables tried
        self.current = self._with_point(replace(start, active=True), self._probes[0])
        self.history: list[tuple[Params, float]] = []
        self.best: tuple[Params, float] | None = None

    @property
    def nothing_to_tune(self) -> bool:
        return not self._free and not self._categorical

    @property
    def planned(self) -> int:
        """Scored samples the search takes in all (warm-up aside)."""
        return self._max + len(self._categorical)

    def tune(self, score: float, detail: str = "") -> Params:
        """Feed the score of :attr:`current` (``detail``: what the log line adds); the next
        setting (``active`` False: the final)."""
        if self._warmup > 0:
            self._warmup -= 1
            log.info("autotune: warming up (%d sample(s) remaining)", self._warmup)
            return self.current
        scored = self.current
        self.history.append((scored, score))
        if self.best is None or score > self.best[1]:
            self.best = (scored, score)
        hier = (self._auto if scored.hierarchical_allreduce is None
                else scored.hierarchical_allreduce)
        log.info("autotune: [hierarchical_allreduce, hierarchical_allgather, cycle_time_ms, "
                 "tensor_fusion_threshold] = [%d, %d, %g ms, %g MB] score %.4g%s "
                 "(sample %d of %d)", hier, scored.hierarchical_allgather, scored.cycle_time,
                 scored.fusion_threshold / MiB, score, detail, len(self.history), self.planned)
        nxt = self._next(scored, score)
        self.current = nxt
        return nxt

    def finish(self) -> Params:
        """The best setting so far as the final one (``active`` False)."""
        best = self.best[0] if self.best is not None else self.current
        self.current = replace(best, active=False)
        return self.current

    def _next(self, scored: Params, score: float) -> Params:
        assert self.best is not None
        if self._joint < self._max:  # this score was of the joint search
            self._joint += 1
            if self._bo is not None:  # the starting setting scores 1 against itself, exactly
                start = self._joint == 1
                self._bo.add(self._point(scored), 1.0 if start else score, exact=start)
            if self._joint < self._max:
                assert self._bo is not None
                if self._joint < len(self._probes):
                    return self._with_point(scored, self._probes[self._joint])
                return self._with_point(scored, self._full(self._bo.propose()))
            if self._bo is not None:
                self.best = self._model_best()
        if len(self._tried) < len(self._categorical):
            name = self._categorical[len(self._tried)]
            self._tried.append(name)
            best = self.best[0]
            value = getattr(best, name)
            if name == "hierarchical_allreduce" and value is None:
                value = self._auto
            return replace(best, **{name: not value}, active=True)
        return self.finish()

    def _model_best(self) -> tuple[Params, float]:
        """The joint search's choice: of the settings it measured, the one whose score the
        Gaussian process estimates highest (its posterior mean), with that estimate. A noisy
        sample that got lucky is outvoted by its neighbours; the best single score is not."""
        assert self._bo is not None
        measured = self.history[:self._max]
        mean, _ = self._bo.predict([self._point(p) for p, _ in measured])
        i = int(np.argmax(mean))
        log.info("autotune: the model's best of %d settings: %s, estimated score %.4g (measured "
                 "%.4g; the best single score was %.4g)", len(measured), measured[i][0].describe(),
                 mean[i], measured[i][1], max(score for _, score in measured))
        return measured[i][0], float(mean[i])

    # ---- points of the joint search: (fusion MB, cycle ms) ------------------------------------
    def _point(self, params: Params) -> list[float]:
        both = (params.fusion_threshold / MiB, params.cycle_time)
        return [both[i] for i in self._free]

    def _full(self, free: list[float]) -> tuple[float, float]:
        both = [self._fixed_mb or 0.0, self._fixed_ms or 0.0]
        for i, value in zip(self._free, free):
            both[i] = value
        return both[0], both[1]

    def _with_point(self, params: Params, point: tuple[float, float]) -> Params:
        mb, ms = point
        return replace(params, fusion_threshold=int(round(mb * MiB)),
                       cycle_time=round(float(ms), 3))


__all__ = ["CYCLE_MS", "FUSION_MB", "HEADER", "PAIRS", "PROBES", "TUNABLES", "CsvLog",
           "PairedSample", "Params", "Sampler", "Search", "fixed_by_user"]
