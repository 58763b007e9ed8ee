"""A cascade of two models on one fleet: its deployment and its escalation chosen together for a quality target.

Cascadia (2506.04203) co-optimises a cascade's deployment and its routing thresholds in two levels: the outer
one picks the thresholds (here: the escalated fraction, and how the end-to-end latency bound is split between
the stages), the inner one the deployment for them (here: the planner's MILP over both models' replicas on
the shared devices and budget, each model's capacities priced at its stage's share of the bound, then the
simulator). The quality curve is the user's (:mod:`.quality`): the least escalated fraction reaching the target
is the one planned, as escalating more only adds the second model's work at a quality the target does not ask
for. A cascade's SLO is end to end (its answer's latency includes every stage) and, optionally, a TPOT bound on
the final stage's tokens.

The comparison the planner reports is with the best single model reaching the target alone (a model whose
own quality, the curve at 0 for the first model and at 1 for the second, meets it), planned by the same
planner on the same devices and budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from flexmesh.data.requests import Workload
from flexmesh.errors import PlanError
from flexmesh.serve.layout.plan import CascadeSpec
from flexmesh.serve.layout.quality import QualityCurve
from flexmesh.serve.layout.slo import SLO
from flexmesh.serve.plan.planner import PlanInputs, PlanResult
from flexmesh.serve.plan.search import _better, plan

# Shares of the end-to-end bound given to the first stage (the outer level's second threshold).
SPLITS = (0.3, 0.5, 0.7)


@dataclass(frozen=True)
class CascadeResult:
    """The best cascade plan, the escalated fraction it carries, and each split of the bound tried."""

    result: PlanResult
    escalated: float
    split: float
    tried: tuple[tuple[float, PlanResult], ...]


def stage_slos(slo: SLO, split: float) -> tuple[SLO, SLO]:
    """The first stage's and the second's SLO: ``split`` of the end-to-end bound and the rest (the TPOT bound
    applies to the second stage's tokens, those the answer is made of)."""
    if slo.e2e_s is None:
        raise PlanError("a cascade's SLO bounds the end-to-end latency (its answer waits for every stage): give "
                        "e2e=TIME (and optionally tpot)")
    if slo.ttft_s is not None:
        raise PlanError("a cascade's first token is its last stage's, after the first model has answered: bound "
                        "e2e (and tpot), not ttft")
    return SLO(e2e_s=split * slo.e2e_s), SLO(tpot_s=slo.tpot_s, e2e_s=(1 - split) * slo.e2e_s)


def plan_cascade(inputs: PlanInputs, quality: QualityCurve, target: float,
                 workload_at: Callable[[float], Workload] | None, splits: Sequence[float] = SPLITS,
                 repair: int = 0, progress: Callable[[str], None] | None = None) -> CascadeResult:
    """The cascade of ``inputs.models`` (two, in order) reaching ``target`` on ``quality``: the least escalated
    fraction that does, the best split of the bound (the simulator's judgement with ``workload_at``, else the
    MILP's)."""
    if len(inputs.models) != 2:
        raise PlanError(f"a cascade is two models in order, got {len(inputs.models)}")
    e = quality.fraction_for(target)
    say = progress or (lambda _: None)
    tried = []
    best: tuple[float, PlanResult] | None = None
    for split in splits:
        say(f"cascade: {e:.1%} escalated, the first stage given {split:.0%} of the end-to-end bound")
        stage = replace(inputs, tiers=(1.0, e), cascade=CascadeSpec(quality, target, e),
                        stage_slos=stage_slos(inputs.slo, split))
        try:
            res = plan(stage, workload_at, repair=repair, progress=progress)
        except PlanError as err:
            say(f"  no plan: {err}")
            continue
        tried.append((split, res))
        if best is None or _cascade_better(res, best[1], inputs.rate, inputs.per_dollar):
            best = (split, res)
    if best is None:
        raise PlanError("no split of the end-to-end bound gives the cascade a plan; relax the SLO or give more "
                        "devices or budget")
    return CascadeResult(best[1], e, best[0], tuple(tried))


def _cascade_better(a: PlanResult, b: PlanResult, target: float | None, per_dollar: bool = False) -> bool:
    if a.score is not None and b.score is not None:
        return _better(a.score, b.score, target, per_dollar)
    pa, pb = a.plan.predicted.get("rate", 0.0), b.plan.predicted.get("rate", 0.0)
    return pa > pb


def single_models(quality: QualityCurve, target: float, models: Sequence[str]) -> list[str]:
    """The models that reach ``target`` alone (the first at the curve's 0, the second at its 1)."""
    alone = [(models[0], quality.at(0.0)), (models[1], quality.at(1.0))]
    return [m for m, q in alone if q >= target]
