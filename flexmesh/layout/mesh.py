"""The rank order, in one place: mesh axes, parallel coordinates, global and data ranks.

A world of ``pp x dp x cp x tp`` ranks is laid out with ``tp`` innermost (a tensor-parallel group
shares a node), then ``cp``, then ``dp``, then ``pp`` (:data:`MESH_AXES`, outermost first). A *data
rank* merges the ``dp`` and ``cp`` coordinates, ``dp_index * cp + cp_index``: the axis per-step
schedules assign work over (flexmesh.layout.step). :func:`rank_coords`, :func:`global_rank` and
:func:`data_rank` are the only places that order is written down; the runtime's device mesh
(flexmesh.runtime.parallel.parallelize.build_mesh) is built with the same axes.

:class:`Layout` is a Plan reduced to what the runtime builds: one (tp, cp, dp) mesh per stage plus
what may differ per layer; :func:`layout_from_plan` rejects mixes the runtime cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from flexmesh.errors import PlanError, ScheduleError
from flexmesh.layout.enums import CPKind, MeshAxis, PipelineSchedule
from flexmesh.layout.overlap import FASTEST
from flexmesh.layout.plan import Plan, ReplicaGroup, StagePlan
from flexmesh.layout.step import Group, StepSchedule
from flexmesh.layout.strategy import LayerStrategy, Recompute
from flexmesh.spec.model import ModelSpec

MESH_AXES: tuple[str, ...] = tuple(a.value for a in MeshAxis)  # ("pp", "dp", "cp", "tp"), outermost first


def rank_coords(rank: int, pp: int, dp: int, cp: int, tp: int) -> dict[str, int]:
    """Parallel coordinates of a global rank; tp is innermost so a tp group shares a node.

    For world 8 with pp 2, dp 2, cp 1, tp 2:

    ====  ==  ==  ==  ==
    rank  pp  dp  cp  tp
    ====  ==  ==  ==  ==
    0     0   0   0   0
    1     0   0   0   1
    2     0   1   0   0
    3     0   1   0   1
    4     1   0   0   0
    5     1   0   0   1
    6     1   1   0   0
    7     1   1   0   1
    ====  ==  ==  ==  ==
    """
    if not 0 <= rank < pp * dp * cp * tp:
        raise PlanError(f"rank {rank} outside a world of {pp * dp * cp * tp}")
    tp_i = rank % tp
    cp_i = rank // tp % cp
    dp_i = rank // (tp * cp) % dp
    pp_i = rank // (tp * cp * dp)
    return {MeshAxis.PP: pp_i, MeshAxis.DP: dp_i, MeshAxis.CP: cp_i, MeshAxis.TP: tp_i}


@dataclass(frozen=True)
class Layout:
    """The mesh a plan runs on plus what may differ per layer (global layer index order).

    >>> from flexmesh.layout.plan import Plan, StagePlan
    >>> from flexmesh.layout.strategy import LayerStrategy as S
    >>> st = StagePlan(0, 2, (S.parse("tp2-dp2z3"), S.parse("tp2-dp2z3-ac")))
    >>> plan = Plan.uniform("tiny", "4xA100-80GB", 4, 1, "1f1b", 1, 64, 2, (st,))
    >>> lay = layout_from_plan(plan)
    >>> (lay.pp, lay.dp, lay.cp, lay.tp, lay.zero, tuple(map(str, lay.recompute)))
    (1, 2, 1, 2, (3, 3), ('none', 'full'))
    """

    pp: int
    dp: int
    cp: int
    cp_kind: CPKind
    tp: int
    zero: tuple[int, ...]
    recompute: tuple[Recompute, ...]  # none / selective / full per layer

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def data_ranks(self) -> int:
        """Ranks holding the same weights: data parallel x context parallel (ZeRO shards over these)."""
        return self.dp * self.cp

    @property
    def replicated(self) -> bool:
        return self.data_ranks > 1 and all(z == 0 for z in self.zero)

    @property
    def sharded(self) -> bool:
        return self.data_ranks > 1 and not self.replicated


def _runs(indices: list[int]) -> str:
    """Layer indices as compact ranges, e.g. [0, 1, 2, 5] -> '0-2, 5'."""
    out: list[str] = []
    for i in indices:
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def layout_from_plan(plan: Plan) -> Layout:
    """The Layout of a plan of one replica group (:func:`group_layout` of :attr:`Plan.group`)."""
    return group_layout(plan.group)


def group_layout(group: ReplicaGroup) -> Layout:
    """Check a replica group's per-layer mix is one the runtime supports and return its Layout."""
    strategies: list[LayerStrategy] = group.layer_strategies()
    if not strategies:
        raise PlanError("plan has no layers; give every stage at least one layer")
    first = strategies[0]
    other = [i for i, s in enumerate(strategies) if not s.same_mesh(first)]
    if other:
        s = strategies[other[0]]
        raise PlanError(
            f"layers {_runs(other)} use tp{s.tp}/{s.cp_kind}{s.cp}/dp{s.dp} but layer 0 uses "
            f"tp{first.tp}/{first.cp_kind}{first.cp}/dp{first.dp}; the runtime needs one (tp, cp, dp) "
            "mesh for a whole replica group: give its layers the same tp, context degree and kind, and dp "
            "(replica groups may differ)"
        )
    sizes = {len(b) for b in group.blocks}
    if sizes != {first.devices}:
        raise PlanError(
            f"layers use tp x cp x dp = {first.devices} devices but the pipeline stages have "
            f"{'/'.join(map(str, sorted(sizes)))}; give every stage of a replica group tp x cp x dp devices"
        )
    zeros = [s.zero for s in strategies]
    plain = [i for i, z in enumerate(zeros) if z == 0]
    if plain and len(plain) != len(zeros):
        sharded = [i for i, z in enumerate(zeros) if z != 0]
        raise PlanError(
            f"layers {_runs(plain)} use ZeRO 0 (replicated) while layers {_runs(sharded)} use ZeRO 1-3; "
            "the runtime replicates all layers or shards all layers: set every layer's zero to 0, or every "
            "layer's to 1, 2 or 3"
        )
    return Layout(pp=group.pp, dp=first.dp, cp=first.cp, cp_kind=first.cp_kind, tp=first.tp,
                  zero=tuple(zeros), recompute=tuple(s.recompute_kind for s in strategies))


@dataclass(frozen=True)
class Place:
    """Where a global rank runs: its replica group, its coordinates inside the group's layout (block
    ``pp`` of the group, index ``(dp * cp_degree + cp) * tp_degree + tp`` in the block) and its data
    rank in the plan's numbering (the groups' data ranks one after another, in plan order)."""

    group: int
    pp: int
    dp: int
    cp: int
    tp: int
    data_rank: int


def data_rank_offsets(plan: Plan) -> tuple[int, ...]:
    """The first data rank of each replica group: data ranks are numbered group by group.

    >>> st = (StagePlan(0, 2, (LayerStrategy.parse("tp1-dp2z0"),) * 2),)
    >>> one = (StagePlan(0, 2, (LayerStrategy(),) * 2),)
    >>> p = Plan("tiny", "cpu", 3, 64, 3, "1f1b", (ReplicaGroup(((0, 1),), st, 1, 2), ReplicaGroup(((2,),), one, 1, 1)))
    >>> data_rank_offsets(p), [rank_place(p, r).data_rank for r in range(3)]
    ((0, 2), [0, 1, 2])
    """
    out, at = [], 0
    for g in plan.groups:
        out.append(at)
        at += g.data_ranks
    return tuple(out)


def rank_place(plan: Plan, rank: int) -> Place | None:
    """Where ``rank`` runs in ``plan`` (None: an unused device). For a plan of one group in the rank
    order this is :func:`rank_coords` with the data rank of :func:`data_rank`."""
    offsets = data_rank_offsets(plan)
    for i, g in enumerate(plan.groups):
        for p, block in enumerate(g.blocks):
            if rank in block:
                s = g.layer_strategies()[0]
                c = rank_coords(block.index(rank), 1, s.dp, s.cp, s.tp)
                return Place(i, p, c[MeshAxis.DP], c[MeshAxis.CP], c[MeshAxis.TP],
                             offsets[i] + c[MeshAxis.DP] * s.cp + c[MeshAxis.CP])
    return None


def data_rank_of_ranks(plan: Plan) -> tuple[int | None, ...]:
    """The data rank of every global rank (None for unused devices), in rank order."""
    places = [rank_place(plan, r) for r in range(plan.world_size)]
    return tuple(None if p is None else p.data_rank for p in places)


def aligned_blocks(data_ranks: int) -> list[tuple[int, int]]:
    """``(start, size)`` of every aligned power-of-two run of at least 2 of ``data_ranks`` data ranks.

    A run of ``size`` ranks starts at a multiple of ``size`` (what
    flexmesh.schedule.assemble.aligned_layout produces), so there are ``data_ranks / size`` of each size.

    >>> aligned_blocks(4)
    [(0, 2), (2, 2), (0, 4)]
    >>> aligned_blocks(6)
    [(0, 2), (2, 2), (4, 2), (0, 4)]
    """
    out, size = [], 2
    while size <= data_ranks:
        out += [(start, size) for start in range(0, data_ranks - size + 1, size)]
        size *= 2
    return out


def global_rank(layout: Layout, pp_index: int, data_rank: int, tp_index: int) -> int:
    """Global rank of data rank ``d`` (``dp_index * cp + cp_index``) at tp index ``t`` on stage ``p``.

    ``(p * data_ranks + d) * tp + t``, the order of :data:`MESH_AXES` and :func:`rank_coords`.
    With pp 2, dp 2, cp 1, tp 2: data rank 1 at tp index 0 on stage 1 is rank ``(1 * 2 + 1) * 2 + 0 = 6``.

    >>> lay = Layout(pp=2, dp=2, cp=1, cp_kind="none", tp=2, zero=(0,), recompute=(False,))
    >>> global_rank(lay, 1, 1, 0)
    6
    """
    return (pp_index * layout.data_ranks + data_rank) * layout.tp + tp_index


def context_kind(spec: ModelSpec, layout: Layout) -> CPKind:
    """The context-parallel kind a run uses for every group it forms.

    The plan's kind when the plan itself uses cp > 1; otherwise Ulysses when the query and key/value
    heads per tensor-parallel rank split evenly over the largest group the data ranks allow (Ulysses
    moves heads, one all-to-all each way), else ring attention (which needs no head count).

    >>> from flexmesh.spec.model import ModelSpec
    >>> spec = ModelSpec(name="t", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, ffn_hidden=128, vocab=256)
    >>> lay = Layout(pp=1, dp=2, cp=1, cp_kind="none", tp=1, zero=(2, 2), recompute=(False, False))
    >>> str(context_kind(spec, lay)), str(context_kind(spec, Layout(1, 4, 1, "none", 1, (2, 2), (False, False))))
    ('ulysses', 'ring')
    """
    if layout.cp > 1:
        return CPKind(layout.cp_kind)
    top = 1
    while top * 2 <= layout.data_ranks:
        top *= 2
    heads, kv = spec.num_heads // layout.tp, spec.num_kv_heads // layout.tp
    return CPKind.ULYSSES if heads % top == 0 and kv % top == 0 else CPKind.RING


def runs_in_lockstep(pp: int, zero: Iterable[int], experts: bool = False) -> bool:
    """Whether every data rank runs the step's largest micro-batch count, padded with empty ones.

    Ranks may run different numbers of micro-batches unless something pairs collectives per
    micro-batch across all data ranks: ZeRO-3's weight gathers, a pipeline schedule, or experts
    sharded over the data ranks (``experts``: their all-to-alls, flexmesh.runtime.parallel.expert_parallel).
    The runtime pads by this rule (flexmesh.runtime.train.trainer) and the scheduler and simulator price the
    padding by it.

    >>> runs_in_lockstep(1, (2, 2)), runs_in_lockstep(1, (2, 3)), runs_in_lockstep(2, (0,))
    (False, True, True)
    >>> runs_in_lockstep(1, (2, 2), experts=True)
    True
    """
    return pp > 1 or experts or any(z == 3 for z in zero)


def layout_in_lockstep(spec: ModelSpec, layout: Layout) -> bool:
    """:func:`runs_in_lockstep` for a group of ``layout`` training ``spec``: its experts, when it has
    them, are exchanged over its data ranks once there are several."""
    return runs_in_lockstep(layout.pp, layout.zero, spec.is_moe and layout.data_ranks > 1)


def padded_microbatch_count(schedule: str, count: int, pp: int) -> int:
    """Micro-batches a pipelined step runs: interleaved 1F1B needs a multiple of pp (dummies pad it).

    >>> padded_microbatch_count("interleaved", 5, 2), padded_microbatch_count("1f1b", 5, 2)
    (6, 5)
    """
    if schedule == "interleaved" and pp > 1:
        return -(-count // pp) * pp
    return count


def group_cp_kind(kind: CPKind | str, heads: int, size: int) -> CPKind:
    """The attention a context-parallel group of ``size`` ranks runs, given the run's ``kind``.

    Ulysses gives each rank of the group ``heads / size`` of the query heads (``heads`` per
    tensor-parallel rank), so a group whose size does not divide them runs ring attention instead
    (key/value heads that do not split are replicated, which costs memory, not correctness). The
    runtime picks the kernel with this function and the scheduler and simulator price with it, so
    what is priced is what runs.

    >>> [str(group_cp_kind("ulysses", 32, d)) for d in (1, 8, 64)], str(group_cp_kind("ring", 32, 8))
    (['none', 'ulysses', 'ring'], 'ring')
    """
    if size <= 1:
        return CPKind.NONE
    k = CPKind(kind)
    return CPKind.RING if k == CPKind.ULYSSES and heads % size else k


def data_rank(layout: Layout, global_rank_: int) -> int:
    """Data rank of a global rank: its ``dp`` and ``cp`` coordinates merged (the inverse of
    :func:`global_rank` on that axis).

    >>> lay = Layout(pp=2, dp=2, cp=1, cp_kind="none", tp=2, zero=(0,), recompute=(False,))
    >>> data_rank(lay, 6), data_rank(lay, global_rank(lay, 0, 1, 1))
    (1, 1)
    """
    c = rank_coords(global_rank_, layout.pp, layout.dp, layout.cp, layout.tp)
    return c[MeshAxis.DP] * layout.cp + c[MeshAxis.CP]


def replica_groups(plan: Plan) -> Plan:
    """A one-group plan's data-parallel replicas as replica groups of one pipeline each (dp 1, full
    copies, no ZeRO; micro-batches the plan's count where each replica's share divides into it), priced
    with TP communication overlapped as mixed plans are: how a uniform layout runs on a mixed cluster
    or beside a slow device. Needs one tp degree per stage, no context parallelism, no interleaving.

    >>> st = tuple(StagePlan(i, i + 2, (LayerStrategy.parse("tp2-dp2z3"),) * 2) for i in (0, 2))
    >>> p = replica_groups(Plan.uniform("tiny", "8xA100-80GB", 8, 2, "1f1b", 4, 64, 8, st))
    >>> [g.blocks for g in p.groups], [g.share for g in p.groups], str(p.groups[0].stages[0].strategies[0])
    ([((0, 1), (4, 5)), ((2, 3), (6, 7))], [4, 4], 'tp2-dp1z0')
    """
    import math

    if plan.virtual_stages != 1:
        raise PlanError("an interleaved plan has no form as replica groups of one pipeline (one chunk per stage only)")
    stages = sorted(plan.stages, key=lambda s: s.start)
    for s in stages:
        if any(x.cp != 1 for x in s.strategies) or len({x.tp for x in s.strategies}) != 1:
            raise PlanError(f"stage [{s.start}, {s.end}) mixes tp degrees or uses context parallelism; replica "
                            "groups of one pipeline have one tp degree per stage and no cp")
    tps = {s.strategies[0].tp for s in stages}
    if len(tps) != 1:
        raise PlanError("stages use different tp degrees; the uniform rank order needs one")
    tp = tps.pop()
    dp = plan.stage_devices // tp
    if plan.global_batch % dp:
        raise PlanError(f"global batch {plan.global_batch} does not split evenly over {dp} replicas")
    layout_from_plan(plan)  # validates the rank arithmetic
    by_coords: dict[tuple[int, int], list[int]] = {}
    for rank in range(plan.world_size):
        c = rank_coords(rank, plan.pp, dp, 1, tp)
        by_coords.setdefault((c["dp"], c["pp"]), []).append(rank)
    batch = plan.global_batch // dp
    micro = math.gcd(batch, plan.num_microbatches)  # the plan's count where the share divides into it
    chunks = tuple(StagePlan(s.start, s.end, (LayerStrategy(tp=tp, dp=1, zero=0,
                                                            recompute=Recompute(s.strategies[0].recompute)),)
                             * s.num_layers) for s in stages)
    groups = tuple(ReplicaGroup(tuple(tuple(by_coords[(d, p)]) for p in range(plan.pp)), chunks, micro, batch)
                   for d in range(dp))
    schedule = plan.pipeline_schedule if plan.pipeline_schedule in (PipelineSchedule.ONE_F_ONE_B,
                                                                     PipelineSchedule.GPIPE) \
        else PipelineSchedule.ONE_F_ONE_B
    return Plan(plan.model, plan.cluster, plan.world_size, plan.seq_len, plan.global_batch, schedule, groups,
                predicted=dict(plan.predicted), cost_source=plan.cost_source, overlap=FASTEST,
                model_config=plan.model_config)


def schedule_parts(plan: Plan, schedule: StepSchedule) -> list[list[Group]]:
    """The step's schedule groups of each replica group, in plan order (global data-rank numbering);
    ScheduleError for a schedule group that names data ranks outside the plan or spans two replica
    groups (a context-parallel group stays inside one).

    >>> from dataclasses import replace
    >>> from flexmesh.layout.step import Piece
    >>> st = (StagePlan(0, 2, (LayerStrategy.parse("tp1-dp2z0"),) * 2),)
    >>> one = (StagePlan(0, 2, (LayerStrategy(),) * 2),)
    >>> p = Plan("tiny", "cpu", 3, 64, 3, "1f1b", (ReplicaGroup(((0, 1),), st, 1, 2), ReplicaGroup(((2,),), one, 1, 1)))
    >>> s = StepSchedule((5, 6), (Group((0, 1), ((Piece(0, 0, 5),),)), Group((2,), ((Piece(1, 0, 6),),)),
    ...                           Group((3,), ())), "test")
    >>> [[g.ranks for g in part] for part in schedule_parts(p, replace(s, groups=s.groups[:2]))]
    [[(0, 1)], [(2,)]]
    >>> schedule_parts(p, s)
    Traceback (most recent call last):
    ...
    flexmesh.errors.ScheduleError: schedule group of data ranks [3] does not fit this plan's data ranks 0-1, ...
    """
    offsets = data_rank_offsets(plan)
    ends = [o + g.data_ranks for o, g in zip(offsets, plan.groups)]
    out: list[list[Group]] = [[] for _ in plan.groups]
    for g in schedule.groups:
        owner = [i for i, (lo, hi) in enumerate(zip(offsets, ends)) if lo <= g.ranks[0] < hi]
        if not owner or any(not offsets[owner[0]] <= r < ends[owner[0]] for r in g.ranks):
            runs = ", ".join(f"{lo}-{hi - 1}" for lo, hi in zip(offsets, ends))
            where = f"{ends[-1]} data ranks" if len(plan.groups) == 1 else f"data ranks {runs} of its replica groups"
            raise ScheduleError(f"schedule group of data ranks {list(g.ranks)} does not fit this plan's {where}: a "
                                "group of data ranks stays inside one replica group; schedule for the plan the run "
                                "trains")
        out[owner[0]].append(g)
    return out
