"""The planner: configurations priced per bucket, the MILP's plans, the simulator's judgement, local repairs.

1. **Configurations and capacities** (:mod:`.capacity`): every model on every device group at every tp
   (pp where a node's tp is reached) in every role, its capacity per bucket at the SLO. A bucket no
   configuration serves within the SLO is served without it (its requests count as misses), if its share
   leaves the attainment target reachable.
2. **The MILP** (:mod:`.milp`) in three variants: every role, aggregated replicas only, prefill/decode
   only. Each answer becomes a plan (:meth:`.planner.Planner.to_plan`): groups of replicas, each bucket's shares.
3. **The simulator** scores the distinct candidates on the workload (:func:`.score.score`, goodput by
   bisection), then the MILP is calibrated against it (each device type's own plan simulated: what it serves of
   its prediction scales that type's capacities; split replicas against aggregated ones likewise) and solved
   again, each device type's own plan too; the best candidate is kept: the most goodput within the budget (with
   ``PlanInputs.per_dollar``, the most goodput per $/h within it), or the cheapest meeting the rate. Every plan a
   best-single-type or Mélange-style baseline takes (a device type's own MILP plan, the aggregated MILP's, before
   and after calibration) is among the candidates, so the plan kept is never below them by its objective.
   A planner that splits prefill and decode where it loses in the simulator would be wrong: the aggregated
   candidates are always among those scored. With a target rate, a plan the simulator finds short of it is
   planned again at the rate scaled by what it fell short (up to :data:`CALIBRATIONS` times).
4. **Repair by local moves** (ThunderServe's tabu search, 2502.09334): a replica changes role, splits in
   two of half the tp or two merge, or moves to another device group; the routing of each neighbour is
   the MILP's with its counts fixed (a linear program). The neighbours of the highest predicted rate are
   simulated at a probe rate just above the best goodput so far (per $/h: above the best goodput per $/h at the
   neighbour's price); the best one not visited before is taken,
   and the best plan seen is returned.

The planner's own time (steps 1 and 2) is what ``bench/serve_plan.py`` holds to its targets; steps 3 and 4
are the simulator's and grow with the workload's length.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from flexmesh.data.requests import Workload
from flexmesh.errors import PlanError
from flexmesh.serve.layout.roles import Role
from flexmesh.serve.layout.routing import RoutingPolicy
from flexmesh.serve.plan.planner import PlanCandidate, PlanInputs, Planner, PlanResult
from flexmesh.serve.plan.score import Score, attainment_at, score

# Times a plan short of a target rate is planned again, its rate scaled by what it fell short.
CALIBRATIONS = 3
# Repair: rounds of moves, neighbours simulated per round, and the probe above the best goodput.
REPAIR_ROUNDS = 4
REPAIR_TRIES = 3
PROBE = 1.06
# The MILP variants whose plans the simulator compares: every role, aggregated replicas only, prefill/decode only.
VARIANTS = {"mixed": tuple(Role), "aggregated": (Role.AGGREGATED,), "disaggregated": (Role.PREFILL, Role.DECODE)}
# Without a device type's own plan to calibrate by, split replicas are calibrated apart from aggregated ones
# when the simulator finds their predictions off by more than this against each other.
CALIBRATION_SPREAD = 0.03


# ---- the whole search ----------------------------------------------------------------------------------
def candidates(planner: Planner, variants: dict[str, tuple[Role, ...]] = VARIANTS,
               rate: float | None = None) -> list[PlanCandidate]:
    """The MILP's plan for each variant of roles (those that have one), identical layouts once."""
    i = planner.inputs
    out: list[PlanCandidate] = []
    seen = set()
    why: list[str] = []  # each variant's reason for having no plan, the first (every role) the most telling
    for name, roles in variants.items():
        cols = planner.columns(roles)
        if not cols:
            continue
        try:
            s = planner.solve(cols, budget=i.budget, rate=rate if rate is not None else i.rate)
        except PlanError as e:
            why.append(str(e))
            continue
        if s.rate <= 0 or not s.counts.any():
            continue
        plan = planner.to_plan(cols, s)
        if plan.layout in seen:
            continue
        seen.add(plan.layout)
        out.append(PlanCandidate(name, plan, s))
    if not out:
        raise PlanError(why[0] if why else "no plan serves the workload within the SLO, the devices and the budget; "
                        "give more devices or budget, a lower rate, or relax the SLO")
    return out


def _better(a: Score, b: Score | None, target: float | None, per_dollar: bool = False) -> bool:
    """Whether score ``a`` beats ``b``: with a target rate, meeting it and then the cheaper; else the more
    goodput, then the cheaper (``per_dollar``: the more goodput per $/h, then the more goodput)."""
    if b is None:
        return True
    if target is not None:
        ma, mb = a.goodput >= target, b.goodput >= target
        if ma != mb:
            return ma
        if ma:
            return a.dollars_per_hour < b.dollars_per_hour - 1e-9
        return a.goodput > b.goodput
    if per_dollar and not math.isclose(a.per_dollar, b.per_dollar, rel_tol=1e-9):
        return a.per_dollar > b.per_dollar
    if not math.isclose(a.goodput, b.goodput, rel_tol=1e-9):
        return a.goodput > b.goodput
    return a.dollars_per_hour < b.dollars_per_hour - 1e-9


def best_of(scored: Sequence[PlanCandidate], target: float | None, per_dollar: bool = False) -> PlanCandidate:
    """The best of the scored candidates (:func:`_better`; the first of equals)."""
    best = scored[0]
    for c in scored[1:]:
        assert c.score is not None
        if _better(c.score, best.score, target, per_dollar):
            best = c
    return best


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
    if workload_at is None:  # the MILP's prediction: the most goodput (per $/h), then the cheapest
        per_dollar = inputs.per_dollar and inputs.rate is None

        def predicted(c: PlanCandidate) -> tuple[float, float]:
            rate, cost = (c.solution.rate, c.solution.cost) if c.solution else (0.0, 0.0)
            return (rate / cost if per_dollar and cost > 0 else rate), -cost

        best = max(cands, key=predicted)
        return PlanResult(best.plan, None, tuple(cands), (), plan_s, 0.0, len(planner.configs), tuple(notes),
                          planner)
    t1 = time.perf_counter()
    target = inputs.rate
    scored: list[PlanCandidate] = []
    for c in cands:
        say(f"simulating the {c.name} candidate: {c.plan.layout}")
        scored += routed(c, workload_at, planner, target)
    more, calibrated = _calibration(planner, scored, workload_at, say)
    scored += more
    if target is not None:
        scored += _calibrated(calibrated, scored, workload_at, say)
    best = best_of(scored, target, inputs.per_dollar)
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


def routed(c: PlanCandidate, workload_at: Callable[[float], Workload], planner: Planner,
           target: float | None, known: dict[tuple, Score] | None = None) -> list[PlanCandidate]:
    """``c`` scored with each routing policy inside its buckets' shares (in proportion, or by least work): the
    better first, under ``c``'s name, the other named for its policy. The routing is part of the plan: a split
    plan whose MILP shares are off (its prefill replicas' speeds against each other, its decode replicas') serves
    a third more when each request goes to the replica whose work would finish first, and an aggregated one can
    serve less so, so neither policy is taken on trust for any candidate. ``known``: scores already simulated, by
    (replica groups, routing), reused (and added to)."""
    out = []
    scores = []
    start = c.solution.rate if c.solution is not None else target or 1.0
    memo: dict[tuple, Score] = {} if known is None else known
    for policy in RoutingPolicy:
        p = replace(c.plan, routing=policy)
        s = memo.get((p.groups, policy))
        if s is None:
            s = memo[p.groups, policy] = score(p, workload_at, start, planner.overhead)
        start = s.goodput or start
        scores.append(s)
        out.append(PlanCandidate(c.name, p, c.solution, s))
    if _better(scores[1], scores[0], target):
        out.reverse()
    return [out[0], replace(out[1], name=f"{c.name}, {out[1].plan.routing} routing")]


def _latency(s: Score) -> dict:
    at = s.at(s.goodput) if s.goodput > 0 else None
    if at is None:
        return {}
    return {"attainment": round(at.attainment or 0.0, 4), "ttft_p90_s": round(at.ttft["p90"], 6),
            "tpot_p90_s": round(at.tpot["p90"], 6)}


def _calibration(planner: Planner, scored: list[PlanCandidate], workload_at: Callable[[float], Workload],
                 say: Callable[[str], None]) -> tuple[list[PlanCandidate], Planner]:
    """The MILP calibrated against the simulator. Each device type's aggregated plan alone is simulated (itself a
    candidate): what the simulator serves of its prediction scales that type's capacities; what it serves of the
    split-only plan's against the aggregated-only one's scales prefill and decode replicas more. The mixed and
    aggregated MILPs solved again so are candidates too: the MILP then weighs device types and roles as the
    simulator does. The new candidates, and the planner calibrated so."""
    target = planner.inputs.rate

    def served(c: PlanCandidate) -> float | None:
        if c.score is None or c.solution is None or c.score.goodput <= 0:
            return None
        pred = target if target is not None else c.solution.rate
        return c.score.goodput / pred if pred > 0 else None

    out: list[PlanCandidate] = []
    by_group: dict[int, float] = {}
    seen = {c.plan.layout for c in scored}
    known = {(c.plan.groups, c.plan.routing): c.score for c in scored if c.score is not None}
    for g in range(len(planner.cluster.groups)):
        one = own_plan(planner, g)
        if one is None:
            continue
        say(f"simulating the {one.name} candidate: {one.plan.layout}")
        both = routed(one, workload_at, planner, target, known)
        ratio = served(both[0])
        if ratio is not None:
            by_group[g] = ratio
        if one.plan.layout not in seen:
            out += both
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
    for name, roles in VARIANTS.items():
        try:
            again = candidates(calibrated, {name: roles})[0]
        except PlanError:
            continue
        if again.plan.layout in seen:
            continue
        seen.add(again.plan.layout)
        out += routed(replace(again, name=f"{name}, calibrated"), workload_at, planner, target, known)
    # Each device type's own plan again: the calibrated MILP's (a best-single-type baseline's) is one the planner
    # could have produced, so it is scored too (nearly always the same plan as before: no simulation then).
    for g in range(len(planner.cluster.groups)):
        one = own_plan(calibrated, g)
        if one is not None and (one.plan.groups, RoutingPolicy.WEIGHTS) not in known:  # not scored yet
            out += routed(replace(one, name=f"calibrated {one.name}"), workload_at, planner, target, known)
    return out, calibrated


def own_plan(planner: Planner, g: int) -> PlanCandidate | None:
    """Device group ``g``'s aggregated replicas alone, as the MILP plans them (None where they serve nothing)."""
    return planner.candidate(f"{planner.cluster.groups[g].device.name} only",
                             planner.columns((Role.AGGREGATED,), groups=[g]))


def _calibrated(planner: Planner, scored: list[PlanCandidate], workload_at: Callable[[float], Workload],
                say: Callable[[str], None]) -> list[PlanCandidate]:
    """The MILP's plans (the calibrated ones where there are, else each variant's) planned again, when the
    simulator found them short of the target rate, at the rate scaled by what they fell short."""
    target = planner.inputs.rate
    assert target is not None
    calibrated = [c for c in scored if c.name.endswith(", calibrated")]
    out: list[PlanCandidate] = []
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
        knob = f"s{c.knobs.max_seqs}" if c.role == Role.DECODE else f"b{c.knobs.max_batched_tokens}"
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
        for role in Role:
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


def _repair(planner: Planner, best: PlanCandidate, workload_at: Callable[[float], Workload], rounds: int,
            say: Callable[[str], None]) -> tuple[PlanCandidate, list[str]]:
    """Tabu search over local moves, judged by the simulator (see the module doc)."""
    assert best.score is not None
    target, per_dollar = planner.inputs.rate, planner.inputs.per_dollar and planner.inputs.rate is None
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
            else:  # the most goodput (per $/h) first
                rank = s.rate / planner.cost(counts) if per_dollar else s.rate
            options.append((rank, label, counts, p, s))
        if not options:
            break
        options.sort(key=lambda o: -o[0])
        tried = []
        for _, label, counts, p, s in options[:REPAIR_TRIES]:
            visited.add(tuple(sorted(counts.items())))
            # the rate a neighbour must serve to beat the best: its goodput, or its goodput per $/h at its price
            probe = target if target is not None else PROBE * max(
                best.score.per_dollar * planner.cost(counts) if per_dollar else best.score.goodput, 1e-3)
            a, _ = attainment_at(p, workload_at, probe, planner.overhead)
            tried.append((a, -planner.cost(counts), label, counts, p, s, probe))
        tried.sort(key=lambda t: (t[0], t[1]), reverse=True)
        a, _, label, counts, p, s, probe = tried[0]
        current = counts
        if a >= planner.inputs.attainment:
            sc = score(p, workload_at, probe, planner.overhead)
            if _better(sc, best.score, target, per_dollar):
                best = PlanCandidate(f"{best.name.split(' +')[0]} + repair", p, s, sc)
                log.append(f"round {r + 1}: {label}: goodput {sc.goodput:.4g} req/s at ${sc.dollars_per_hour:.2f}/h")
                say(log[-1])
                continue
        log.append(f"round {r + 1}: {label}: no better ({a:.1%} of requests met the SLO at {probe:.4g} req/s)")
        say(log[-1])
    return best, log
