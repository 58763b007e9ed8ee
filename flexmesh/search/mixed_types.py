"""Plans of one replica group per device type: the mixed-cluster search's second kind of plan.

Each device type is planned alone by the uniform search (flexmesh.search.best) on its own devices,
at its slowest device's speed, for its share of the global batch; the types' plans are then
combined into one plan of several replica groups, priced by :func:`flexmesh.cost.training.mixed.evaluate_groups`
(flexmesh.search.mixed ranks them beside its pipelines). :class:`TypePlans` keeps every uniform search
it ran, so the ``sum_of_parts`` baseline (each type alone with the whole batch, flexmesh.search.baselines)
reuses them instead of searching again (:meth:`TypePlans.planned_alone`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from flexmesh.cost.training.mixed import MixedCosts, evaluate_groups
from flexmesh.errors import PlanError
from flexmesh.layout.enums import PipelineSchedule
from flexmesh.layout.mesh import group_layout
from flexmesh.layout.plan import Plan
from flexmesh.search.best import best_plans
from flexmesh.search.driver import SearchOutcome, search
from flexmesh.search.space import FULL_SPACE, Candidate, SearchRequest, SearchSpace
from flexmesh.spec.cluster import ClusterSpec, MixedCluster
from flexmesh.spec.model import ModelSpec

# Times the shares of the one-group-per-type plans are moved to equalise their pipelines: the first
# move takes most of the gap (the groups' throughputs alone were measured at the whole batch).
PER_TYPE_ROUNDS = 1


class TypePlans:
    """The one-group-per-type plans of one mixed search (model, cluster, batch), and the uniform
    searches behind them."""

    def __init__(self, model: ModelSpec, cluster: MixedCluster, seq_len: int, global_batch: int, costs: MixedCosts):
        self.model, self.cluster, self.seq_len, self.global_batch = model, cluster, seq_len, global_batch
        self.costs = costs
        self._per_type: dict[tuple[int, int, int | None], Candidate | None] = {}
        self._searches: dict[tuple[int, int, SearchSpace], SearchOutcome | None] = {}
        self._schedule: str | None = None  # the pipeline schedule of the first own plan with a pipeline

    def plans(self, rounds: int = PER_TYPE_ROUNDS) -> list[Plan]:
        """Plans of one replica group per device type, each planned by the uniform search on its own
        devices (ZeRO, context parallelism, interleaving, per-layer strategies inside the group, one
        mesh per group as the runtime runs it) for its share of the batch. Shares start in proportion
        to each type's throughput alone and are moved ``rounds`` times to equalise the groups'
        predicted pipelines (a group's share over its pipeline time), each a multiple of its type's
        data ranks alone (:func:`granular_shares`) so that the search finds its data-parallel layouts
        again. Each type plans freely, and then, in turn, every type keeps its own layout while the
        others take the mesh shape that lets the gradient all-reduce across groups go shard by shard
        (the same tp degree, data ranks and ZeRO kind; flexmesh.cost.training.mixed.gradient_sync). A device
        type that holds no plan of the model is left unused."""
        kinds = range(len(self.cluster.groups))
        alone = [self.alone(k, self.global_batch) for k in kinds]
        used = [k for k in kinds if alone[k] is not None]
        out: list[Plan] = []
        for anchor in [None, *used] if len(used) > 1 else [None]:
            weights = [c.evaluation.tokens_per_s for c in alone if c is not None]
            for _ in range(rounds + 1):
                first = [self.alone(k, self.global_batch, anchor) for k in used]
                granules = [c.plan.group.data_ranks if c is not None else 0 for c in first]
                shares = granular_shares(self.global_batch, weights, granules) if all(granules) else None
                parts = [self.alone(k, b, anchor) for k, b in zip(used, shares or [])]
                plans = [c.plan for c in parts if c is not None]
                if shares is None or len(plans) < len(used):
                    break
                plan = self._combine(used, plans)
                out.append(plan)
                ev = evaluate_groups(plan, self.costs)
                weights = [b / r.pipeline_time for b, r in zip(shares, ev.replicas)]
        return out

    def alone(self, kind: int, batch: int, anchor: int | None = None) -> Candidate | None:
        """The uniform search's best plan of device group ``kind`` alone for ``batch`` sequences (None
        when nothing fits), at its slowest device's speed, one mesh for all layers, one pipeline schedule
        for every group (the first's). With an ``anchor`` type other than ``kind``: the mesh shape that
        makes ``kind``'s blocks shard like the anchor's own plan (its tp, data ranks and ZeRO kind). The
        first type whose plan has a pipeline sets the pipeline schedule of the types after it."""
        key = (kind, batch, anchor if anchor != kind else None)
        if key in self._per_type:
            return self._per_type[key]
        group = self.cluster.groups[kind]
        space = FULL_SPACE
        if self._schedule is not None:
            space = replace(space, pipeline_schedules=(self._schedule,))
        ranks = None  # the anchor's data ranks, which this type's blocks must have too
        if key[2] is not None:
            lead = self.alone(key[2], self.global_batch)
            if lead is None or (group.world_size * lead.plan.pp) % lead.plan.world_size:
                self._per_type[key] = None
                return None
            lay = group_layout(lead.plan.group)
            ranks = lay.data_ranks
            space = replace(space, pp=(group.world_size * lead.plan.pp // lead.plan.world_size,), tp=(lay.tp,),
                            zero_stages=(0,) if lay.replicated else (1, 2, 3), max_cp=ranks)
        best = self._searched(group, batch, space, kind)
        if best is not None and ranks is not None and best.plan.group.data_ranks != ranks:
            best = None
        if best is not None:
            try:
                group_layout(best.plan.group)
            except PlanError:  # layers on different meshes, which a group does not run: search again with one
                best = self._searched(group, batch, replace(space, same_mesh=True), kind)
        if best is not None and self._schedule is None and key[2] is None and best.plan.pp > 1:
            self._schedule = str(best.plan.pipeline_schedule)  # one plan runs one pipeline schedule
        self._per_type[key] = best
        return best

    def _searched(self, group: ClusterSpec, batch: int, space: SearchSpace, kind: int,
                  with_baselines: bool = False) -> Candidate | None:
        request = SearchRequest(self.model, group, self.seq_len, batch, space, self.costs.groups[kind], top=1)
        key = (kind, batch, space)
        if key not in self._searches:  # one search per question, whether or not baselines rank beside it
            try:
                self._searches[key] = search(request)
            except PlanError:
                self._searches[key] = None
        outcome = self._searches[key]
        if outcome is None:
            return None
        try:
            return best_plans(request, with_baselines=with_baselines, explain_no_fit=False, searched=outcome).best
        except PlanError:
            return None

    def planned_alone(self, kind: int) -> Candidate | None:
        """Device group ``kind`` planned alone by the uniform planner (its search, the uniform baselines
        ranked beside it: :func:`~flexmesh.search.best.best_plans`) with the whole batch at its slowest
        device's speed, None when nothing fits: a part of the ``sum_of_parts`` baseline
        (flexmesh.search.baselines). The search is the one :meth:`alone` ran for the type's own plan
        where they ask the same (always for the first type; for the others when it has no pipeline)."""
        return self._searched(self.cluster.groups[kind], self.global_batch, FULL_SPACE, kind, with_baselines=True)

    def _combine(self, kinds: Sequence[int], plans: Sequence[Plan]) -> Plan:
        """The groups' plans as one plan: group ``k`` on device group ``kinds[k]``'s ranks in the rank order."""
        groups = []
        for kind, plan in zip(kinds, plans):
            start = self.cluster.group_start(kind)
            g = plan.group
            groups.append(replace(g, blocks=tuple(tuple(start + r for r in b) for b in g.blocks)))
        used = {r for g in groups for r in g.ranks}
        schedules = {str(p.pipeline_schedule) for p in plans if p.pp > 1}
        sources = "+".join(dict.fromkeys(c.source for c in self.costs.groups))
        return Plan(self.model.name, self.cluster.label, self.cluster.world_size, self.seq_len, self.global_batch,
                    PipelineSchedule(schedules.pop() if schedules else plans[0].pipeline_schedule), tuple(groups),
                    unused=tuple(r for r in range(self.cluster.world_size) if r not in used),
                    cost_source=sources, overlap=plans[0].overlap)


def granular_shares(total: int, weights: Sequence[float], granules: Sequence[int]) -> list[int] | None:
    """``total`` sequences over parts in proportion to ``weights``, part ``i`` a positive multiple of
    ``granules[i]`` (None when no such split adds up): each share rounded to its granule, then the
    sum corrected one granule at a time on the part furthest from its target; where that gets stuck
    (granules that do not divide what is left), part by part the multiple nearest its target that
    leaves a sum the later parts can make (:func:`_reachable`).

    >>> granular_shares(2048, [3.67, 1.28], [256, 128]), granular_shares(10, [1, 1], [4, 4])
    ([1536, 512], None)
    >>> granular_shares(10, [1, 100], [4, 6])  # rounding gives [4, 12], and 2 is no granule
    [4, 6]
    """
    target = [total * w / sum(weights) for w in weights]
    shares = [max(g, round(t / g) * g) for t, g in zip(target, granules)]
    for _ in range(sum(total // g for g in granules) + len(granules)):
        diff = total - sum(shares)
        if diff == 0:
            return shares
        sign = 1 if diff > 0 else -1
        movable = [i for i, g in enumerate(granules) if g <= abs(diff) and shares[i] + sign * g >= g]
        if not movable:
            break
        i = max(movable, key=lambda i: sign * (target[i] - shares[i]))
        shares[i] += sign * granules[i]
    return _nearest_split(total, target, granules)


def _reachable(total: int, granules: Sequence[int]) -> list[np.ndarray]:
    """``out[i][s]``: parts ``i, i+1, ...`` can make ``s`` sequences as positive multiples of their
    granules (``out[len]`` makes only 0)."""
    out = [np.zeros(total + 1, dtype=bool)]
    out[0][0] = True
    for g in reversed(granules):
        prev, cur = out[0], np.zeros(total + 1, dtype=bool)
        for k in range(1, total // g + 1):
            cur[k * g:] |= prev[:total + 1 - k * g]
        out.insert(0, cur)
    return out


def _nearest_split(total: int, target: Sequence[float], granules: Sequence[int]) -> list[int] | None:
    """Part by part, the multiple of its granule nearest its target that leaves a sum the later parts
    can make; None when the parts cannot make ``total`` at all."""
    reach = _reachable(total, granules)
    if not reach[0][total]:
        return None
    shares, left = [], total
    for i, g in enumerate(granules):
        options = [k * g for k in range(1, left // g + 1) if reach[i + 1][left - k * g]]
        share = min(options, key=lambda x: (abs(x - target[i]), x))
        shares.append(share)
        left -= share
    return shares
