"""A serving plan judged by the simulator: its SLO attainment at a rate, and its goodput.

Every plan the planner compares (its candidates, its repairs, the baselines) is scored here, by the one
simulator (:class:`flexmesh.serve.simulator.Fleet`) on the same workload at each rate: the plan's replicas
placed on its cluster, requests routed by its routing table (the ``plan`` router), a cascade's requests
escalated at the plan's fraction. Goodput is the study's bisection (:func:`flexmesh.serve.study.find_goodput`).

>>> import json
>>> from flexmesh.data.requests import load_trace, window, at_rate
>>> from flexmesh.serve.layout import plan as layout
>>> plan = layout.ServingPlan.from_dict(json.loads(layout.__doc__.split(".. code-block:: json")[1].split(">>>")[0]))
>>> base = window(load_trace("azure-conv"), first=600)
>>> s = score(plan, lambda r: at_rate(base, r), start_rate=8.0)
>>> s.goodput > 0, s.bounded, round(s.dollars_per_hour, 2)
(True, True, 10.1)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from flexmesh.cost.inference.band import ENDS
from flexmesh.cost.inference.overhead import EngineOverhead
from flexmesh.data.requests import Workload
from flexmesh.serve.layout.plan import ServingPlan
from flexmesh.serve.layout.quality import escalate
from flexmesh.serve.metrics import Summary, attainment, summarize
from flexmesh.serve.simulator import Fleet, RunOptions
from flexmesh.serve.study import RatePoint, find_goodput

# Goodput's bisection stops when its bracket is within this (the study's default, 2%).
REL_TOL = 0.02
# Its first bracketing step from the start rate (a prediction, usually within a quarter of the answer): fewer
# simulations than doubling, and the step grows where the start is far off.
STEP = 1.25


@dataclass(frozen=True)
class Score:
    """What the simulator says of a plan: its goodput (requests/s at the attainment target; 0 when even the
    lowest rate tried misses it), its price, and every rate it simulated."""

    goodput: float
    bounded: bool  # a rate missing the target was found above the goodput
    dollars_per_hour: float
    points: tuple[RatePoint, ...]
    seconds: float

    @property
    def per_dollar(self) -> float:
        """Goodput per $/h (requests/s per dollar-hour)."""
        return self.goodput / self.dollars_per_hour if self.dollars_per_hour > 0 else math.nan

    def at(self, rate: float) -> Summary | None:
        """The summary of the run nearest ``rate`` (None when none was simulated)."""
        if not self.points:
            return None
        return min(self.points, key=lambda p: abs(math.log(p.rate / rate)) if rate > 0 else p.rate).summary


def plan_workload(plan: ServingPlan, workload_at: Callable[[float], Workload]) -> Callable[[float], Workload]:
    """``workload_at`` as ``plan`` serves it: a cascade's requests escalated at its fraction."""
    if plan.cascade is None:
        return workload_at
    fraction = plan.cascade.escalated
    return lambda rate: escalate(workload_at(rate), fraction)


def attainment_at(plan: ServingPlan, workload_at: Callable[[float], Workload], rate: float,
                  overhead: EngineOverhead | None = None) -> tuple[float, Summary]:
    """The fraction of requests meeting the plan's SLO at ``rate``, and the run's summary."""
    fleet, table = Fleet.from_plan(plan, overhead)
    result = fleet.run(plan_workload(plan, workload_at)(rate), router="plan", routing=table)
    return attainment(result.records, plan.slo), summarize(result.records, plan.slo, plan.dollars_per_hour)


def score(plan: ServingPlan, workload_at: Callable[[float], Workload], start_rate: float,
          overhead: EngineOverhead | None = None, rel_tol: float = REL_TOL, router: str = "plan",
          band: str | None = None) -> Score:
    """The plan's goodput on ``workload_at`` (bisection from ``start_rate``); ``router``: the plan's own (by
    bucket), or another of the simulator's (``round-robin``: its replicas in turn); ``band``: with every part's
    device-layer prices at the ``low`` or ``high`` end of its price band (flexmesh.cost.inference.band)."""
    t0 = time.perf_counter()
    fleet, table = Fleet.from_plan(plan, overhead)
    if band is not None:
        fleet = fleet.at_band(band)
    usd = plan.dollars_per_hour
    good, points = find_goodput(fleet, plan_workload(plan, workload_at), plan.slo, plan.attainment,
                                max(start_rate, 1e-3), usd, rel_tol=rel_tol,
                                options=RunOptions(router=router, routing=table if router == "plan" else None))
    return Score(good.rate, good.bounded, usd, tuple(points), time.perf_counter() - t0)


def band_scores(plan: ServingPlan, workload_at: Callable[[float], Workload], scored: Score,
                overhead: EngineOverhead | None = None) -> dict[str, Score]:
    """The plan's goodput with its parts' prices at each end of their price bands (the search starting from its
    goodput ``scored``): how far the simulator's answer may move with the device layer's prices."""
    start = scored.goodput if scored.goodput > 0 else 1.0
    return {end: score(plan, workload_at, start, overhead, band=end) for end in ENDS}
