"""The planner's first two steps for one set of inputs (:mod:`.search` holds the whole search): every
configuration and its capacity per bucket (:mod:`.capacity`), built once, and the deployment MILP
(:mod:`.milp`) over subsets of them, each answer written as a serving plan.
"""

from __future__ import annotations

import copy
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from flexmesh.cost.inference.memory import kv_bytes_per_token, kv_groups
from flexmesh.cost.inference.overhead import EngineOverhead
from flexmesh.cost.inference.transfer import Span, kv_path
from flexmesh.errors import PlanError
from flexmesh.serve.layout.buckets import RequestBuckets
from flexmesh.serve.layout.engine import EngineSpec
from flexmesh.serve.layout.knobs import EngineKnobs
from flexmesh.serve.layout.plan import CascadeSpec, ServingGroup, ServingPlan
from flexmesh.serve.layout.roles import Role
from flexmesh.serve.layout.routing import RoutingPolicy
from flexmesh.serve.layout.slo import SLO
from flexmesh.serve.plan.capacity import CAPACITY_TOL, Capacity, Pricing, ReplicaConfig, configurations
from flexmesh.serve.plan.milp import Columns, Problem, Solution, solve, solve_fast
from flexmesh.serve.plan.score import Score
from flexmesh.spec.cluster import parse_mixed_cluster
from flexmesh.spec.model import parse_model


@dataclass(frozen=True)
class PlanInputs:
    """What to plan for: models (names; a cascade's in order), the cluster of devices one can get, the
    workload's buckets, the SLO and its attainment target, $ per GPU-hour by device name, and a budget
    ($/h: the most goodput within it) or a target rate (requests/s: the cheapest plan serving it); with a budget,
    ``per_dollar`` asks for the most goodput per $/h within it instead (of the plans the simulator scores, each
    near the budget, the one whose goodput costs least: whole replicas leave some plans a few dollars unspent).
    ``tiers``: each model's share of the requests (a cascade: 1 and the escalated fraction; several
    models: their mix)."""

    models: tuple[str, ...]
    cluster: str
    buckets: RequestBuckets
    slo: SLO
    prices: dict[str, float]
    attainment: float = 0.9
    budget: float | None = None
    rate: float | None = None
    tiers: tuple[float, ...] = (1.0,)
    cascade: CascadeSpec | None = None
    overhead: EngineOverhead | None = None  # in place of the engine's own
    knobs: dict[int, EngineKnobs] | None = None
    engine: EngineSpec | None = None  # what the replicas run (default: current vLLM)
    workload: dict = field(default_factory=dict)
    time_limit_s: float = 20.0  # the most seconds one MILP may take (a safety net: plans do not depend on it)
    stage_slos: tuple[SLO, ...] | None = None  # per model, the SLO its replicas are priced at (a cascade's stages)
    per_dollar: bool = False  # with a budget: the most goodput per $/h within it, not the most goodput

    def __post_init__(self) -> None:
        if self.budget is None and self.rate is None:
            raise PlanError("give --budget (the most goodput within it) or --rate (the cheapest plan serving it)")
        if len(self.tiers) != len(self.models):
            raise PlanError(f"{len(self.tiers)} request shares for {len(self.models)} models; give one per model")


@dataclass(frozen=True)
class PlanCandidate:
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
    candidates: tuple[PlanCandidate, ...]
    moves: tuple[str, ...]
    plan_s: float
    simulate_s: float
    configs: int
    notes: tuple[str, ...]
    planner: Planner | None = None  # calibrated by role where the simulator found that needed


# What a bound that binds even at the lowest rate means, and what to change (:meth:`Planner.binding`).
BINDING = {
    "ttft": "the TTFT bound binds: no replica here computes these prompts that fast, even alone; raise ttft or give "
            "faster devices (or a higher tp)",
    "tpot": "the TPOT bound binds: no replica here decodes a token that fast, even alone; raise tpot or give faster "
            "devices (or a higher tp)",
    "e2e": "the E2E bound binds: no replica here answers these requests that fast, even alone; raise e2e",
    "kv": "KV memory binds: no replica here holds these requests' KV; give devices with more memory or a higher tp",
    "max-seqs": "max_seqs binds: raise the engines' max_seqs",
    "budget": "the batched-token budget binds: raise max_batched_tokens",
    "fit": "no replica here holds these requests at all; give devices with more memory or a higher tp",
}


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
        self.pricing = Pricing(self.models, self.cluster, i.overhead, i.attainment, i.engine)
        self.engine, self.overhead = self.pricing.engine, self.pricing.overhead
        self.configs = configurations(self.models, self.cluster, i.buckets.longest, knobs=i.knobs, engine=self.engine)
        if not self.configs:
            raise PlanError(f"no replica of {', '.join(i.models)} fits on {self.cluster.label}; give larger devices")
        buckets = i.buckets.buckets
        slos = i.stage_slos or (i.slo,) * len(self.models)
        self.slos = slos
        self.capacity = np.array([[self.pricing.capacity(c, b, slos[c.model]).rate if b.share > 0 else 0.0
                                   for b in buckets] for c in self.configs])
        self.detail: dict[tuple[int, int], Capacity] = {}
        self._unbounded: dict[int, np.ndarray] = {}  # configuration -> its capacity per bucket with no SLO
        self.price = [i.prices[g.device.name] for g in self.cluster.groups]
        self.demand = np.array([[t * b.share for b in buckets] for t in i.tiers])
        self.priced = self.capacity  # as priced, before any calibration (:meth:`uncalibrated`)
        self.scale = np.ones(len(self.configs))  # the calibration of each configuration's capacities
        self.dominated = self._dominated()
        self.decodes = np.array([[b.output_mean > 1.0 for b in buckets] for _ in i.tiers])
        self.kv_bytes = np.array([[kv_groups(m).held(b.prompt_mean) * kv_bytes_per_token(m) for b in buckets]
                                  for m in self.models])
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
        devices serve at least as much; the MILP need not see the first). Decode replicas of one shape that
        differ only in ``max_seqs`` are compared within the capacities' own tolerance
        (:data:`~.capacity.CAPACITY_TOL`): where the estimates do not tell them apart, the larger ``max_seqs``
        is kept (the room above the quantile batch that a burst of hand-offs fills, which the estimates do not
        see), not whichever the bisection happened to put a percent ahead."""
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
                    if ca.role == Role.DECODE and ca.shape == cb.shape and ca.knobs.max_seqs != cb.knobs.max_seqs:
                        if ca.knobs.max_seqs > cb.knobs.max_seqs and (per_a >= per_b * (1 - CAPACITY_TOL)).all():
                            out.add(b)
                            break
                        continue
                    if (per_a >= per_b).all() and (ca.devices < cb.devices or a < b):
                        out.add(b)
                        break
        return out

    # ---- MILPs ---------------------------------------------------------------------------------------
    def columns(self, roles: Sequence[Role] = tuple(Role), groups: Sequence[int] | None = None,
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
            allowed = {Role.PREFILL: prefill_groups, Role.DECODE: decode_groups}.get(c.role) or groups
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
            entry = [k for k in cols if self.configs[k].model == m and self.configs[k].role != Role.DECODE]
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
                                f"more than the {1 - i.attainment:.0%} the attainment target allows: "
                                f"{self.binding(cols, m, [b for mm, b in unmet if mm == m])}")
        for m, b in unmet:
            for j, k in enumerate(cols):
                if self.configs[k].model == m:
                    cap[j, b] = self.pricing.capacity(self.configs[k], buckets[b], SLO()).rate
        return cap

    def binding(self, cols: Sequence[int], m: int, unmet: Sequence[int]) -> str:
        """What stops every configuration of ``cols`` taking model ``m``'s new requests of the ``unmet`` buckets
        within the SLO, even alone: the bound most of them meet first, and what to change."""
        buckets = self.inputs.buckets.buckets
        hit = Counter(self.pricing.capacity(self.configs[k], buckets[b], self.slos[m]).bound for k in cols
                      for b in unmet if self.configs[k].model == m and self.configs[k].role != Role.DECODE)
        bound = hit.most_common(1)[0][0] if hit else "fit"
        return BINDING.get(bound, f"{bound} binds first; relax the SLO or give faster devices")

    def unbounded(self, cols: Sequence[int]) -> np.ndarray:
        """The capacities of ``cols`` per bucket with no latency bound (what a replica serves of requests that
        miss the SLO anyway), priced once per configuration and kept."""
        buckets = self.inputs.buckets.buckets
        for k in cols:
            if k not in self._unbounded:
                self._unbounded[k] = np.array([self.pricing.capacity(self.configs[k], b, SLO()).rate
                                               if b.share > 0 else 0.0 for b in buckets])
        return np.array([self._unbounded[k] for k in cols]).reshape(len(cols), len(buckets))

    def problem(self, cols: Sequence[int], budget: float | None = None, rate: float | None = None,
                counts: Sequence[int] | None = None, limits: dict | None = None,
                available: Sequence[int] | None = None, by_role: bool = False, misses: float = 0.0) -> Problem:
        """The MILP over ``cols``; ``limits``: at most this many replicas of each weights shape (with
        ``by_role``: of each (weights shape, role)); ``misses``: the share of the rate that may enter missing the
        SLO (partial buckets, :class:`~.milp.Problem`), the capacities then as priced (a bucket no column serves
        within the SLO enters only as such a miss)."""
        cfg = [self.configs[k] for k in cols]
        columns = Columns([c.model for c in cfg], [c.group for c in cfg], [c.devices for c in cfg],
                          [c.role for c in cfg], [(c.shape, c.role) if by_role else c.shape for c in cfg])
        partial = misses > 0
        return Problem(columns, self.capacity[list(cols)] if partial else self.capacities(cols), self.demand,
                       available or [g.world_size for g in self.cluster.groups], self.price, budget, rate,
                       self.kv_bytes, self.links, self.decodes, counts=counts, limits=limits, misses=misses,
                       capacity_any=self.unbounded(cols) * self._scale(cols) if partial else None)

    def _scale(self, cols: Sequence[int]) -> np.ndarray:
        """Per column, this planner's calibration of its capacities (1 where none)."""
        return np.array([self.scale[k] for k in cols])[:, None] if len(cols) else np.ones((0, 1))

    def solve(self, cols: Sequence[int], budget: float | None = None, rate: float | None = None,
              counts: Sequence[int] | None = None, limits: dict | None = None,
              available: Sequence[int] | None = None, by_role: bool = False, misses: float = 0.0) -> Solution:
        problem = self.problem(cols, budget, rate, counts, limits, available, by_role, misses)
        if counts is not None:  # a linear program: nothing to be quick about
            return solve(problem)
        return solve_fast(problem, self.inputs.time_limit_s)

    def candidate(self, name: str, cols: Sequence[int]) -> PlanCandidate | None:
        """The MILP's plan over ``cols`` at the inputs' budget and rate, named ``name``; None where there are no
        columns, the MILP finds no plan, or the plan serves nothing."""
        if not cols:
            return None
        try:
            s = self.solve(cols, budget=self.inputs.budget, rate=self.inputs.rate)
        except PlanError:
            return None
        if s.rate <= 0 or not s.counts.any():
            return None
        return PlanCandidate(name, self.to_plan(cols, s), s)

    # ---- plans ---------------------------------------------------------------------------------------
    def to_plan(self, cols: Sequence[int], s: Solution, routing: RoutingPolicy = RoutingPolicy.WEIGHTS) -> ServingPlan:
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
            decodes = c.role == Role.DECODE
            groups.append(ServingGroup(c.model, c.group, self.cluster.groups[c.group].device.name, n, c.tp, c.pp,
                                       c.role, c.knobs, tuple(0.0 if decodes else float(x) for x in entry),
                                       tuple(float(x) for x in dec) if decodes else ()))
        groups = _normalised(groups, len(self.models), nb)
        devices = {g.device for g in groups}
        unmet = self.unmet(cols)
        planner: dict[str, object] = {"objective": "rate" if i.rate is not None else "goodput",
                                      "budget": i.budget, "target_rate": i.rate}
        if unmet:
            planner["served_without_slo"] = [b for _, b in unmet]
        plan = ServingPlan(i.models, i.cluster, i.buckets, i.slo, i.attainment, tuple(groups), routing,
                           {d: i.prices[d] for d in sorted(devices)}, (), i.cascade,
                           {"rate": round(s.rate, 6), "dollars_per_hour": round(s.cost, 6)}, i.workload, planner,
                           self.engine)
        return plan

    def calibrated(self, by_group: dict[int, float], split: float = 1.0, default: float = 1.0) -> Planner:
        """This planner with each configuration's capacities scaled by what the simulator found of plans against
        their predictions: ``by_group[g]`` for device group ``g`` (else ``default``), and prefill and decode ones
        by ``split`` more."""
        out = copy.copy(self)
        scale = np.array([by_group.get(c.group, default) * (1.0 if c.role == Role.AGGREGATED else split)
                          for c in self.configs])
        out.capacity = self.capacity * scale[:, None]
        out.scale = self.scale * scale
        return out

    def uncalibrated(self) -> Planner:
        """This planner with its capacities as priced, before :meth:`calibrated` scaled them."""
        out = copy.copy(self)
        out.capacity, out.scale = self.priced, np.ones(len(self.configs))
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

    def plan_counts(self, counts: dict[int, int], routing: RoutingPolicy = RoutingPolicy.WEIGHTS
                    ) -> tuple[ServingPlan, Solution] | None:
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
        if any((Role.PREFILL in r) != (Role.DECODE in r) for r in roles.values()):
            return False
        if any(u > g.world_size for u, g in zip(used, self.cluster.groups)):
            return False
        b = self.inputs.budget
        return b is None or self.cost(counts) <= b + 1e-9


def _normalised(groups: list[ServingGroup], models: int, nb: int) -> list[ServingGroup]:
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
