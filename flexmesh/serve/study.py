"""Studies over a fleet: the same workload at several rates (the knee), goodput by bisection, the fleet's price.

A workload at a rate is what a caller makes of a base workload (a trace's arrival times scaled, or synthetic
arrivals drawn at the rate): :func:`sweep` and :func:`find_goodput` take that as a function of the rate.

>>> from flexmesh.data.requests import constant_lengths, with_arrivals
>>> from flexmesh.serve.layout.replicas import parse_replicas, place
>>> from flexmesh.serve.layout.slo import SLO
>>> from flexmesh.serve.simulator import Fleet
>>> from flexmesh.spec import parse_model
>>> from flexmesh.spec.cluster import parse_mixed_cluster
>>> c = parse_mixed_cluster("1xH100")
>>> fleet = Fleet(parse_model("llama3-8b"), c, place(parse_replicas("tp1", c), c))
>>> at = lambda rate: with_arrivals(constant_lengths(2000, 200), rate, n=300)
>>> g, points = find_goodput(fleet, at, SLO(ttft_s=0.5, tpot_s=0.05), 0.9, start_rate=4.0)
>>> g.bounded, 4.0 < g.rate < 64.0, len(points) == len(g.points)
(True, True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flexmesh.data.requests import Workload
from flexmesh.serve.layout.slo import SLO
from flexmesh.serve.metrics import Goodput, Summary, attainment, goodput, summarize
from flexmesh.serve.simulator import Fleet, RunOptions, SimResult
from flexmesh.spec.prices import GpuPrice


@dataclass(frozen=True)
class RatePoint:
    """One run of a study: the rate asked, what it gave."""

    rate: float
    summary: Summary


def fleet_price(gpus: dict[str, int], prices: dict[str, GpuPrice]) -> tuple[float | None, list[str]]:
    """$/h of ``gpus`` (device name to count) and the devices without a price (then the price is None)."""
    missing = sorted(d for d in gpus if d not in prices)
    if missing:
        return None, missing
    return sum(prices[d].usd_per_hour * n for d, n in gpus.items()), []


def sweep(fleet: Fleet, workload_at: Callable[[float], Workload], rates: Sequence[float], slo: SLO | None,
          dollars_per_hour: float | None = None, progress: Callable[[int, int], None] | None = None,
          options: RunOptions | None = None) -> list[tuple[RatePoint, SimResult]]:
    """The fleet at each rate: its summary and its run (as ``options`` say)."""
    out = []
    for rate in rates:
        result = fleet.run(workload_at(rate), options, progress)
        out.append((RatePoint(rate, summarize(result.records, slo, dollars_per_hour)), result))
    return out


def find_goodput(fleet: Fleet, workload_at: Callable[[float], Workload], slo: SLO, target: float, start_rate: float,
                 dollars_per_hour: float | None = None, progress: Callable[[int, int], None] | None = None,
                 rel_tol: float = 0.02, step: float = 2.0,
                 options: RunOptions | None = None) -> tuple[Goodput, list[RatePoint]]:
    """The highest rate at which at least ``target`` of the requests meet ``slo`` (:func:`~flexmesh.serve.metrics.
    goodput`'s bisection from ``start_rate``), and the summary of every rate it tried."""
    points: list[RatePoint] = []
    whole: set[float] = set()  # rates whose workload arrived whole before its first answer

    def at(rate: float) -> float:
        result = fleet.run(workload_at(rate), options, progress)
        points.append(RatePoint(rate, summarize(result.records, slo, dollars_per_hour)))
        answered = [r.first_token_s for r in result.records if r.first_token_s is not None]
        if answered and max(r.arrival_s for r in result.records) <= min(answered):
            whole.add(rate)
        return attainment(result.records, slo)

    return goodput(at, target, start_rate, rel_tol=rel_tol, step=step, saturated=lambda r: r in whole), points
