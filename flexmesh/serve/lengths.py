"""Output lengths as distributions, and the predictors that give them (what length-aware queues and routers read).

A request's output length is uncertain until its end-of-sequence token is sampled. TIE (Zheng et al., "Scheduling
LLM Inference with Uncertainty-Aware Output Length Predictions", arXiv 2604.00499) fits it with a **log-t**
distribution, ``log L = mu + sigma * T`` with ``T`` Student-t of ``nu`` degrees of freedom (3.5, fixed, as its
public code fixes it), **censored** at the request's ``max_tokens`` (no answer is longer):
:class:`OutputLength`. Its mean and its CVaR (the mean of its worst ``1 - alpha``) are what TIE's queue orders by
(:mod:`flexmesh.serve.queues`). A point prediction is the same with ``sigma = 0``.

Both are integrals over the quantile function, ``E[min(L, cap)] = integral_0^1 min(Q(u), cap) du`` and
``CVaR_alpha = integral_alpha^1 min(Q(u), cap) du / (1 - alpha)``, taken here by the midpoint rule on a fixed grid
of :data:`GRID` quantiles of the t distribution (deterministic; TIE's own code samples 10,000 draws).

Predictors (:class:`LengthPredictor`: a request and its cap in, an :class:`OutputLength` out), by name in
:data:`PREDICTORS`:

- ``oracle``: the request's own ``output_tokens`` (what the trace says it generated), a point;
- ``noisy``: the oracle's log-length plus Gaussian noise of ``sigma`` (seeded by the request's id, so the
  simulator and the router draw the same), with that ``sigma`` as its spread: an honest predictor of known error;
- ``prompt``: a cheap model on the prompt's features, fitted to a trace (:meth:`PromptModel.fit`): least squares
  of the log-output on ``1, log prompt``, its residuals' log-t scale by maximum likelihood (SciPy).

>>> d = OutputLength(mu=math.log(100), sigma=0.0, cap=4096)
>>> round(d.mean()), round(d.cvar(0.9))
(100, 100)
>>> wide = OutputLength(mu=math.log(100), sigma=1.0, cap=4096)
>>> 100 < wide.mean() < wide.cvar(0.9) <= 4096
True
>>> round(OutputLength(mu=math.log(100), sigma=1.0, cap=120).cvar(0.9))  # censored: the tail is the cap
120
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import numpy as np

from flexmesh.data.requests import Request, Workload
from flexmesh.errors import SpecError

NU = 3.5  # TIE's degrees of freedom (its public code: Calu_logt_score.NU)
ALPHA = 0.9  # TIE's tail: CVaR at 90%
GRID = 2000  # quantiles the mean and CVaR are integrated over


@lru_cache(maxsize=8)
def _t_quantiles(nu: float) -> np.ndarray:
    from scipy.stats import t

    u = (np.arange(GRID) + 0.5) / GRID
    return np.asarray(t.ppf(u, df=nu), dtype=float)


@dataclass(frozen=True)
class OutputLength:
    """``log L = mu + sigma * T`` (T ~ Student-t, ``nu`` degrees of freedom), censored at ``cap`` tokens."""

    mu: float
    sigma: float
    cap: int
    nu: float = NU

    @classmethod
    def point(cls, tokens: float, cap: int) -> OutputLength:
        return cls(math.log(max(tokens, 1.0)), 0.0, cap)

    def _q(self) -> np.ndarray:
        return np.minimum(np.exp(np.minimum(self.mu + self.sigma * _t_quantiles(self.nu), 50.0)), self.cap)

    def mean(self) -> float:
        if self.sigma == 0:
            return min(math.exp(self.mu), self.cap)
        return float(self._q().mean())

    def cvar(self, alpha: float = ALPHA) -> float:
        """The mean of the longest ``1 - alpha`` of outputs (censored at the cap)."""
        if self.sigma == 0:
            return min(math.exp(self.mu), self.cap)
        start = int(round(alpha * GRID))
        return float(self._q()[start:].mean())

    def quantile(self, q: float) -> float:
        from scipy.stats import t

        return min(math.exp(self.mu + self.sigma * float(t.ppf(q, df=self.nu))), self.cap)


class LengthPredictor(Protocol):
    name: str

    def predict(self, r: Request, cap: int) -> OutputLength: ...


class Oracle:
    """The request's own output length."""

    name = "oracle"

    def predict(self, r: Request, cap: int) -> OutputLength:
        return OutputLength.point(r.output_tokens, cap)


def _normal(seed: int) -> float:
    """A standard normal draw seeded by ``seed`` alone (the same in every process)."""
    return float(np.random.default_rng(seed).standard_normal())


class NoisyOracle:
    """The oracle's log-length off by ``sigma`` x a standard normal seeded by the request's id (and ``seed``)."""

    name = "noisy"

    def __init__(self, sigma: float = 0.5, seed: int = 0):
        if not sigma > 0:
            raise SpecError(f"the noisy predictor's sigma must be > 0, got {sigma}")
        self.sigma, self.seed = sigma, seed

    def predict(self, r: Request, cap: int) -> OutputLength:
        z = _normal(zlib.crc32(f"{self.seed}:{r.id}".encode()))
        return OutputLength(math.log(max(r.output_tokens, 1)) + self.sigma * z, self.sigma, cap)


class PromptModel:
    """``log output = a + b log prompt + sigma * T``: least squares, then the residuals' log-t scale (maximum
    likelihood, ``nu`` fixed). Fit on requests other than those it predicts (a trace's earlier window).

    >>> from flexmesh.data.requests import Workload
    >>> reqs = tuple(Request(i, 0.0, p, 2 * p) for i, p in enumerate([10, 20, 40, 80, 160] * 4))
    >>> m = PromptModel.fit(Workload(reqs, "toy"))
    >>> round(m.b, 3), round(m.predict(Request(0, 0.0, 50, 0), 4096).mean())
    (1.0, 100)
    """

    name = "prompt"

    def __init__(self, a: float, b: float, sigma: float, loc: float = 0.0):
        self.a, self.b, self.sigma, self.loc = a, b, sigma, loc

    @classmethod
    def fit(cls, workload: Workload | Sequence[Request]) -> PromptModel:
        reqs = workload.requests if isinstance(workload, Workload) else tuple(workload)
        if len(reqs) < 3:
            raise SpecError(f"the prompt model needs at least 3 requests to fit, got {len(reqs)}")
        x = np.log(np.array([max(r.prompt_tokens, 1) for r in reqs], dtype=float))
        y = np.log(np.array([max(r.output_tokens, 1) for r in reqs], dtype=float))
        design = np.stack([np.ones_like(x), x], axis=1)
        (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
        resid = y - (a + b * x)
        if float(np.ptp(resid)) < 1e-12:
            return cls(float(a), float(b), 0.0)
        from scipy.stats import t

        _, loc, scale = t.fit(resid, fdf=NU)
        return cls(float(a), float(b), float(scale), float(loc))

    def predict(self, r: Request, cap: int) -> OutputLength:
        mu = self.a + self.loc + self.b * math.log(max(r.prompt_tokens, 1))
        return OutputLength(mu, self.sigma, cap)


def _prompt_model(fit_on: Workload | None, noise: float, seed: int) -> LengthPredictor:
    if fit_on is None:
        raise SpecError("the prompt predictor is fitted to a trace; give the requests to fit it on")
    return PromptModel.fit(fit_on)


# The length predictors, each made from the requests to fit on (the prompt model's), a noise and a seed.
PREDICTORS: dict[str, Callable[[Workload | None, float, int], LengthPredictor]] = {
    "oracle": lambda fit_on, noise, seed: Oracle(),
    "noisy": lambda fit_on, noise, seed: NoisyOracle(noise, seed),
    "prompt": _prompt_model,
}


def make_predictor(name: str, fit_on: Workload | None = None, noise: float = 0.5, seed: int = 0) -> LengthPredictor:
    """The predictor ``name`` (``prompt`` is fitted to ``fit_on``)."""
    make = PREDICTORS.get(name)
    if make is None:
        raise SpecError(f"unknown length predictor {name!r}; predictors: {', '.join(PREDICTORS)}")
    return make(fit_on, noise, seed)
