"""Re-planning a running deployment: the fast path that moves no weights, and a full re-plan with its transition.

**Fast path** (ThunderServe's lightweight re-scheduling, 2502.09334; SpotServe's reaction to lost
instances): when replica groups are lost or the workload shifts (its rate, its buckets), the replicas that are
left keep their weights (model, device group, tp, pp) and only their roles, engine knobs and the routing
change: the MILP over the configurations of those weight shapes, at most as many replicas of each shape as
survive (:func:`fast_replan`). No new device is taken, so the price can only fall. The MILP is solved four ways:
with every replica in the role it had (knobs and routing free) and with roles free, each with every bucket
served in full and with **partial buckets** (up to :data:`PARTIAL_MISSES` of the attainment target's slack may
enter missing the SLO, priced at the replicas' capacity without it: survivors that serve a bucket within the
SLO only slowly, or not at all, then need not hold the whole rate down to it). Given the workload, two more
(roles kept and free) with a **conceded bucket**: the bucket the SLO binds most on the survivors, of those whose
share fits within the attainment slack, enters wholly missing the SLO on replicas that take nothing else (of
each shape and role, the configuration of the largest batched-token budget), every other bucket in full on the
others. Where the big replicas that served long prompts are lost, the tp1 replicas left serve the longest
prompts within the TTFT bound in the MILP's capacities but miss most of them in the simulator; a candidate that
keeps serving them in full or in part holds the short requests' replicas to them, or mixes their long prefills
into the short requests' batches (``bench/serve_plan.py``'s 8B conversation plan, its tp2 or its tp4 replica
lost, records both: a fresh plan's goodput on the devices left against the candidates with and without the
long bucket conceded).

The simulator judges the candidates on the workload's first :data:`JUDGE_REQUESTS` requests (fewer end before
a replica near saturation has built its queue, and every candidate looks alike), each with both routing
policies inside its buckets' shares (the plan's own first), the same replicas routed alike once: the highest
MILP rate first, each simulated at its rate, then those above the best met at the lower rungs of
:data:`LADDER`, the highest rate met taken; at most :data:`JUDGE_SIMULATIONS` simulations (the fast path stays
within a second), and where none meets the target, the candidate nearest it. Without the workload, the MILP's
rule: a role change or partial buckets only when the MILP finds them better by more than its own tolerance
(:data:`~.milp.MIP_GAP`: the plan it starts from was the simulator's pick between aggregated and split replicas,
and a split the MILP's capacities prefer by a percent can serve a quarter less in the simulator).

**Full re-plan**: a fresh plan for the new situation, and what moving to it costs (:func:`transition`): old
replicas are matched to new ones at least cost (:func:`scipy.optimize.linear_sum_assignment` over the bytes
each pairing loads: nothing where the weights are the same, the new shard where a replica's devices take other
weights, every byte for a replica on devices no old one held); an old replica left unmatched stops, and the
KV of the requests it holds moves to a replica of the new plan. Loading is priced at each device's PCIe
bandwidth from host memory, KV moves over the link between the two replicas' groups (both as the device
catalogue gives them), the replicas loading weights in parallel; the dollars are the GPU-hours spent loading.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import linear_sum_assignment

from flexmesh.cost.inference.memory import kv_bytes_per_token, weight_bytes_on_device
from flexmesh.cost.inference.transfer import Span, kv_path
from flexmesh.data.requests import Workload, window
from flexmesh.errors import PlanError
from flexmesh.serve.layout.plan import ServingPlan
from flexmesh.serve.layout.roles import Role
from flexmesh.serve.layout.routing import RoutingPolicy
from flexmesh.serve.plan.milp import MIP_GAP, Solution, solve_fast
from flexmesh.serve.plan.planner import Planner
from flexmesh.serve.plan.score import attainment_at

# The partial-bucket MILP lets this share of the attainment target's slack (1 - attainment) enter missing the SLO;
# the rest is left to the requests priced within it (their capacities are at the attainment quantile).
PARTIAL_MISSES = 0.5
# Requests (the workload's first) on which the simulator judges the fast path's candidates: a few seconds of
# traffic, simulated once per candidate.
JUDGE_REQUESTS = 1000
# The most simulations the judgement runs (a candidate with one routing policy at one rate: ~0.1 s of CPU each).
JUDGE_SIMULATIONS = 3
# The rates the simulator tries a candidate at, as shares of its MILP rate, until one meets the target.
LADDER = (1.0, 0.85)
# A pairing that cannot be (an old replica's devices are in another device group): a cost no real one reaches.
_NEVER = 1e30


@dataclass(frozen=True)
class FastReplan:
    plan: ServingPlan
    seconds: float  # the planner's time (the MILPs over the surviving replicas, the simulator's judgement)
    changed: tuple[str, ...]  # what changed: roles, knobs, replicas left idle
    candidate: str = ""  # which of the MILP's candidates was taken (roles kept or free, partial buckets or not)
    cpu_s: float = 0.0  # the process's CPU seconds in that time (what other work on the machine does not stretch)


def _left(plan: ServingPlan, lost: Sequence[int] | Mapping[int, int]) -> list[int]:
    """Replicas each group of ``plan`` keeps after ``lost``: group indices (all their replicas), or group index ->
    replicas lost."""
    gone = dict(lost) if isinstance(lost, Mapping) else {i: plan.groups[i].replicas for i in lost}
    for i, n in gone.items():
        if not 0 <= i < len(plan.groups) or n < 0:
            raise PlanError(f"lost group {i} is not one of the plan's {len(plan.groups)} (0..{len(plan.groups) - 1})")
    return [max(0, g.replicas - gone.get(i, 0)) for i, g in enumerate(plan.groups)]


def fast_replan(planner: Planner, plan: ServingPlan, lost: Sequence[int] | Mapping[int, int] = (),
                rate: float | None = None, workload_at: Callable[[float], Workload] | None = None,
                judge_requests: int = JUDGE_REQUESTS) -> FastReplan:
    """``plan`` re-routed after its replica groups ``lost`` (indices into ``plan.groups``, or index -> replicas
    lost) are gone, for ``planner``'s workload (its buckets: the shifted workload's), at ``rate`` when given (the
    cheapest plan serving it with the replicas left) or the most it can serve. Only roles, engine knobs and
    routing change. The MILP's candidates (roles kept or free, every bucket in full or partial buckets, and with
    ``workload_at`` a bucket conceded) are judged by the simulator on the first ``judge_requests`` requests of
    ``workload_at`` where it is given, else by the MILP with its tolerance (see the module doc)."""
    t0, c0 = time.perf_counter(), time.process_time()
    left: dict[tuple[int, int, int, int], int] = {}
    roles: dict[tuple[tuple[int, int, int, int], str], int] = {}
    keep = _left(plan, lost)
    for g, n in zip(plan.groups, keep):
        if n:
            left[g.shape] = left.get(g.shape, 0) + n
            roles[g.shape, g.role] = roles.get((g.shape, g.role), 0) + n
    if not left:
        raise PlanError("every replica group is lost; nothing is left to re-route (plan again with flexmesh serve "
                        "plan)")
    every = planner.columns(everything=True, keep=lambda c: c.shape in left)
    same_cols = [k for k in every if (planner.configs[k].shape, planner.configs[k].role) in roles]
    given = rate is not None
    # (name, columns, solution, whether it changes roles), in the order the MILP's rule prefers them on a tie
    found: list[tuple[str, list[int], Solution, bool]] = []
    failed: PlanError | None = None
    for misses in sorted({0.0, PARTIAL_MISSES * (1 - planner.inputs.attainment)}):
        for name, cols, by_role, limits in (("roles kept", same_cols, True, roles), ("roles free", every, False, left)):
            try:
                sol = planner.solve(cols, rate=rate, limits=limits, by_role=by_role, misses=misses)
            except PlanError as e:  # the roles left cannot serve it (say, a model's decode replicas are all lost)
                failed = failed or e
                continue
            if sol.rate <= 0 or not sol.counts.any():
                continue
            moved = any(n > roles.get(r, 0) for r, n in _used(planner, cols, sol).items())
            found.append((f"{name}{', partial buckets' if misses else ''}", cols, sol, moved))
    if not found:
        raise failed or PlanError("the replicas left serve no rate; plan again with flexmesh serve plan")
    if workload_at is not None:  # a conceded bucket is a guess only the simulator can confirm
        found += _concessions(planner, rate, (("roles kept", same_cols, True, roles), ("roles free", every, False,
                                                                                       left)), roles)
    routing = plan.routing
    if workload_at is None:
        pick = _by_milp(found, given)
    else:
        pick, routing = _by_simulator(planner, plan, found, workload_at, rate, judge_requests)
    chosen, cols, s, _ = found[pick]
    new = planner.to_plan(cols, s, routing)
    if routing != plan.routing:
        chosen += f", {routing} routing"
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    before = {(g.shape, g.role, g.knobs): n for g, n in zip(plan.groups, keep) if n}
    after = {(g.shape, g.role, g.knobs): g.replicas for g in new.groups}
    changed = []
    for key in sorted(set(before) | set(after), key=str):
        a, b = before.get(key, 0), after.get(key, 0)
        if a != b:
            (model, group, tp, pp), role, knobs = key
            name = f"tp{tp}{f'pp{pp}' if pp > 1 else ''} {role} b{knobs.max_batched_tokens} s{knobs.max_seqs} on " \
                   f"{planner.cluster.groups[group].device.name}"
            changed.append(f"{name}: {a} -> {b}")
    idle = sum(left.values()) - sum(g.replicas for g in new.groups)
    if idle:
        changed.append(f"{idle} surviving replica(s) left idle")
    return FastReplan(replace(new, workload=plan.workload), seconds, tuple(changed), chosen, cpu)


def _conceded_bucket(planner: Planner, cols: Sequence[int]) -> int | None:
    """The bucket to concede over the configurations ``cols``: of those whose share fits within the attainment
    target's slack (every model's), the one the SLO binds most on them (the least of its capacity without a
    latency bound that the best of them keeps within the SLO; the longer bucket on a tie). None: none fits."""
    slack = (1 - planner.inputs.attainment) * planner.demand.sum()
    share = planner.demand.sum(axis=0)
    within, unbounded = planner.capacity[list(cols)], planner.unbounded(cols)
    best: tuple[float, int] | None = None
    for b in range(len(planner.inputs.buckets)):
        top = unbounded[:, b].max(initial=0.0)
        if not 0 < share[b] < slack or top <= 0:
            continue
        key = (within[:, b].max(initial=0.0) / top, -b)
        if best is None or key < best:
            best = key
    return None if best is None else -best[1]


def _concessions(planner: Planner, rate: float | None, variants: Sequence[tuple[str, list[int], bool, dict]],
                 roles: dict) -> list[tuple[str, list[int], Solution, bool]]:
    """The fast path's candidates with one bucket conceded (:func:`_conceded_bucket`): every one of its requests
    enters missing the SLO (its share of the attainment slack spent on it), at the capacity without a latency
    bound, on replicas that serve nothing else: of each weights shape and role, the configuration of the largest
    batched-token budget takes that bucket alone, the others every other bucket in full. Where the survivors
    serve a long bucket within the SLO in the MILP's capacities but miss it in the simulator (a long prompt's
    prefill near the TTFT bound on the replicas left), holding the rest of the fleet to it, or mixing its long
    prefills into the short requests' batches, costs a third of the goodput; served apart, it is missed at the
    least cost."""
    out: list[tuple[str, list[int], Solution, bool]] = []
    for name, cols, by_role, limits in variants:
        b = _conceded_bucket(planner, cols)
        if b is None:
            continue
        cfg = [planner.configs[k] for k in cols]
        top: dict[tuple, int] = {}
        for c in cfg:
            if c.role != Role.DECODE:
                top[c.shape, c.role] = max(top.get((c.shape, c.role), 0), c.knobs.max_batched_tokens)
        entry = np.array([c.role != Role.DECODE for c in cfg], dtype=bool)
        apart = np.array([c.role != Role.DECODE and c.knobs.max_batched_tokens == top[c.shape, c.role] for c in cfg],
                         dtype=bool)
        problem = planner.problem(cols, rate=rate, limits=limits, by_role=by_role,
                                  misses=float(planner.demand[:, b].sum() / planner.demand.sum()))
        within = np.array(problem.capacity, dtype=float)
        within[entry, b] = 0.0  # no request of the bucket enters within the SLO ...
        within[apart, :] = 0.0  # ... and the replicas taking it take nothing else
        missed = np.zeros_like(within)
        missed[apart, b] = np.asarray(problem.capacity_any, dtype=float)[apart, b]
        try:
            sol = solve_fast(replace(problem, capacity=within, capacity_any=missed), planner.inputs.time_limit_s)
        except PlanError:
            continue
        if sol.rate <= 0 or not sol.counts.any():
            continue
        moved = any(n > roles.get(r, 0) for r, n in _used(planner, cols, sol).items())
        out.append((f"{name}, bucket {planner.inputs.buckets.buckets[b].label} conceded", cols, sol, moved))
    return out


def _used(planner: Planner, cols: Sequence[int], sol: Solution) -> dict[tuple[tuple[int, int, int, int], str], int]:
    """Replicas a solution uses of each (weights shape, role)."""
    used: dict[tuple[tuple[int, int, int, int], str], int] = {}
    for k, n in zip(cols, sol.counts):
        if n > 0:
            key = (planner.configs[k].shape, planner.configs[k].role)
            used[key] = used.get(key, 0) + int(n)
    return used


def _by_milp(found: Sequence[tuple[str, list[int], Solution, bool]], given: bool) -> int:
    """The candidate the MILP's rule keeps: the first (roles kept, every bucket in full), replaced by a later one
    only where that is better beyond MIP_GAP (or, keeping every role, better at all)."""
    pick = 0
    for j in range(1, len(found)):
        margin = MIP_GAP if found[j][3] or "partial" in found[j][0] or "conceded" in found[j][0] else 0.0
        if _better(found[j][2], found[pick][2], given, margin):
            pick = j
    return pick


def _by_simulator(planner: Planner, plan: ServingPlan, found: Sequence[tuple[str, list[int], Solution, bool]],
                  workload_at: Callable[[float], Workload], rate: float | None,
                  first: int) -> tuple[int, RoutingPolicy]:
    """The candidate, and the routing policy inside its buckets' shares, that the simulator finds best on the first
    ``first`` requests (each candidate with the plan's own policy first, then the other: the routing is what
    the fast path may change), in at most :data:`JUDGE_SIMULATIONS` simulations. At a given ``rate``: the
    cheapest meeting the attainment target there. Else each candidate, the highest MILP rate first, is simulated
    at its rate, then those above the highest rate met so far at the lower rungs of :data:`LADDER`; the highest
    rate met wins. Where none meets the target, the one nearest it."""
    target = planner.inputs.attainment

    windows: dict[float, Workload] = {}

    def short(r: float) -> Workload:  # each rate's requests made once for every candidate simulated there
        if r not in windows:
            windows[r] = window(workload_at(r), first=first)
        return windows[r]

    policies = [plan.routing] + [p for p in RoutingPolicy if p != plan.routing]
    tries: list[tuple[tuple[int, RoutingPolicy], ServingPlan]] = []
    seen = set()
    # The same replicas the MILP routed alike (every bucket in full or partial buckets, roles kept or free: shares
    # a few percent apart) are simulated once, at the highest of their rates (at a given rate: the cheapest); a
    # conceded bucket's routing is another.
    order = sorted(range(len(found)), key=lambda j: found[j][2].cost if rate is not None else -found[j][2].rate)
    for j in order:
        for policy in policies:
            p = planner.to_plan(found[j][1], found[j][2], policy)
            key = (p.layout, policy, "conceded" in found[j][0])
            if key not in seen:
                seen.add(key)
                tries.append(((j, policy), p))
    marks: dict[tuple[int, RoutingPolicy], float] = {}  # the attainment of each candidate simulated (at its last rate)

    def nearest() -> tuple[int, RoutingPolicy]:  # none met the target: the one nearest it (the first on a tie)
        return max(marks, key=lambda t: marks[t])

    if rate is not None:  # the cheapest first: the first meeting the target is the answer
        for t, p in tries[:JUDGE_SIMULATIONS]:
            marks[t] = attainment_at(p, short, rate, planner.overhead)[0]
            if marks[t] >= target:
                return t
        return nearest()
    # Each rung of the ladder over every candidate before the next rung: a candidate that meets the target at its
    # own rate spares the lower rungs of those above it that would not reach that rate.
    best, met, runs = None, 0.0, 0
    for share in LADDER:
        for t, p in tries:
            r = found[t[0]][2].rate * share
            if r <= met or runs >= JUDGE_SIMULATIONS:
                break
            marks[t] = attainment_at(p, short, r, planner.overhead)[0]
            runs += 1
            if marks[t] >= target:
                best, met = t, r
    return best if best is not None else nearest()


def _better(a: Solution, b: Solution, rate_given: bool, margin: float) -> bool:
    """Whether ``a`` beats ``b`` by more than ``margin`` (a fraction): cheaper at a given rate, else more rate."""
    if rate_given:
        return a.cost < b.cost * (1 - margin)
    return a.rate > b.rate * (1 + margin)


@dataclass(frozen=True)
class Move:
    """One replica of the transition: ``old`` and ``new`` (indices of replicas in the plans' placement order;
    None: started or stopped), what it loads and moves, and how long that takes."""

    old: int | None
    new: int | None
    what: str  # "kept", "re-roled", "reloaded", "started", "stopped"
    weight_bytes: float
    kv_bytes: float
    seconds: float


@dataclass(frozen=True)
class Transition:
    moves: tuple[Move, ...]
    weight_bytes: float
    kv_bytes: float
    seconds: float  # the replicas load in parallel: the longest of them
    dollars: float  # GPU-hours spent loading, at the plan's prices

    def summary(self) -> str:
        count = {w: sum(1 for m in self.moves if m.what == w) for w in
                 ("kept", "re-roled", "reloaded", "started", "stopped")}
        parts = [f"{n} {w}" for w, n in count.items() if n]
        return (f"{', '.join(parts)}; {self.weight_bytes / 2**30:,.1f} GiB of weights and {self.kv_bytes / 2**30:,.2f} "
                f"GiB of KV moved in {self.seconds:.1f} s, ${self.dollars:.2f} of GPU time")


def _replicas(plan: ServingPlan) -> list[tuple[int, tuple[int, int, int, int], str, int]]:
    """(device group, weights shape, role, devices) of each replica, in the plan's placement order."""
    return [(r.spec.group, (r.spec.tier, r.spec.group, r.spec.tp, r.spec.pp), r.spec.role, r.spec.devices)
            for r in plan.placement().replicas]


def transition(old: ServingPlan, new: ServingPlan, kv_tokens: Sequence[float] | None = None) -> Transition:
    """What moving from ``old`` to ``new`` loads and moves (see the module doc); ``kv_tokens``: the KV tokens each
    old replica holds (in its placement order; a simulation's mean occupancy), 0 where not given."""
    if old.cluster != new.cluster:
        raise PlanError(f"the plans are on different clusters ({old.cluster} and {new.cluster}); a transition moves "
                        "replicas within one")
    cluster = new.mixed_cluster()
    placed_old, placed_new = old.placement().replicas, new.placement().replicas
    a, b = _replicas(old), _replicas(new)
    models_old, models_new = old.model_specs(), new.model_specs()
    held = list(kv_tokens) if kv_tokens is not None else [0.0] * len(a)

    def weights(k: int) -> float:
        _, (m, g, tp, pp), _, devices = b[k]
        return weight_bytes_on_device(models_new[m], tp, pp) * devices

    def load_s(k: int, nbytes: float) -> float:
        dev = cluster.groups[b[k][0]].device
        return nbytes / (dev.pcie_gbps * 1e9 * b[k][3]) if nbytes > 0 else 0.0

    # Rows: old replicas, then one "new devices" row per new replica; columns: new replicas, then one "stop"
    # column per old replica.
    n_old, n_new = len(a), len(b)
    cost = np.full((n_old + n_new, n_new + n_old), _NEVER)
    for i, (g, shape, _, _) in enumerate(a):
        for j, (h, shape_new, _, _) in enumerate(b):
            if g == h and models_old[shape[0]].name == models_new[shape_new[0]].name and shape[2:] == shape_new[2:]:
                cost[i, j] = 0.0
            elif g == h:
                cost[i, j] = weights(j)
        cost[i, n_new + i] = 0.0  # stop it
    for j in range(n_new):
        # load it on devices no old replica held: as many bytes as loading them onto an old replica's devices,
        # which is preferred (the ties go to reuse: an old replica's devices are already the deployment's)
        cost[n_old + j, j] = weights(j) * (1 + 1e-9) + 1.0
        cost[n_old + j, n_new:] = 0.0
    rows, cols = linear_sum_assignment(cost)
    moves = []
    kv_total = 0.0
    for i, j in zip(rows, cols):
        if i < n_old and j < n_new:
            same = cost[i, j] == 0.0
            what = "kept" if same and a[i][2] == b[j][2] else "re-roled" if same else "reloaded"
            nbytes = 0.0 if same else weights(j)
            kv = held[i] * kv_bytes_per_token(models_old[a[i][1][0]]) if a[i][2] != b[j][2] else 0.0
            moves.append(Move(i, j, what, nbytes, kv, load_s(j, nbytes)))
            kv_total += kv
        elif i < n_old:
            kv = held[i] * kv_bytes_per_token(models_old[a[i][1][0]])
            # its requests' KV moves to the nearest replica of the new plan on the same model
            dst = min((k for k in range(n_new) if models_new[b[k][1][0]].name == models_old[a[i][1][0]].name),
                      key=lambda k: (b[k][0] != a[i][0], k), default=None)
            secs = 0.0
            if dst is not None and kv > 0:
                secs = kv_path(placed_old[i].span, Span(placed_new[dst].span.group, placed_new[dst].span.nodes,
                                                        placed_new[dst].span.devices),
                               cluster).seconds(kv)
            moves.append(Move(i, None, "stopped", 0.0, kv, secs))
            kv_total += kv
        elif j < n_new:
            moves.append(Move(None, j, "started", weights(j), 0.0, load_s(j, weights(j))))
    prices = new.prices
    dollars = sum(m.seconds / 3600 * prices.get(cluster.groups[b[m.new][0]].device.name, math.nan) * b[m.new][3]
                  for m in moves if m.new is not None and m.seconds > 0)
    return Transition(tuple(moves), sum(m.weight_bytes for m in moves), kv_total,
                      max((m.seconds for m in moves), default=0.0), dollars)


def held_devices(plan: ServingPlan, lost: Sequence[int] | Mapping[int, int] = ()) -> list[int]:
    """The devices per device group of the cluster that the plan's replica groups hold, but for ``lost`` (as
    :func:`fast_replan` takes it)."""
    out = [0] * len(plan.mixed_cluster().groups)
    for g, n in zip(plan.groups, _left(plan, lost)):
        out[g.group] += n * g.tp * g.pp
    return out
