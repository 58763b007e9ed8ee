"""A cascade's quality curve (an input, never a claim) and the escalation of a workload's requests.

A cascade serves every request with its first model; a judge escalates some of them to the next model,
whose answer is the one returned. How good the answers are against the fraction escalated is the user's
measurement (Cascadia, 2506.04203, measures it per judge threshold): a curve of ``(escalated fraction,
quality)`` points, piecewise linear between them. The planner only reads it: the least fraction that
reaches a quality target (:meth:`QualityCurve.fraction_for`) is what the deployment must carry.

Which requests escalate is the judge's; the simulator draws them at the fraction, independently of their
lengths (a stated assumption: the judge looks at answers, not lengths), by a seeded hash of each request's
id (:func:`escalate`), so the same workload escalates the same requests at every rate.

>>> q = parse_quality("0:0.66,0.3:0.75,0.6:0.79,1:0.8")
>>> round(q.at(0.45), 3), round(q.fraction_for(0.77), 3), q.fraction_for(0.66)
(0.77, 0.45, 0.0)
>>> from flexmesh.data.requests import constant_lengths
>>> w = escalate(constant_lengths(100, 10, n=10_000), 0.45)
>>> round(sum(r.tier for r in w.requests) / len(w), 2)
0.45
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from flexmesh.data.requests import Workload
from flexmesh.errors import SpecError


@dataclass(frozen=True)
class QualityCurve:
    """``(escalated fraction, quality)`` points, fractions rising from 0 to 1 (piecewise linear between)."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        xs = [x for x, _ in self.points]
        if len(xs) < 2 or xs[0] != 0 or xs[-1] != 1 or any(b <= a for a, b in zip(xs, xs[1:])):
            raise SpecError(f"a quality curve gives points from escalated fraction 0 to 1, rising; got {xs}")
        if not all(math.isfinite(y) for _, y in self.points):
            raise SpecError("a quality curve's qualities are finite numbers")

    def at(self, fraction: float) -> float:
        xs, ys = zip(*self.points)
        return float(np.interp(fraction, xs, ys))

    def fraction_for(self, target: float) -> float:
        """The least escalated fraction whose quality reaches ``target`` (SpecError when none does)."""
        pts = self.points
        if pts[0][1] >= target:
            return 0.0
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if y1 >= target:
                return x0 + (x1 - x0) * (target - y0) / (y1 - y0)
        best = max(y for _, y in pts)
        raise SpecError(f"the quality curve never reaches {target:g} (its best is {best:g}); give a lower target")

    def to_json(self) -> list[list[float]]:
        return [[x, y] for x, y in self.points]


def parse_quality(text: str) -> QualityCurve:
    """``FRACTION:QUALITY,...`` (e.g. ``0:0.66,0.5:0.78,1:0.8``)."""
    pts = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        a, sep, b = part.partition(":")
        try:
            x, y = float(a), float(b)
        except ValueError:
            sep = ""
        if not sep or not 0 <= x <= 1:
            raise SpecError(f"quality point {part!r} is not FRACTION:QUALITY with a fraction in [0, 1]; e.g. "
                            "0:0.66,0.5:0.78,1:0.8")
        pts.append((x, y))
    return QualityCurve(tuple(sorted(pts)))


def escalate(workload: Workload, fraction: float, seed: int = 0) -> Workload:
    """The workload with a ``fraction`` of its requests at tier 1 (escalated to the cascade's second model), the
    rest at tier 0, drawn by a seeded hash of the request ids."""
    if not 0 <= fraction <= 1:
        raise SpecError(f"an escalated fraction is in [0, 1], got {fraction}")
    ids = np.array([r.id for r in workload.requests], dtype=np.uint64)
    # SplitMix64's finaliser: a well-mixed uniform number per id, the same for an id at any rate.
    z = (ids + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x9E3779B97F4A7C15))
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    reqs = tuple(replace(r, tier=1 if x < fraction else 0) for r, x in zip(workload.requests, u))
    return replace(workload, requests=reqs, name=f"{workload.name} escalating {fraction:.0%}")
