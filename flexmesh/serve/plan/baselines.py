"""The deployments the planner is compared with, each written as a serving plan and scored by the same simulator.

Each baseline is planned by the same MILP restricted to what that approach may do (so each gets the
configurations, engine knobs and routing its own method would choose: its knobs swept, never set against it)
and judged by the same simulator on the same workload, its best variant kept. The best single type's, the
Mélange-style and the DistServe-style MILPs are solved on the capacities as priced and as calibrated against the
simulator (:mod:`.search`), the better plan kept: calibration can mislead a MILP as well as correct it.

- **best single GPU type**: aggregated replicas of one device type (every tp and batched-token budget the
  type allows), the best type;
- **Mélange-style** (2404.14527): a mix of device types chosen per length bucket, aggregated replicas only;
- **DistServe-style** (OSDI'24): prefill and decode replicas, each phase its own tp and knobs, on one device
  type, the best type;
- **one type per phase** (AIConfigurator's ``--decode_system``): prefill on one device type, decode on
  another, the best pair (the pairs the MILP ranks highest are simulated);
- **round-robin**: the planner's own replicas with requests spread in turn, not by bucket.

Within a bucket's shares each plan is routed in proportion and by least work; the better is kept. A plan the
planner has already simulated (the same replica groups, shares and routing: its single-type and aggregated-only
candidates are often a baseline's own plan) keeps the score it got rather than being simulated again
(``known`` in :func:`all_baselines`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from flexmesh.data.requests import Workload
from flexmesh.errors import FlexmeshError
from flexmesh.serve.layout.plan import ServingPlan
from flexmesh.serve.layout.roles import Role
from flexmesh.serve.layout.routing import RoutingPolicy
from flexmesh.serve.plan.planner import PlanCandidate, Planner
from flexmesh.serve.plan.score import Score, score
from flexmesh.serve.plan.search import _better

# Scores already simulated, by plan: its replica groups (shares included) and routing.
Known = dict[tuple, Score]

# Pairs of device types (prefill, decode) simulated for the one-type-per-phase baseline: the MILP's best ones.
PAIRS_SIMULATED = 3


@dataclass(frozen=True)
class Baseline:
    """A baseline's best plan and every variant of it the simulator scored (``best`` None: it has no plan
    here, ``why`` says why)."""

    name: str
    best: PlanCandidate | None
    tried: tuple[PlanCandidate, ...]
    why: str = ""
    router: str = "plan"  # how its plan's requests are routed (round-robin: the plan's replicas, routed in turn)


def _key(plan: ServingPlan) -> tuple:
    return plan.groups, plan.routing


def known_scores(candidates: Sequence[PlanCandidate]) -> Known:
    """The scores of the candidates the simulator has judged, by plan."""
    return {_key(c.plan): c.score for c in candidates if c.score is not None and c.plan.cascade is None}


def _routed(c: PlanCandidate, workload_at: Callable[[float], Workload], planner: Planner,
            target: float | None, known: Known | None = None) -> list[PlanCandidate]:
    """``c`` scored with each routing policy inside its buckets' shares (a plan in ``known`` keeps its score;
    each new score is added to it)."""
    out = []
    start = c.solution.rate if c.solution is not None else 1.0
    memo: Known = {} if known is None else known
    for policy in RoutingPolicy:
        p = replace(c.plan, routing=policy)
        s = memo.get(_key(p))
        if s is None:
            s = memo[_key(p)] = score(p, workload_at, start, planner.overhead)
        start = s.goodput or start
        out.append(PlanCandidate(f"{c.name}, {policy}", p, c.solution, s))
    return out


def _best(name: str, tried: list[PlanCandidate], planner: Planner, why: str) -> Baseline:
    """The best variant by the planner's own objective (:func:`~.search._better`)."""
    target, per_dollar = planner.inputs.rate, planner.inputs.per_dollar
    best: PlanCandidate | None = None
    for c in tried:
        assert c.score is not None
        if best is None or _better(c.score, best.score, target, per_dollar):
            best = c
    return Baseline(name, best, tuple(tried), "" if best is not None else why)


def _each(planner: Planner, name: str, cols: Sequence[int], workload_at: Callable[[float], Workload],
          known: Known | None) -> list[PlanCandidate]:
    """The MILP's plan over ``cols`` as priced and as calibrated against the simulator (a baseline planned from
    profiles could plan with either), each distinct plan scored with every routing."""
    tried: list[PlanCandidate] = []
    seen: set[tuple] = set()
    for p in (planner,) if planner.priced is planner.capacity else (planner.uncalibrated(), planner):
        c = p.candidate(name, cols)
        if c is not None and c.plan.groups not in seen:
            seen.add(c.plan.groups)
            tried += _routed(c, workload_at, planner, planner.inputs.rate, known)
    return tried


def single_type(planner: Planner, workload_at: Callable[[float], Workload], known: Known | None = None) -> Baseline:
    """Aggregated replicas of one device type, the best type."""
    tried: list[PlanCandidate] = []
    for g, group in enumerate(planner.cluster.groups):
        tried += _each(planner, f"{group.device.name} only", planner.columns((Role.AGGREGATED,), groups=[g]),
                       workload_at, known)
    return _best("best single GPU type", tried, planner, "no single device type serves the workload")


def melange(planner: Planner, workload_at: Callable[[float], Workload], known: Known | None = None) -> Baseline:
    """Device types mixed per bucket, aggregated replicas only."""
    tried = _each(planner, "type mix per bucket", planner.columns((Role.AGGREGATED,)), workload_at, known)
    return _best("Mélange-style", tried, planner, "no aggregated plan serves the workload")


def distserve(planner: Planner, workload_at: Callable[[float], Workload], known: Known | None = None) -> Baseline:
    """Prefill and decode replicas on one device type, each phase its own tp and knobs; the best type."""
    tried: list[PlanCandidate] = []
    for g, group in enumerate(planner.cluster.groups):
        tried += _each(planner, f"{group.device.name} prefill + decode",
                       planner.columns((Role.PREFILL, Role.DECODE), groups=[g]), workload_at, known)
    return _best("DistServe-style", tried, planner, "no device type serves both phases")


def type_per_phase(planner: Planner, workload_at: Callable[[float], Workload],
                   simulated: int = PAIRS_SIMULATED, known: Known | None = None) -> Baseline:
    """Prefill on one device type and decode on another: the pairs the MILP ranks highest, simulated."""
    solved: list[PlanCandidate] = []
    groups = planner.cluster.groups
    for u, gu in enumerate(groups):
        for v, gv in enumerate(groups):
            if u == v or gu.device.name == gv.device.name:
                continue
            cols = planner.columns((Role.PREFILL, Role.DECODE), prefill_groups=[u], decode_groups=[v])
            c = planner.candidate(f"prefill {gu.device.name}, decode {gv.device.name}", cols)
            if c is not None and any(g.role == Role.PREFILL for g in c.plan.groups):
                solved.append(c)
    target = planner.inputs.rate

    def rank(c: PlanCandidate) -> float:
        assert c.solution is not None
        s = c.solution
        return -s.cost if target is not None else s.rate / max(s.cost, 1e-9)

    solved.sort(key=rank, reverse=True)
    tried: list[PlanCandidate] = []
    for c in solved[:simulated]:
        tried += _routed(c, workload_at, planner, target, known)
    return _best("one type per phase", tried, planner, "no pair of device types serves the two phases")


def round_robin(plan: ServingPlan, workload_at: Callable[[float], Workload], start_rate: float,
                planner: Planner) -> Baseline:
    """The plan's own replicas, requests spread in turn over them (decodes too), not by bucket."""
    try:
        s = score(plan, workload_at, start_rate, planner.overhead, router="round-robin")
    except FlexmeshError as e:
        return Baseline("round-robin routing", None, (), f"cannot route every request in turn: {e}", "round-robin")
    c = PlanCandidate("planner's replicas, round-robin", plan, None, s)
    return Baseline("round-robin routing", c, (c,), router="round-robin")


def all_baselines(planner: Planner, plan: ServingPlan, plan_score: Score,
                  workload_at: Callable[[float], Workload], known: Sequence[PlanCandidate] = (),
                  progress: Callable[[str], None] | None = None) -> list[Baseline]:
    """Every baseline of the module doc, in its order; ``known``: candidates the simulator has scored on the same
    workload (the planner's), whose scores a baseline of the same plan reuses; ``progress(what)`` as each starts."""
    memo = known_scores(known)
    say = progress or (lambda _: None)
    steps: list[tuple[str, Callable[[], Baseline]]] = [
        ("the best single GPU type", lambda: single_type(planner, workload_at, memo)),
        ("Mélange-style", lambda: melange(planner, workload_at, memo)),
        ("DistServe-style", lambda: distserve(planner, workload_at, memo)),
        ("one type per phase", lambda: type_per_phase(planner, workload_at, known=memo)),
        ("round-robin routing", lambda: round_robin(plan, workload_at, plan_score.goodput or 1.0, planner))]
    out = []
    for k, (what, make) in enumerate(steps):
        say(f"scoring the baselines: {what} ({k + 1} of {len(steps)})")
        out.append(make())
    return out


def ratio(a: Score | None, b: Score | None) -> float:
    """Goodput per dollar of ``a`` over ``b`` (inf when ``b`` serves nothing, NaN when either is missing)."""
    if a is None or b is None:
        return math.nan
    if b.per_dollar <= 0:
        return math.inf if a.per_dollar > 0 else math.nan
    return a.per_dollar / b.per_dollar
