"""Least-squares fits of measured timings and byte counts: alpha-beta, linear, linear + quadratic.

Every fit is a non-negative least squares in *relative* error: each row is divided by its measured
value, so a sweep whose samples span four orders of magnitude (a 1 KiB all-reduce next to a 64 MiB
one) fits the small samples as well as the large ones, and a coefficient a noisy sweep would drive
below zero stops at zero instead of predicting negative time. Timings on shared machines have
outliers (another process took the core), so the linear solution (SciPy's ``lsq_linear``) is
refined with a robust loss (SciPy's ``least_squares``, soft L1: residuals beyond ``ROBUST_SCALE``
relative error count linearly, not squared). Exact data is recovered exactly either way.

>>> import numpy as np
>>> n = np.array([1e3, 1e4, 1e5, 1e6])
>>> a, b = fit_alpha_beta(n, 5e-5 + 2e-9 * n)
>>> round(a * 1e6, 3), round(b * 1e9, 3)
(50.0, 2.0)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares as _robust
from scipy.optimize import lsq_linear

from flexmesh.errors import ProfileError

ROBUST_SCALE = 0.1  # relative residual beyond which a sample counts as a possible outlier


def least_squares(features, y, relative: bool = True, robust: bool = True) -> np.ndarray:
    """Non-negative coefficients ``c`` minimising ``|features @ c - y|`` (relative to ``y`` by default)."""
    a = np.asarray(features, dtype=float)
    y = np.asarray(y, dtype=float)
    if a.ndim != 2 or a.shape[0] != y.shape[0]:
        raise ValueError(f"features {a.shape} and values {y.shape} do not match")
    if a.shape[0] < a.shape[1]:
        raise ProfileError(f"{a.shape[0]} samples cannot fit {a.shape[1]} coefficients; widen the sweep")
    w = 1.0 / np.maximum(np.abs(y), 1e-300) if relative else np.ones_like(y)
    # Columns scaled to unit norm so that seconds-per-byte and seconds share one tolerance.
    aw = a * w[:, None]
    norms = np.linalg.norm(aw, axis=0)
    norms[norms == 0] = 1.0
    a_n, b = aw / norms, y * w
    x = lsq_linear(a_n, b, bounds=(0.0, np.inf), method="bvls").x
    if robust and np.any(np.abs(a_n @ x - b) > 1e-9):
        scale = ROBUST_SCALE * (1.0 if relative else float(np.median(np.abs(b))) or 1.0)
        x = _robust(lambda c: a_n @ c - b, np.maximum(x, 1e-12), jac=lambda c: a_n, bounds=(0.0, np.inf),
                    loss="soft_l1", f_scale=scale, method="trf").x
    return x / norms


def fit_whole(parts, measured) -> tuple[float, float]:
    """``measured = factor * parts + fixed`` (both >= 0, least squares in relative error): the whole
    model's time against the sum of its parts' fits, and its fixed seconds per micro-batch.

    >>> parts = [0.01, 0.02, 0.05, 0.1]
    >>> k, fixed = fit_whole(parts, [1.1 * p + 0.004 for p in parts])
    >>> round(k, 3), round(fixed, 4)
    (1.1, 0.004)
    """
    p = np.asarray(parts, dtype=float)
    k, fixed = least_squares(np.stack([p, np.ones_like(p)], axis=1), measured)
    return float(k), float(fixed)


def fit_alpha_beta(nbytes, seconds) -> tuple[float, float]:
    """``seconds = alpha + beta * nbytes``: latency (s) and inverse bandwidth (s/byte)."""
    n = np.asarray(nbytes, dtype=float)
    alpha, beta = least_squares(np.stack([np.ones_like(n), n], axis=1), seconds)
    return float(alpha), float(beta)


def fit_linear(x, y) -> tuple[float, float]:
    """``y = c0 + c1 * x``."""
    x = np.asarray(x, dtype=float)
    c0, c1 = least_squares(np.stack([np.ones_like(x), x], axis=1), y)
    return float(c0), float(c1)


@dataclass(frozen=True)
class LayerFit:
    """Seconds of one pass of a layer over a packed micro-batch (one row of ``tokens`` tokens).

    ``c0 + c1 * tokens + c2 * sum(len_k ** 2) + c3 * tokens ** 2``. ``c2`` is the cost of attention
    that skips other documents (varlen kernels, and the runtime's CPU kernel, which runs document by
    document); ``c3`` the cost of attention that computes the whole row and masks it (dense-mask
    kernels), so it grows with the row however the row is packed. Sweeps that mix short and long
    documents in rows of several lengths separate
    the two.

    >>> f = LayerFit(1e-4, 2e-6, 3e-9, 0.0)
    >>> round(float(f.time(1024, 2 * 512 ** 2)) * 1e3, 4)  # 0.1 + 2.048 + 1.5729 ms
    3.7209
    """

    c0_s: float
    c1_s_per_token: float
    c2_s_per_sq_token: float
    c3_s_per_sq_row_token: float = 0.0

    def time(self, tokens, sq_tokens, split: float = 1.0):
        """Seconds for ``tokens`` (a row) whose documents' squared lengths sum to ``sq_tokens``;
        the token-dependent part divided by ``split`` (tp x cp shards)."""
        t = np.asarray(tokens, dtype=float)
        sharded = self.c1_s_per_token * t + self.c2_s_per_sq_token * np.asarray(sq_tokens, dtype=float) \
            + self.c3_s_per_sq_row_token * t * t
        return self.c0_s + sharded / split

    def attention(self, tokens, sq_tokens, split: float = 1.0):
        """The quadratic (attention) part alone, seconds."""
        t = np.asarray(tokens, dtype=float)
        return (self.c2_s_per_sq_token * np.asarray(sq_tokens, dtype=float)
                + self.c3_s_per_sq_row_token * t * t) / split

    def to_dict(self) -> dict:
        return {"c0_s": self.c0_s, "c1_s_per_token": self.c1_s_per_token,
                "c2_s_per_sq_token": self.c2_s_per_sq_token, "c3_s_per_sq_row_token": self.c3_s_per_sq_row_token}

    @classmethod
    def from_dict(cls, d: dict) -> "LayerFit":
        return cls(float(d["c0_s"]), float(d["c1_s_per_token"]), float(d["c2_s_per_sq_token"]),
                   float(d.get("c3_s_per_sq_row_token", 0.0)))


def fit_layer_time(tokens, sq_tokens, seconds, per_document: bool = True) -> LayerFit:
    """Fit :class:`LayerFit` to per-row samples (``tokens`` = row length, ``sq_tokens`` = sum of len^2).

    ``per_document`` off: no per-document term (``c2 = 0``), for a kernel that computes the whole row
    whatever its documents (the ring kernel's dense blocks); its samples need not vary the documents.

    >>> import numpy as np
    >>> t = np.array([256, 512, 1024, 1024, 2048, 2048, 512])
    >>> sq = np.array([256**2, 4 * 128**2, 1024**2, 16 * 64**2, 2048**2, 2 * 1024**2, 512**2])
    >>> f = fit_layer_time(t, sq, 1e-4 + 2e-6 * t + 3e-9 * sq + 1e-9 * t * t)
    >>> [round(x, 12) for x in (f.c0_s, f.c1_s_per_token, f.c2_s_per_sq_token, f.c3_s_per_sq_row_token)]
    [0.0001, 2e-06, 3e-09, 1e-09]
    >>> one = np.array([256, 512, 1024, 2048])  # one document per row: sum of len^2 = tokens^2
    >>> f = fit_layer_time(one, one ** 2, 1e-4 + 2e-6 * one + 4e-9 * one * one, per_document=False)
    >>> [round(x, 12) for x in (f.c0_s, f.c1_s_per_token, f.c2_s_per_sq_token, f.c3_s_per_sq_row_token)]
    [0.0001, 2e-06, 0.0, 4e-09]
    """
    t = np.asarray(tokens, dtype=float)
    sq = np.asarray(sq_tokens, dtype=float)
    if not per_document:
        c0, c1, c3 = least_squares(np.stack([np.ones_like(t), t, t * t], axis=1), seconds)
        return LayerFit(float(c0), float(c1), 0.0, float(c3))
    c = least_squares(np.stack([np.ones_like(t), t, sq, t * t], axis=1), seconds)
    return LayerFit(*(float(x) for x in c))
