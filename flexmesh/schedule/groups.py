"""Step schedules of a plan of several replica groups: each step's sequences dispatched over the groups,
then packed inside each group by the usual policies (Hydraulis's two stages, 2412.07894).

A :class:`GroupsContext` holds one :class:`~flexmesh.schedule.context.ScheduleContext` per replica
group (its device type's cost model, its data ranks, pipeline, strategy, micro-batch budget and
memory), and the groups' planned shares. Data ranks are numbered group by group in plan order, so a
step schedule's group ``(r,)`` of a plan of one-pipeline groups is replica group ``r``.

- ``shares`` (:func:`shares_schedule`): group ``g`` takes the next ``share_g`` sequences in order, in
  ``m_g`` micro-batches of equal sequence counts dealt round-robin over its data ranks: what the plan
  was priced with, blind to lengths (the runtime's schedule before per-step dispatch).
- any per-group policy ``P`` (:func:`dispatched_schedule`): stage 1 (:func:`dispatch_sequences`, by the
  one dispatch of :mod:`flexmesh.schedule.dispatch`) gives each sequence, costliest first, to the
  group whose finish grows least: its accumulated load plus the
  pipeline's fill, ``(pp - 1)`` times its longest micro-batch, each priced by that group's own cost
  model and speed (:meth:`ScheduleContext.seq_load` on the fewest ranks whose memory holds the
  sequence, spread over the group's data ranks), and only on groups whose memory holds it; stage 2
  runs ``P`` on each group's sequences with that group's context, and the group schedules are merged
  (sequence ids and data ranks renumbered). Every group keeps at least one sequence while the batch
  has as many (the runtime steps every group).

:func:`groups_lower_bound`: no schedule of the batch beats it. A sequence ``i`` placed on group ``g``
keeps its ranks busy for at least ``w_gi`` rank-seconds (:meth:`ScheduleContext.seq_work` on the
fewest ranks that hold it there, at the group's speed), and a group of ``R_g`` data ranks delivers
``R_g T`` in a step of ``T``: the fluid relaxation ``min T`` s.t. every sequence is split over the
groups that hold it and ``sum_i x_gi w_gi <= R_g T`` is a linear program (SciPy's HiGHS). A sequence
is never faster than on the group where it runs fastest alone (its packing floor), and the step
never shorter than that.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.cost import CostModel
from flexmesh.cost.training.mixed import MixedCosts, evaluate_groups
from flexmesh.errors import ScheduleError
from flexmesh.layout.enums import CPKind
from flexmesh.layout.mesh import context_kind, group_layout, layout_in_lockstep, rank_place
from flexmesh.layout.overlap import Overlap
from flexmesh.layout.plan import Plan, ReplicaGroup
from flexmesh.layout.step import Group, Piece, StepSchedule, carries_pieces
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.dispatch import dispatch, members
from flexmesh.schedule.lower_bound import min_groups
from flexmesh.schedule.placement import check_lengths
from flexmesh.schedule.registry import make_schedule
from flexmesh.spec.model import ModelSpec

SHARES = "shares"  # the policy of fixed shares; any other name is a per-group policy behind a dispatch


@dataclass(frozen=True)
class GroupsContext:
    """One scheduling context per replica group (plan order; each context's ``speed`` holds its data
    ranks' speed factors), the groups' planned shares and micro-batch counts, and the seconds the
    gradient all-reduce across groups adds to a step (exposed, priced by flexmesh.cost.training.mixed)."""

    contexts: tuple[ScheduleContext, ...]
    shares: tuple[int, ...]
    microbatches: tuple[int, ...]
    cross_sync_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.contexts or len(self.shares) != len(self.contexts) or len(self.microbatches) != len(self.contexts):
            raise ScheduleError("a plan of replica groups needs one context, share and micro-batch count per group")

    @property
    def offsets(self) -> tuple[int, ...]:
        """The first data rank of each group."""
        out, at = [], 0
        for c in self.contexts:
            out.append(at)
            at += c.num_ranks
        return tuple(out)

    @property
    def num_ranks(self) -> int:
        return sum(c.num_ranks for c in self.contexts)

    @property
    def speed(self) -> tuple[float, ...]:
        """Every data rank's speed factor, group by group (empty: all nominal)."""
        if not any(c.speed for c in self.contexts):
            return ()
        return tuple(x for c in self.contexts for x in (c.speed or (1.0,) * c.num_ranks))

    def with_speed(self, speed: Sequence[float]) -> GroupsContext:
        """These contexts at ``speed``, one factor per data rank (group by group; empty: nominal)."""
        if speed and len(speed) != self.num_ranks:
            raise ScheduleError(f"{len(speed)} speed factors for {self.num_ranks} data ranks")
        contexts = []
        for c, first in zip(self.contexts, self.offsets):
            own = tuple(float(x) for x in speed[first:first + c.num_ranks]) if speed else ()
            contexts.append(replace(c, speed=() if all(x == 1.0 for x in own) else own, _cache={}))
        return replace(self, contexts=tuple(contexts))


def _capacity(ctx: ScheduleContext) -> float:
    """Rank-seconds of nominal work a group's data ranks deliver per second: the sum of their speeds,
    or all at the slowest one's where collectives pair their micro-batches (lockstep)."""
    if not ctx.speed:
        return float(ctx.num_ranks)
    return ctx.num_ranks * min(ctx.speed) if ctx.lockstep else float(sum(ctx.speed))


def shares_schedule(lengths: ArrayLike, gctx: GroupsContext) -> StepSchedule:
    """Fixed shares: group ``g`` takes the next ``share_g`` sequences in order (module doc).

    >>> from flexmesh.schedule.testing import tiny_context
    >>> g = GroupsContext((tiny_context(num_ranks=1, model="tiny"),) * 2, (2, 1), (2, 1))
    >>> s = shares_schedule([5, 6, 7], g)
    >>> [[[x.seq_id for x in mb] for mb in grp.microbatches] for grp in s.groups]
    [[[0], [1]], [[2]]]
    """
    return split_shares(lengths, gctx.shares, gctx.microbatches, tuple(c.num_ranks for c in gctx.contexts))


def split_shares(lengths: ArrayLike, shares: Sequence[int], microbatches: Sequence[int],
                 ranks: Sequence[int]) -> StepSchedule:
    """:func:`shares_schedule` from the groups' shares, micro-batch counts and data-rank counts alone
    (what the runtime needs when no cost model prices the plan)."""
    t0 = time.perf_counter()
    lens = [int(n) for n in np.asarray(lengths).reshape(-1)]
    if len(lens) != sum(shares):
        raise ScheduleError(f"the step has {len(lens)} documents but the plan's replica groups take "
                            f"{sum(shares)}; run with the plan's global batch")
    groups, pos, first = [], 0, 0
    for share, m, num_ranks in zip(shares, microbatches, ranks):
        size = share // m
        mbs = [tuple(Piece(pos + k * size + j, 0, lens[pos + k * size + j]) for j in range(size)) for k in range(m)]
        for r in range(num_ranks):  # micro-batch k to data rank k mod R
            groups.append(Group(ranks=(first + r,), microbatches=tuple(mbs[r::num_ranks])))
        pos += share
        first += num_ranks
    return StepSchedule(lengths=tuple(lens), groups=tuple(groups), policy=SHARES,
                        scheduler_seconds=time.perf_counter() - t0)


def _placement_loads(lens: np.ndarray, ctx: ScheduleContext) -> tuple[np.ndarray, np.ndarray]:
    """(seconds each sequence adds to the group, packed, spread over its data ranks at their speeds;
    seconds alone on its fastest ranks, for the pipeline's fill), inf where the group's memory holds
    it nowhere."""
    loads = np.full(lens.size, np.inf)
    alone = np.full(lens.size, np.inf)
    top = ctx.group_sizes[-1]
    fits = lens <= ctx.max_tokens(top)
    fastest = max(ctx.speed) if ctx.speed else 1.0
    if fits.any():
        need = min_groups(lens[fits], ctx)
        load, times = ctx.by_size("load", lens[fits]), ctx.by_size("time", lens[fits])
        idx = np.flatnonzero(fits)
        for d in np.unique(need):
            sel = need == d
            loads[idx[sel]] = d * load[int(d)][sel] / _capacity(ctx)
            alone[idx[sel]] = times[int(d)][sel] / fastest
    return loads, alone


def dispatch_sequences(lengths: ArrayLike, gctx: GroupsContext) -> list[np.ndarray]:
    """Stage 1: the sequence indices each group takes (module doc), by the one dispatch
    (:func:`flexmesh.schedule.dispatch.dispatch`). Raises ScheduleError for a sequence no group's
    memory holds."""
    lens = check_lengths(lengths)
    priced = [_placement_loads(lens, ctx) for ctx in gctx.contexts]
    loads = np.stack([p[0] for p in priced])
    alone = np.stack([p[1] for p in priced])
    holds = [c.max_tokens(c.group_sizes[-1]) for c in gctx.contexts]
    nowhere = np.flatnonzero(np.isinf(loads).all(axis=0))
    if nowhere.size:
        raise ScheduleError(f"a sequence of {int(lens[nowhere].max())} tokens fits in no replica group (the largest "
                            f"holds {max(holds)}); truncate sequences, enable recomputation, or plan larger groups")
    fills = [c.pp - 1 for c in gctx.contexts]
    # every group keeps a sequence while there are enough (the runtime steps every group)
    assignment = dispatch(loads, lens, holds, fill=fills, alone=alone, keep_every=True)
    return members(assignment, len(gctx.contexts))


def dispatched_schedule(policy: str, lengths: ArrayLike, gctx: GroupsContext, *, seed: int = 0,
                        options: Sequence[dict] | None = None) -> StepSchedule:
    """Stage 1 then ``policy`` inside each group (module doc); ``options`` the policy's keyword options
    per group."""
    t0 = time.perf_counter()
    lens = check_lengths(lengths)
    return _packed_parts(policy, lens, dispatch_sequences(lens, gctx), gctx, t0, seed=seed, options=options)


def packed_shares_schedule(policy: str, lengths: ArrayLike, gctx: GroupsContext, *, seed: int = 0,
                           options: Sequence[dict] | None = None) -> StepSchedule:
    """The plan's fixed shares (group ``g`` the next ``share_g`` sequences, blind to lengths), each
    packed inside its group by ``policy``: fixed shares at their best, the baseline that isolates
    what the dispatch adds."""
    t0 = time.perf_counter()
    lens = check_lengths(lengths)
    if lens.size != sum(gctx.shares):
        raise ScheduleError(f"the step has {lens.size} documents but the plan's replica groups take "
                            f"{sum(gctx.shares)}; run with the plan's global batch")
    ends = np.cumsum(gctx.shares)
    parts = [np.arange(e - n, e, dtype=np.int64) for n, e in zip(gctx.shares, ends)]
    return _packed_parts(policy, lens, parts, gctx, t0, seed=seed, options=options)


def _packed_parts(policy: str, lens: np.ndarray, parts: list[np.ndarray], gctx: GroupsContext, t0: float, *,
                  seed: int, options: Sequence[dict] | None) -> StepSchedule:
    """Stage 2: ``policy`` inside each group on the sequences ``parts[g]``, merged into one schedule."""
    contexts = gctx.contexts
    groups: list[Group] = []
    deferred: list[int] = []
    predicted = 0.0
    for g, (ids, ctx, first) in enumerate(zip(parts, contexts, gctx.offsets)):
        if ids.size == 0:
            groups.extend(Group(ranks=(first + r,), microbatches=()) for r in range(ctx.num_ranks))
            continue
        sub = make_schedule(policy, lens[ids], ctx, seed=seed, **(options[g] if options else {}))
        for grp in sub.groups:
            groups.append(Group(ranks=tuple(first + r for r in grp.ranks), predicted_time=grp.predicted_time,
                                microbatches=tuple(tuple(Piece(int(ids[p.seq_id]), p.start, p.end) for p in mb)
                                                   for mb in grp.microbatches)))
        deferred.extend(int(ids[i]) for i in sub.deferred)
        predicted = max(predicted, sub.predicted_step_time)
    groups.sort(key=lambda grp: grp.ranks[0])
    return StepSchedule(lengths=tuple(int(n) for n in lens), groups=tuple(groups), policy=str(policy),
                        predicted_step_time=predicted, lower_bound=groups_lower_bound(lens, gctx),
                        deferred=tuple(sorted(deferred)), scheduler_seconds=time.perf_counter() - t0,
                        extra={"dispatch": [int(p.size) for p in parts]})


def groups_lower_bound(lengths: ArrayLike, gctx: GroupsContext) -> float:
    """No schedule of the batch over the groups beats this (module doc); seconds of the micro-batch phase."""
    from scipy.optimize import linprog

    lens = check_lengths(lengths)
    k, n = len(gctx.contexts), lens.size
    work = np.full((k, n), np.inf)
    alone = np.full(n, np.inf)
    for g, ctx in enumerate(gctx.contexts):
        fastest = max(ctx.speed) if ctx.speed else 1.0
        fits = lens <= ctx.max_tokens(ctx.group_sizes[-1])
        if not fits.any():
            continue
        idx = np.flatnonzero(fits)
        need = min_groups(lens[fits], ctx)
        table, floor = ctx.by_size("work", lens[fits]), ctx.floor_times(lens[fits])
        for d in np.unique(need):
            sel = need == d
            work[g, idx[sel]] = table[int(d)][sel]
            alone[idx[sel]] = np.minimum(alone[idx[sel]], floor[int(d)][sel] / fastest)
    ranks = np.array([_capacity(c) for c in gctx.contexts], dtype=float)
    allowed = np.isfinite(work)
    # variables: x[g, i] for allowed pairs, then T; minimise T
    pairs = np.argwhere(allowed)
    m = len(pairs)
    c = np.zeros(m + 1)
    c[-1] = 1.0
    a_eq = np.zeros((n, m + 1))
    a_eq[pairs[:, 1], np.arange(m)] = 1.0
    a_ub = np.zeros((k, m + 1))
    a_ub[pairs[:, 0], np.arange(m)] = work[pairs[:, 0], pairs[:, 1]]
    a_ub[:, -1] = -ranks
    res = linprog(c, A_ub=a_ub, b_ub=np.zeros(k), A_eq=a_eq, b_eq=np.ones(n),
                  bounds=[(0, None)] * (m + 1), method="highs")
    fluid = float(res.x[-1]) if res.success else 0.0
    return max(fluid, float(np.max(alone[np.isfinite(alone)], initial=0.0)))


def groups_schedule(policy: str, lengths: ArrayLike, gctx: GroupsContext, *, seed: int = 0,
                    options: Sequence[dict] | None = None) -> StepSchedule:
    """``shares`` (fixed shares), or ``policy`` inside each group after a per-step dispatch."""
    if policy == SHARES:
        return shares_schedule(lengths, gctx)
    return dispatched_schedule(policy, lengths, gctx, seed=seed, options=options)


def group_context(plan: Plan, group: ReplicaGroup, spec: ModelSpec, cost: CostModel) -> ScheduleContext:
    """The per-step scheduler's view of one replica group: its data ranks, pipeline and first layer's
    strategy, priced by ``cost`` under the plan's overlap options (``CostModel.replace(step_overlap=...)``).

    The group size (cp) and data-parallel degree are left to the policy; micro-batches hold at most
    the group's :meth:`~flexmesh.layout.plan.ReplicaGroup.microbatch_tokens` per rank (what the search
    sized and checked against memory; a longer document keeps its own micro-batch). Policies cut
    sequences over micro-batches only where the runtime keeps them exact (``cut_documents``).
    """
    layout = group_layout(group)
    strategy = replace(group.layer_strategies()[0], cp=1, cp_kind=CPKind.NONE, dp=1)
    return ScheduleContext(cost=cost.replace(step_overlap=plan.overlap),
                           base=strategy, num_ranks=layout.data_ranks, pp=group.pp,
                           pipeline_schedule=plan.pipeline_schedule, cp_kind=context_kind(spec, layout),
                           microbatch_tokens=group.microbatch_tokens(plan.seq_len),
                           lockstep=layout_in_lockstep(spec, layout),
                           chunk_layers=tuple(st.num_layers for st in group.stages),
                           cut_documents=carries_pieces(dynamic_rope=spec.rope_scaling is not None
                                                        and spec.rope_scaling.rope_type == "dynamic"))


def stage_cap(group: ReplicaGroup, costs: MixedCosts, overlap: Overlap) -> int:
    """Most tokens one data rank's micro-batch may hold in a pipelined group: the least over its
    stages, each on its own device with its own layers (the first one's strategy), its ends and the
    micro-batches 1F1B keeps in flight there (``pp - p`` on pipeline rank ``p``)."""
    caps = []
    for p, block in enumerate(group.blocks):
        layers = [s for i, chunk in enumerate(group.stages) if i % group.pp == p for s in chunk.strategies]
        first = replace(layers[0], cp=1, cp_kind=CPKind.NONE, dp=group.data_ranks)
        caps.append(costs.of_rank(block[0]).max_tokens(first, layers=len(layers), embed=p == 0,
                                                       head=p == group.pp - 1, in_flight_mbs=group.pp - p,
                                                       overlap=overlap))
    return min(caps)


def groups_context(plan: Plan, spec: ModelSpec, costs: MixedCosts) -> GroupsContext:
    """The scheduling view of ``plan``'s replica groups on the cluster ``costs`` prices.

    Each group's context is :func:`group_context` priced by the cost model
    of its slowest device type (a pipeline whose stages sit on two types runs at its slower stages'
    pace), a pipeline's memory stage by stage (:func:`stage_cap`); each data rank runs at its slowest
    device's speed factor (its pipeline stages and tensor-parallel ranks wait for one another).
    """
    contexts = []
    for g in plan.groups:
        device_groups = {costs.group_of[r] for r in g.ranks}
        slowest = min(device_groups, key=lambda k: costs.groups[k].cluster.device.peak_flops(spec.dtype))
        ctx = group_context(plan, g, spec, costs.on(g.ranks) if len(device_groups) == 1 else costs.groups[slowest])
        contexts.append(replace(ctx, token_cap=stage_cap(g, costs, plan.overlap)) if g.pp > 1 else ctx)
    speed = [1.0] * sum(c.num_ranks for c in contexts)
    for rank in range(plan.world_size):
        place = rank_place(plan, rank)
        if place is not None:
            speed[place.data_rank] = min(speed[place.data_rank], costs.speeds[rank])
    cross = 0.0
    if len(plan.groups) > 1:
        ev = evaluate_groups(plan, costs)
        cross = max(st.exposed_sync for r in ev.replicas for st in r.stages)
    gctx = GroupsContext(tuple(contexts), tuple(g.share for g in plan.groups),
                         tuple(g.num_microbatches for g in plan.groups), cross)
    return gctx.with_speed(speed)
