"""Bayesian optimisation of a noisy score over a box: the autotuner's search (rank 0 only).

A Gaussian process (scikit-learn's :class:`~sklearn.gaussian_process.GaussianProcessRegressor`)
models the score as a function of the point; the next point proposed is the one that maximises
the *expected improvement* over the best posterior mean at the points measured so far (the
noisy-observation form of Brochu, Cora and de Freitas, "A Tutorial on Bayesian Optimization of
Expensive Cost Functions", section 2.4, which Horovod's autotuner uses too).

Points are scaled to the unit cube and scores standardised before fitting, so ``noise`` (the
Gaussian process's noise level, ``HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE``) is the standard
deviation of a measurement's noise relative to the spread of the scores: 0 interpolates every
measurement exactly, 1 treats the spread as mostly noise.

scikit-learn is imported when an optimiser is made (never when this module is imported):
:func:`require_sklearn` says how to install it when it is missing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import numpy as np

from hora.errors import ConfigError

XI = 0.01
"""Exploration margin of the expected improvement, in standardised score units (Horovod's)."""

CANDIDATES = 2048
"""Random points at which the expected improvement is evaluated per proposal, before the best
few are refined by L-BFGS-B."""

REFINED = 4
"""How many of the best candidates are refined by a local optimiser."""


def require_sklearn(what: str) -> Any:
    """Import scikit-learn's Gaussian process module, or explain how to get it.

    Raises:
        ConfigError: scikit-learn is not installed; the message names ``what`` asked for it.
    """
    try:
        from sklearn import gaussian_process
    except ImportError as exc:
        raise ConfigError(
            f"{what} needs scikit-learn (its Gaussian process drives the Bayesian optimisation) "
            f"and it cannot be imported ({exc}). Install it with `pip install scikit-learn` "
            "(or `pip install hora[autotune]`), or turn autotune off.") from None
    return gaussian_process


class BayesianOptimizer:
    """Maximise an unknown, noisy function over a box, one measured point at a time.

    Args:
        bounds: ``(low, high)`` for each dimension (``low < high``).
        noise: the Gaussian process's noise level, in ``[0, 1]`` (see the module docstring).
        xi: exploration margin of the expected improvement (larger: more exploration).
        seed: seed of the random candidates (proposals are reproducible for a given history).
    """

    def __init__(self, bounds: Sequence[tuple[float, float]], noise: float, *,
                 xi: float = XI, seed: int = 0) -> None:
        if not bounds or any(not lo < hi for lo, hi in bounds):
            raise ValueError(f"bounds must be non-empty (low, high) pairs with low < high, "
                             f"got {list(bounds)}")
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {noise}")
        gp = require_sklearn("Bayesian optimisation")
        self._gp_module = gp
        self._low = np.array([lo for lo, _ in bounds], dtype=np.float64)
        self._span = np.array([hi - lo for lo, hi in bounds], dtype=np.float64)
        self._noise = noise
        self._xi = xi
        self._rng = np.random.default_rng(seed)
        self._seed = seed
        self._x: list[np.ndarray] = []  # unit-cube points
        self._y: list[float] = []
        self._exact: list[bool] = []  # known without measurement noise

    @property
    def dims(self) -> int:
        return len(self._low)

    def add(self, point: Sequence[float], score: float, *, exact: bool = False) -> None:
        """Record ``score`` measured at ``point`` (in the box's units; clipped into the box);
        ``exact``: the score is known without noise (the Gaussian process then goes through
        it)."""
        if not math.isfinite(score):
            raise ValueError(f"score must be finite, got {score}")
        x = (np.asarray(point, dtype=np.float64) - self._low) / self._span
        if x.shape != (self.dims,):
            raise ValueError(f"point must have {self.dims} coordinates, got {list(point)}")
        self._x.append(np.clip(x, 0.0, 1.0))
        self._y.append(float(score))
        self._exact.append(exact)

    def best(self) -> tuple[list[float], float]:
        """The measured point with the highest score, and that score.

        Raises:
            ValueError: nothing was measured yet.
        """
        if not self._y:
            raise ValueError("no point was measured yet")
        i = int(np.argmax(self._y))
        return self._to_box(self._x[i]), self._y[i]

    def propose(self) -> list[float]:
        """The next point to measure: where the expected improvement is largest (a random point
        while nothing is measured)."""
        if not self._x:
            return self._to_box(self._rng.random(self.dims))
        with _one_thread():
            return self._propose()

    def _propose(self) -> list[float]:
        model, y_best = self._fit()
        candidates = np.vstack([self._rng.random((CANDIDATES, self.dims)),
                                np.clip(np.array(self._x) + self._rng.normal(
                                    0.0, 0.05, (len(self._x), self.dims)), 0.0, 1.0)])
        ei = self._expected_improvement(model, candidates, y_best)
        best_x, best_ei = candidates[int(np.argmax(ei))], float(np.max(ei))
        from scipy.optimize import minimize  # (a dependency of scikit-learn)

        def negative_ei(x: np.ndarray) -> float:
            return -float(self._expected_improvement(model, x.reshape(1, -1), y_best)[0])

        for start in candidates[np.argsort(ei)[-REFINED:]]:
            found = minimize(negative_ei, start, method="L-BFGS-B",
                             bounds=[(0.0, 1.0)] * self.dims)
            if -float(found.fun) > best_ei:
                best_x, best_ei = np.clip(found.x, 0.0, 1.0), -float(found.fun)
        return self._to_box(best_x)

    def predict(self, points: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and standard deviation of the score at ``points`` (box units)."""
        with _one_thread():
            model, _ = self._fit()
            x = (np.asarray(points, dtype=np.float64) - self._low) / self._span
            mu, sigma = model.predict(x, return_std=True)
        scale, shift = self._scale()
        return mu * scale + shift, sigma * scale

    # ---- internals ----------------------------------------------------------------------------
    def _scale(self) -> tuple[float, float]:
        y = np.array(self._y)
        spread = float(np.std(y))
        return (spread if spread > 0 else max(abs(float(np.mean(y))), 1.0)), float(np.mean(y))

    def _fit(self) -> tuple[Any, float]:
        """The Gaussian process fitted to the standardised scores, and the best posterior mean
        at a measured point (the incumbent of the expected improvement)."""
        kernels = self._gp_module.kernels
        scale, shift = self._scale()
        x = np.array(self._x)
        y = (np.array(self._y) - shift) / scale
        kernel = kernels.ConstantKernel(1.0, (1e-2, 1e2)) * kernels.RBF(
            length_scale=np.full(self.dims, 0.3), length_scale_bounds=(0.05, 10.0))
        model = self._gp_module.GaussianProcessRegressor(
            kernel=kernel, normalize_y=False,
            alpha=np.array([1e-6 if exact else self._noise ** 2 + 1e-6 for exact in self._exact]),
            n_restarts_optimizer=2, random_state=self._seed)
        import warnings

        with warnings.catch_warnings():  # few points: the fit may touch a bound, harmlessly
            warnings.simplefilter("ignore")
            model.fit(x, y)
        return model, float(np.max(model.predict(x)))

    def _expected_improvement(self, model: Any, x: np.ndarray, y_best: float) -> np.ndarray:
        from scipy.stats import norm

        mu, sigma = model.predict(x, return_std=True)
        improvement = mu - y_best - self._xi
        with np.errstate(divide="ignore", invalid="ignore"):
            z = improvement / sigma
            ei = improvement * norm.cdf(z) + sigma * norm.pdf(z)
        return np.where(sigma > 1e-12, ei, 0.0)

    def _to_box(self, x: np.ndarray) -> list[float]:
        return [float(v) for v in self._low + np.clip(x, 0.0, 1.0) * self._span]


def _one_thread() -> AbstractContextManager[Any]:
    """BLAS and OpenMP pools limited to one thread: on a busy host a threaded solve of a tiny
    Gaussian process is ten times slower than a serial one (threadpoolctl comes with
    scikit-learn)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return nullcontext()
    return cast(AbstractContextManager[Any], threadpool_limits(limits=1))


__all__ = ["BayesianOptimizer", "require_sklearn"]
