"""The planner: configurations priced per bucket, the MILP's plans, the simulator's judgement, local repairs.

1. **Configurations and capacities** (:mod:`.capacity`): every model on every device group at every tp
   (pp where a node's tp is reached) in every role, its capacity per bucket at the SLO. A bucket no
   configuration serves within the SLO is served without it (its requests count as misses), if its share
   leaves the attainment target reachable.
2. **The MILP** (:mod:`.milp`) in three variants: every role, aggregated replicas only, prefill/decode
   only. Each answer becomes a plan (:meth:`Planner.to_plan`): groups of replicas, each bucket's shares.
3. **The simulator** scores the distinct candidates on the workload (:func:`.score.score`, goodput by
   bisection), then the MILP is calibrated against it (each device type's own plan simulated: what it serves of
   its prediction scales that type's capacities; split replicas against aggregated ones likewise) and solved
   again; the best candidate is kept: the most goodput within the budget, or the cheapest meeting the rate.
   A planner that splits prefill and decode where it loses in the simulator would be wrong: the aggregated
   candidates are always among those scored. With a target rate, a plan the simulator finds short of it is
   planned again at the rate scaled by what it fell short (up to :data:`CALIBRATIONS` times).
4. **Repair by local moves** (ThunderServe's tabu search, 2502.09334): a replica changes role, splits in
   two of half the tp or two merge, or moves to another device group; the routing of each neighbour is
   the MILP's with its counts fixed (a linear program). The neighbours of the highest predicted rate are
   simulated at a probe rate just above the best goodput so far; the best one not visited before is taken,
   and the best plan seen is returned.

The planner's own time (steps 1 and 2) is what ``bench/serve_plan.py`` holds to its targets; steps 3 and 4
are the simulator's and grow with the workload's length.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from flexmesh.cost.inference.memory import kv_bytes_per_token
from flexmesh.cost.inference.overhead import EngineOverhead, preset_overhead
from flexmesh.cost.inference.transfer import Span, kv_path
from flexmesh.data.requests import Workload
from flexmesh.errors import PlanError
from flexmesh.serve.deployment import ROLES, EngineKnobs
from flexmesh.serve.metrics import SLO
from flexmesh.serve.plan.capacity import Capacity, Pricing, ReplicaConfig, configurations
from flexmesh.serve.plan.fileformat import CascadeSpec, ReplicaGroup, ServingPlan
from flexmesh.serve.plan.milp import Columns, Problem, Solution, solve, solve_fast
from flexmesh.serve.plan.score import Score, attainment_at, score
from flexmesh.serve.plan.workload import Buckets
from flexmesh.spec.cluster import parse_mixed_cluster
from flexmesh.spec.model import parse_model

# Times a plan short of a target rate is planned again, its rate scaled by what it fell short.
CALIBRATIONS = 3
# Repair: rounds of moves, neighbours simulated per round, and the probe above the best goodput.
REPAIR_ROUNDS = 4
REPAIR_TRIES = 3
PROBE = 1.06
# The MILP variants whose plans the simulator compares: every role, aggregated replicas only, prefill/decode only.
VARIANTS = {"mixed": ROLES, "aggregated": ("aggregated",), "disaggregated": ("prefill", "decode")}
# Without a device type's own plan to calibrate by, split replicas are calibrated apart from aggregated ones
# when the simulator finds their predictions off by more than this against each other.
CALIBRATION_SPREAD = 0.03


@dataclass(frozen=True)
class PlanInputs:
    """What to plan for: models (names; a cascade's in order), the cluster of devices one can get, the
    workload's buckets, the SLO and its attainment target, $ per GPU-hour by device name, and a budget
    ($/h: the most goodput within it) or a target rate (requests/s: the cheapest plan serving it).
    ``tiers``: each model's share of the requests (a cascade: 1 and the escalated fraction; several
    models: their mix)."""

    models: tuple[str, ...]
    cluster: str
    buckets: Buckets
    slo: SLO
    prices: dict[str, float]
    attainment: float = 0.9
    budget: float | None = None
    rate: float | None = None
    tiers: tuple[float, ...] = (1.0,)
    cascade: CascadeSpec | None = None
    overhead: EngineOverhead | None = None
    knobs: dict[int, EngineKnobs] | None = None
    workload: dict = field(default_factory=dict)
    time_limit_s: float = 20.0  # the most seconds one MILP may take (a safety net: plans do not depend on it)
    stage_slos: tuple[SLO, ...] | None = None  # per model, the SLO its replicas are priced at (a cascade's stages)

    def __post_init__(self) -> None:
        if self.budget is None and self.rate is None:
            raise PlanError("give --budget (the most goodput within it) or --rate (the cheapest plan serving it)")
        if len(self.tiers) != len(self.models):
            raise PlanError(f"{len(self.tiers)} request shares for {len(self.models)} models; give one per model")


@dataclass(frozen=True)
class Candidate:
    """A plan the planner considered: where it came from, what the MILP predicted, what the simulator said."""

    name: str
    plan: ServingPlan
    solution: Solution | None
    score: Score | None = None


@dataclass(frozen=True)
class PlanResult:
    """The planner's answer: the plan, every candidate scored, the repair's moves, and the time each step took
    (``plan_s``: configurations, capacities and the MILPs; ``simulate_s``: scoring and repair)."""

    plan: ServingPlan
    score: Score | None
    candidates: tuple[Candidate, ...]
    moves: tuple[str, ...]
    plan_s: float
    simulate_s: float
    configs: int
    notes: tuple[str, ...]
    planner: Planner | None = None  # calibrated by role where the simulator found that needed


class Planner:
    """Configurations and their capacities for one set of inputs, built once; MILPs over subsets of them."""

    def __init__(self, inputs: PlanInputs):
        t0 = time.perf_counter()
        self.inputs = i = inputs
        self.models = tuple(parse_model(m) for m in i.models)
        self.cluster = parse_mixed_cluster(i.cluster)
        missing = sorted({g.device.name for g in self.cluster.groups} - set(i.prices))
        if missing:
            raise PlanError(f"no price for {', '.join(missing)}; give --price DEVICE=USD_PER_GPU_HOUR")
        self.overhead = i.overhead or preset_overhead()
        self.pricing = Pricing(self.models, self.cluster, self.overhead, i.attainment)
        self.configs = configurations(self.models, self.cluster, i.buckets.longest, knobs=i.knobs)
        if not self.configs:
            raise PlanError(f"no replica of {', '.join(i.models)} fits on {self.cluster.label}; give larger devices")
        buckets = i.buckets.buckets
        slos = i.stage_slos or (i.slo,) * len(self.models)
        self.slos = slos
        self.capacity = np.array([[self.pricing.capacity(c, b, slos[c.model]).rate if b.share > 0 else 0.0
                                   for b in buckets] for c in self.configs])
        self.detail: dict[tuple[int, int], Capacity] = {}
        self.price = [i.prices[g.device.name] for g in self.cluster.groups]
        self.demand = np.array([[t * b.share for b in buckets] for t in i.tiers])
        self.dominated = self._dominated()
        self.decodes = np.array([[b.output_mean > 1.0 for b in buckets] for _ in i.tiers])
        self.kv_bytes = np.array([[b.prompt_mean * kv_bytes_per_token(m) for b in buckets] for m in self.models])
        ng = len(self.cluster.groups)
        self.links = np.full((ng, ng), math.inf)
        for g in range(ng):
            for h in range(ng):
                if g != h:
                    a, b = self.cluster.groups[g], self.cluster.groups[h]
                    path = kv_path(Span(g, frozenset(range(a.nodes)), a.world_size),
                                   Span(h, frozenset(range(b.nodes)), b.world_size), self.cluster)
                    self.links[g, h] = path.bytes_per_s
        self.setup_s = time.perf_counter() - t0

    def _dominated(self) -> set[int]:
        """Configurations another one of the same model, group and role makes useless: it has a whole fraction
        of the devices and, per device, at least the capacity for every bucket (its replicas in the same
        devices serve at least as much; the MILP need not see the first)."""
        out: set[int] = set()
        need = self.demand.sum(axis=0) > 0
        by: dict[tuple[int, int, str], list[int]] = {}
        for k, c in enumerate(self.configs):
            by.setdefault((c.model, c.group, c.role), []).append(k)
        for ks in by.values():
            for b in ks:
                cb = self.configs[b]
                per_b = self.capacity[b, need] / cb.devices
                for a in ks:
                    ca = self.configs[a]
                    if a == b or a in out or cb.devices % ca.devices or ca.devices > cb.devices:
                        continue
                    per_a = self.capacity[a, need] / ca.devices
                    if (per_a >= per_b).all() and (ca.devices < cb.devices or a < b):
                        out.add(b)
                        break
        return out

    # ---- MILPs ---------------------------------------------------------------------------------------
    def columns(self, roles: Sequence[str] = ROLES, groups: Sequence[int] | None = None,
                prefill_groups: Sequence[int] | None = None, decode_groups: Sequence[int] | None = None,
                keep: Callable[[ReplicaConfig], bool] | None = None, everything: bool = False) -> list[int]:
        """Indices of the configurations in ``roles`` on ``groups`` (prefill and decode ones on their own groups
        where given) that ``keep`` keeps, less the dominated ones (unless ``everything``)."""
        out = []
        for k, c in enumerate(self.configs):
            if not everything and k in self.dominated:
                continue
            if c.role not in roles:
                continue
            allowed = {"prefill": prefill_groups, "decode": decode_groups}.get(c.role) or groups
            if allowed is not None and c.group not in allowed:
                continue
            if keep is not None and not keep(c):
                continue
            out.append(k)
        return out

    def unmet(self, cols: Sequence[int]) -> list[tuple[int, int]]:
        """(model, bucket) pairs no configuration of ``cols`` that takes new requests serves within the SLO."""
        out = []
        for m in range(len(self.models)):
            entry = [k for k in cols if self.configs[k].model == m and self.configs[k].role != "decode"]
            for b in range(len(self.inputs.buckets)):
                if self.demand[m, b] > 0 and not self.capacity[entry, b].any():
                    out.append((m, b))
        return out

    def capacities(self, cols: Sequence[int]) -> np.ndarray:
        """The capacities of ``cols``; a bucket none of them serves within the SLO is served without it (its
        requests miss the SLO) when the attainment target leaves room for it, else PlanError."""
        cap = self.capacity[list(cols)].copy()
        i, buckets = self.inputs, self.inputs.buckets.buckets
        unmet = self.unmet(cols)
        for m in range(len(self.models)):
            lost = sum(buckets[b].share for mm, b in unmet if mm == m)
            if lost > 1 - i.attainment + 1e-9:
                raise PlanError(f"no replica of {i.models[m]} here meets the SLO ({i.slo}) for {lost:.1%} of the "
                                f"requests (buckets {', '.join(buckets[b].label for mm, b in unmet if mm == m)}), "
                                f"more than the {1 - i.attainment:.0%} the attainment target allows; relax the SLO "
                                "or give faster devices")
        for m, b in unmet:
            for j, k in enumerate(cols):
                if self.configs[k].model == m:
                    cap[j, b] = self.pricing.capacity(self.configs[k], buckets[b], SLO()).rate
        return cap

    def problem(self, cols: Sequence[int], budget: float | None = None, rate: float | None = None,
                counts: Sequence[int] | None = None, limits: dict | None = None,
                available: Sequence[int] | None = None) -> Problem:
        cfg = [self.configs[k] for k in cols]
        columns = Columns([c.model for c in cfg], [c.group for c in cfg], [c.devices for c in cfg],
                          [c.role for c in cfg], [c.shape for c in cfg])
        return Problem(columns, self.capacities(cols), self.demand,
                       available or [g.world_size for g in self.cluster.groups], self.price, budget, rate,
                       self.kv_bytes, self.links, self.decodes, counts=counts, limits=limits)

    def solve(self, cols: Sequence[int], budget: float | None = None, rate: float | None = None,
              counts: Sequence[int] | None = None, limits: dict | None = None,
              available: Sequence[int] | None = None) -> Solution:
        problem = self.problem(cols, budget, rate, counts, limits, available)
        if counts is not None:  # a linear program: nothing to be quick about
            return solve(problem)
        return solve_fast(problem, self.inputs.time_limit_s)

    # ---- plans ---------------------------------------------------------------------------------------
    def to_plan(self, cols: Sequence[int], s: Solution, routing: str = "weights") -> ServingPlan:
        """The solution as a serving plan: one replica group per configuration used, each bucket's shares."""
        i = self.inputs
        nb = len(i.buckets)
        groups = []
        decoded = np.zeros((len(self.models), nb))
        for j, k in enumerate(cols):
            decoded[self.configs[k].model] += s.decode[j]
        for j, k in enumerate(cols):
            n = int(s.counts[j])
            if n <= 0:
                continue
            c = self.configs[k]
            demand = self.demand[c.model] * s.rate
            with np.errstate(divide="ignore", invalid="ignore"):
                entry = np.where(demand > 0, s.entry[j] / np.where(demand > 0, demand, 1), 0.0)
                dec = np.where(decoded[c.model] > 0, s.decode[j] / np.where(decoded[c.model] > 0,
                                                                             decoded[c.model], 1), 0.0)
            groups.append(ReplicaGroup(c.model, c.group, self.cluster.groups[c.group].device.name, n, c.tp, c.pp,
                                       c.role, c.knobs, tuple(0.0 if c.role == "decode" else float(x) for x in entry),
                                       tuple(float(x) for x in dec) if c.role == "decode" else ()))
        groups = _normalised(groups, len(self.models), nb)
        devices = {g.device for g in groups}
        unmet = self.unmet(cols)
        planner: dict[str, object] = {"objective": "rate" if i.rate is not None else "goodput",
                                      "budget": i.budget, "target_rate": i.rate}
        if unmet:
            planner["served_without_slo"] = [b for _, b in unmet]
        plan = ServingPlan(i.models, i.cluster, i.buckets, i.slo, i.attainment, tuple(groups), routing,
                           {d: i.prices[d] for d in sorted(devices)}, (), i.cascade,
                           {"rate": round(s.rate, 6), "dollars_per_hour": round(s.cost, 6)}, i.workload, planner)
        return plan

    def calibrated(self, by_group: dict[int, float], split: float = 1.0, default: float = 1.0) -> Planner:
        """This planner with each configuration's capacities scaled by what the simulator found of plans against
        their predictions: ``by_group[g]`` for device group ``g`` (else ``default``), and prefill and decode ones
        by ``split`` more."""
        out = copy.copy(self)
        scale = np.array([by_group.get(c.group, default) * (1.0 if c.role == "aggregated" else split)
                          for c in self.configs])
        out.capacity = self.capacity * scale[:, None]
        return out

    def counts_of(self, plan: ServingPlan) -> dict[int, int]:
        """Configuration index -> replicas, for a plan of this planner's configurations."""
        index = {c.key: k for k, c in enumerate(self.configs)}
        out: dict[int, int] = {}
        for g in plan.groups:
            k = index.get((g.model, g.group, g.tp, g.pp, g.role, g.knobs.max_batched_tokens, g.knobs.max_seqs))
            if k is None:
                raise PlanError(f"group {g.label} is no configuration of this planner")
            out[k] = out.get(k, 0) + g.replicas
        return out

    def plan_counts(self, counts: dict[int, int], routing: str = "weights") -> tuple[ServingPlan, Solution] | None:
        """The plan of exactly these replicas, routed at its highest rate (None when they cannot serve every
        bucket)."""
        cols = sorted(k for k, n in counts.items() if n > 0)
        try:
            s = self.solve(cols, counts=[counts[k] for k in cols])
        except PlanError:
            return None
        return self.to_plan(cols, s, routing), s

    def cost(self, counts: dict[int, int]) -> float:
        return sum(self.price[self.configs[k].group] * self.configs[k].devices * n for k, n in counts.items())

    def fits(self, counts: dict[int, int]) -> bool:
        """Whether these replicas fit the devices and the budget, each model's prefill replicas with decode
        replicas to hand to (and the other way round)."""
        used = [0] * len(self.cluster.groups)
        roles: dict[int, set[str]] = {}
        for k, n in counts.items():
            used[self.configs[k].group] += self.configs[k].devices * n
            roles.setdefault(self.configs[k].model, set()).add(self.configs[k].role)
        if any(("prefill" in r) != ("decode" in r) for r in roles.values()):
            return False
        if any(u > g.world_size for u, g in zip(used, self.cluster.groups)):
            return False
        b = self.inputs.budget
        return b is None or self.cost(counts) <= b + 1e-9


def _normalised(groups: list[ReplicaGroup], models: int, nb: int) -> list[ReplicaGroup]:
    """Each bucket's entry (and decode) shares over a model's groups summing to exactly 1."""
    out = list(groups)
    for m in range(models):
        for key in ("entry", "decode"):
            idx = [j for j, g in enumerate(out) if g.model == m and getattr(g, key)]
            for b in range(nb):
                total = sum(getattr(out[j], key)[b] for j in idx)
                if total <= 0:
                    continue
                for j in idx:
                    vals = list(getattr(out[j], key))
                    vals[b] = vals[b] / total
                    out[j] = replace(out[j], entry=tuple(vals)) if key == "entry" else \
                        replace(out[j], decode=tuple(vals))
    return out


# ---- the whole search ----------------------------------------------------------------------------------
def candidates(planner: Planner, variants: dict[str, tuple[str, ...]] = VARIANTS,
               rate: float | None = None) -> list[Candidate]:
    """The MILP's plan for each variant of roles (those that have one), identical layouts once."""
    i = planner.inputs
    out: list[Candidate] = []
    seen = set()
    for name, roles in variants.items():
        cols = planner.columns(roles)
        if not cols:
            continue
        try:
            s = planner.solve(cols, budget=i.budget, rate=rate if rate is not None else i.rate)
        except PlanError:
            continue
        if s.rate <= 0 or not s.counts.any():
            continue
        plan = planner.to_plan(cols, s)
        if plan.layout in seen:
            continue
        seen.add(plan.layout)
        out.append(Candidate(name, plan, s))
    if not out:
        raise PlanError("no plan serves the workload within the SLO, the devices and the budget; give more devices "
                        "or budget, a lower rate, or relax the SLO")
    return out


def _better(a: Score, b: Score | None, target: float | None) -> bool:
    """Whether score ``a`` beats ``b``: with a target rate, meeting it and then the cheaper; else the more
    goodput, then the cheaper."""
    if b is None:
        return True
    if target is not None:
        ma, mb = a.goodput >= target, b.goodput >= target
        if ma != mb:
            return ma
        if ma:
            return a.dollars_per_hour < b.dollars_per_hour - 1e-9
        return a.goodput > b.goodput
    if not math.isclose(a.goodput, b.goodput, rel_tol=1e-9):
        return a.goodput > b.goodput
    return a.dollars_per_hour < b.dollars_per_hour - 1e-9


def plan(inputs: PlanInputs, workload_at: Callable[[float], Workload] | None = None, repair: int = REPAIR_ROUNDS,
         planner: Planner | None = None, progress: Callable[[str], None] | None = None) -> PlanResult:
    """Plan for ``inputs``; with ``workload_at`` (the workload at a rate), score the candidates in the simulator
    and repair the best by ``repair`` rounds of local moves."""
    say = progress or (lambda _: None)
    t0 = time.perf_counter()
    if planner is None or planner.inputs != inputs:
        planner = Planner(inputs)
    cands = candidates(planner)
    plan_s = time.perf_counter() - t0
    unmet = planner.unmet(planner.columns())
    notes = [f"buckets served without meeting the SLO (no replica can): "
             f"{', '.join(inputs.buckets.buckets[b].label for _, b in unmet)}"] if unmet else []
    if workload_at is None:
        best = max(cands, key=lambda c: (c.solution.rate if c.solution else 0.0, -(c.solution.cost
                                                                                   if c.solution else 0.0)))
        return PlanResult(best.plan, None, tuple(cands), (), plan_s, 0.0, len(planner.configs), tuple(notes),
                          planner)
    t1 = time.perf_counter()
    target = inputs.rate
    scored = []
    for c in cands:
        say(f"simulating the {c.name} candidate: {c.plan.layout}")
        start = c.solution.rate if c.solution else target or 1.0
        scored.append(replace(c, score=score(c.plan, workload_at, start, planner.overhead)))
    more, calibrated = _calibration(planner, scored, workload_at, say)
    scored += more
    if target is not None:
        scored += _calibrated(calibrated, scored, workload_at, say)
    best = scored[0]
    for c in scored[1:]:
        assert c.score is not None
        if _better(c.score, best.score, target):
            best = c
    # The routing inside a bucket's shares: in proportion, or by least work (whichever the simulator prefers).
    assert best.score is not None
    other = "least-work" if best.plan.routing == "weights" else "weights"
    alt = Candidate(f"{best.name}, {other} routing", replace(best.plan, routing=other), best.solution)
    alt = replace(alt, score=score(alt.plan, workload_at, best.score.goodput or 1.0, planner.overhead))
    scored.append(alt)
    assert alt.score is not None
    if _better(alt.score, best.score, target):
        best = alt
    moves: list[str] = []
    if repair > 0:
        say(f"repairing by local moves ({repair} rounds)")
        best, moves = _repair(calibrated, best, workload_at, repair, say)
    assert best.score is not None
    final = best.plan.with_predicted(goodput=round(best.score.goodput, 6),
                                     goodput_per_dollar=round(best.score.per_dollar, 6),
                                     dollars_per_hour=round(best.score.dollars_per_hour, 6),
                                     **_latency(best.score))
    return PlanResult(final, best.score, tuple(scored), tuple(moves), plan_s, time.perf_counter() - t1,
                      len(planner.configs), tuple(notes), calibrated)


def _latency(s: Score) -> dict:
    at = s.at(s.goodput) if s.goodput > 0 else None
    if at is None:
        return {}
    return {"attainment": round(at.attainment or 0.0, 4), "ttft_p90_s": round(at.ttft["p90"], 6),
            "tpot_p90_s": round(at.tpot["p90"], 6)}


def _calibration(planner: Planner, scored: list[Candidate], workload_at: Callable[[float], Workload],
                 say: Callable[[str], None]) -> tuple[list[Candidate], Planner]:
    """The MILP calibrated against the simulator. Each device type's aggregated plan alone is simulated (itself a
    candidate): what the simulator serves of its prediction scales that type's capacities; what it serves of the
    split-only plan's against the aggregated-only one's scales prefill and decode replicas more. The mixed and
    aggregated MILPs solved again so are candidates too: the MILP then weighs device types and roles as the
    simulator does. The new candidates, and the planner calibrated so."""
    target = planner.inputs.rate

    def served(c: Candidate) -> float | None:
        if c.score is None or c.solution is None or c.score.goodput <= 0:
            return None
        pred = target if target is not None else c.solution.rate
        return c.score.goodput / pred if pred > 0 else None

    out: list[Candidate] = []
    by_group: dict[int, float] = {}
    seen = {c.plan.layout for c in scored}
    for g, group in enumerate(planner.cluster.groups):
        cols = planner.columns(("aggregated",), groups=[g])
        if not cols:
            continue
        try:
            s = planner.solve(cols, budget=planner.inputs.budget, rate=target)
        except PlanError:
            continue
        if s.rate <= 0 or not s.counts.any():
            continue
        one = Candidate(f"{group.device.name} only", planner.to_plan(cols, s), s)
        say(f"simulating the {one.name} candidate: {one.plan.layout}")
        one = replace(one, score=score(one.plan, workload_at, s.rate, planner.overhead))
        ratio = served(one)
        if ratio is not None:
            by_group[g] = ratio
        if one.plan.layout not in seen:
            out.append(one)
            seen.add(one.plan.layout)
    kinds = {c.name: served(c) for c in scored if c.name in ("aggregated", "disaggregated")}
    agg, split = kinds.get("aggregated"), kinds.get("disaggregated")
    rel = split / agg if agg and split else 1.0
    default = agg if agg else 1.0
    if not by_group and abs(rel - 1) <= CALIBRATION_SPREAD:
        return out, planner
    say("calibrated: the simulator served " + ", ".join(f"{planner.cluster.groups[g].device.name} {r:.0%}"
                                                        for g, r in by_group.items())
        + f" of their predictions, split replicas {rel:.0%} of aggregated ones; planning again so")
    calibrated = planner.calibrated(by_group, rel, default)
    for name, roles in (("mixed", ROLES), ("aggregated", ("aggregated",))):
        try:
            again = candidates(calibrated, {name: roles})[0]
        except PlanError:
            continue
        if again.plan.layout in seen:
            continue
        seen.add(again.plan.layout)
        sc = score(again.plan, workload_at, again.solution.rate if again.solution else 1.0, planner.overhead)
        out.append(replace(again, name=f"{name}, calibrated", score=sc))
    return out, calibrated


def _calibrated(planner: Planner, scored: list[Candidate], workload_at: Callable[[float], Workload],
                say: Callable[[str], None]) -> list[Candidate]:
    """The MILP's plans (the calibrated ones where there are, else each variant's) planned again, when the
    simulator found them short of the target rate, at the rate scaled by what they fell short."""
    target = planner.inputs.rate
    assert target is not None
    calibrated = [c for c in scored if c.name.endswith(", calibrated")]
    out: list[Candidate] = []
    for c in calibrated or [c for c in scored if c.name in VARIANTS]:
        assert c.score is not None
        name = c.name.removesuffix(", calibrated")
        ask, got = target, c.score.goodput
        for _ in range(CALIBRATIONS):
            if got >= target or got <= 0:
                break
            ask *= target / got
            try:
                again = candidates(planner, {name: VARIANTS[name]}, rate=ask)[0]
            except PlanError:
                break
            say(f"the {c.name} plan served {got:.3g} req/s of {target:.3g}; planned again for {ask:.3g}")
            s = score(again.plan, workload_at, target, planner.overhead)
            again = replace(again, name=f"{c.name}, at {ask:.3g} req/s", score=s)
            out.append(again)
            got = s.goodput
    return out


def _neighbours(planner: Planner, counts: dict[int, int]) -> list[tuple[str, dict[int, int]]]:
    """Plans one move away: a replica's role or engine knobs changed, its tp halved (two replicas) or two
    merged, a replica moved to another device group, one removed, or (within the budget) one added."""
    configs = planner.configs
    variants: dict[tuple, list[int]] = {}  # (model, group, tp, pp, role) -> its knob variants
    for k, c in enumerate(configs):
        variants.setdefault(c.shape + (c.role,), []).append(k)
    out: list[tuple[str, dict[int, int]]] = []

    def moved(label: str, minus: dict[int, int], plus: dict[int, int]) -> None:
        new = dict(counts)
        for k, n in minus.items():
            new[k] = new.get(k, 0) - n
            if new[k] < 0:
                return
        for k, n in plus.items():
            new[k] = new.get(k, 0) + n
        new = {k: n for k, n in new.items() if n > 0}
        if new and planner.fits(new):
            out.append((label, new))

    def name(k: int) -> str:
        c = configs[k]
        knob = f"s{c.knobs.max_seqs}" if c.role == "decode" else f"b{c.knobs.max_batched_tokens}"
        return f"{c.label} {knob} on {planner.cluster.groups[c.group].device.name}"

    def like(k: int, model: int, group: int, tp: int, pp: int, role: str) -> int | None:
        """The configuration of that shape and role with ``k``'s knobs, else its first knob variant."""
        ks = variants.get((model, group, tp, pp, role), [])
        same = [j for j in ks if configs[j].knobs == configs[k].knobs]
        return (same or ks)[0] if ks else None

    for k, n in sorted(counts.items()):
        c = configs[k]
        for j in variants[c.shape + (c.role,)]:
            if j != k:
                moved(f"{name(k)} -> {name(j)}", {k: 1}, {j: 1})
        for role in ROLES:
            if role != c.role:
                for j in variants.get(c.shape + (role,), []):
                    moved(f"{name(k)} -> {name(j)}", {k: 1}, {j: 1})
        half = like(k, c.model, c.group, c.tp // 2, c.pp, c.role) if c.tp > 1 else None
        if half is not None:
            moved(f"{name(k)} -> 2x {name(half)}", {k: 1}, {half: 2})
        double = like(k, c.model, c.group, c.tp * 2, c.pp, c.role)
        if double is not None and n >= 2:
            moved(f"2x {name(k)} -> {name(double)}", {k: 2}, {double: 1})
        for g in range(len(planner.cluster.groups)):
            if g == c.group:
                continue
            for tp in (c.tp, c.tp * 2, c.tp // 2):
                there = like(k, c.model, g, tp, 1, c.role) if tp >= 1 else None
                if there is not None:
                    moved(f"{name(k)} -> {name(there)}", {k: 1}, {there: 1})
                    break
        moved(f"remove a {name(k)}", {k: 1}, {})
        moved(f"add a {name(k)}", {}, {k: 1})
    return out


def _repair(planner: Planner, best: Candidate, workload_at: Callable[[float], Workload], rounds: int,
            say: Callable[[str], None]) -> tuple[Candidate, list[str]]:
    """Tabu search over local moves, judged by the simulator (see the module doc)."""
    assert best.score is not None
    target = planner.inputs.rate
    routing = best.plan.routing
    current = planner.counts_of(best.plan)
    visited = {tuple(sorted(current.items()))}
    log: list[str] = []
    for r in range(rounds):
        assert best.score is not None
        options = []
        for label, counts in _neighbours(planner, current):
            key = tuple(sorted(counts.items()))
            if key in visited:
                continue
            built = planner.plan_counts(counts, routing)
            if built is None:
                continue
            p, s = built
            if target is not None:
                if s.rate < target:
                    continue
                rank = -planner.cost(counts)  # the cheapest first
            else:
                rank = s.rate
            options.append((rank, label, counts, p, s))
        if not options:
            break
        options.sort(key=lambda o: -o[0])
        probe = target if target is not None else max(best.score.goodput, 1e-3) * PROBE
        tried = []
        for _, label, counts, p, s in options[:REPAIR_TRIES]:
            visited.add(tuple(sorted(counts.items())))
            a, _ = attainment_at(p, workload_at, probe, planner.overhead)
            tried.append((a, -planner.cost(counts), label, counts, p, s))
        tried.sort(key=lambda t: (t[0], t[1]), reverse=True)
        a, _, label, counts, p, s = tried[0]
        current = counts
        if a >= planner.inputs.attainment:
            sc = score(p, workload_at, probe, planner.overhead)
            if _better(sc, best.score, target):
                best = Candidate(f"{best.name.split(' +')[0]} + repair", p, s, sc)
                log.append(f"round {r + 1}: {label}: goodput {sc.goodput:.4g} req/s at ${sc.dollars_per_hour:.2f}/h")
                say(log[-1])
                continue
        log.append(f"round {r + 1}: {label}: no better ({a:.1%} of requests met the SLO at {probe:.4g} req/s)")
        say(log[-1])
    return best, log
