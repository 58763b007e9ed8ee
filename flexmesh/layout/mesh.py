"""The rank order, in one place: mesh axes, parallel coordinates, global and data ranks.

A world of ``pp x dp x cp x tp`` ranks is laid out with ``tp`` innermost (a tensor-parallel group
shares a node), then ``cp``, then ``dp``, then ``pp`` (:data:`MESH_AXES`, outermost first). A *data
rank* merges the ``dp`` and ``cp`` coordinates, ``dp_index * cp + cp_index``: the axis per-step
schedules assign work over (flexmesh.layout.step). :func:`rank_coords`, :func:`global_rank` and
:func:`data_rank` are the only places that order is written down; the runtime's device mesh
(flexmesh.runtime.parallelize.build_mesh) is built with the same axes.

:class:`Layout` is a Plan reduced to what the runtime builds: one (tp, cp, dp) mesh per stage plus
what may differ per layer; :func:`layout_from_plan` rejects mixes the runtime cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from flexmesh.errors import PlanError
from flexmesh.layout.enums import CPKind, MeshAxis
from flexmesh.layout.plan import Plan
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
    >>> plan = Plan("tiny", "4xA100-80GB", 4, 1, "1f1b", 1, 64, 2, (st,))
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
    """Check the plan's per-layer mix is one the runtime supports and return its Layout."""
    strategies: list[LayerStrategy] = plan.layer_strategies()
    if not strategies:
        raise PlanError("plan has no layers; give every stage at least one layer")
    first = strategies[0]
    other = [i for i, s in enumerate(strategies) if not s.same_mesh(first)]
    if other:
        s = strategies[other[0]]
        raise PlanError(
            f"layers {_runs(other)} use tp{s.tp}/{s.cp_kind}{s.cp}/dp{s.dp} but layer 0 uses "
            f"tp{first.tp}/{first.cp_kind}{first.cp}/dp{first.dp}; the runtime needs one (tp, cp, dp) "
            "mesh for the whole plan: give every layer the same tp, context degree and kind, and dp"
        )
    if first.devices != plan.stage_devices:
        raise PlanError(
            f"layers use tp x cp x dp = {first.devices} devices but each pipeline stage has "
            f"{plan.stage_devices} (world {plan.world_size} / pp {plan.pp}); make them equal"
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
    return Layout(pp=plan.pp, dp=first.dp, cp=first.cp, cp_kind=first.cp_kind, tp=first.tp,
                  zero=tuple(zeros), recompute=tuple(s.recompute_kind for s in strategies))


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


def runs_in_lockstep(pp: int, zero: Iterable[int]) -> bool:
    """Whether every data rank runs the step's largest micro-batch count, padded with empty ones.

    Ranks may run different numbers of micro-batches unless something pairs collectives per
    micro-batch across all data ranks: ZeRO-3's weight gathers, or a pipeline schedule. The runtime
    pads by this rule (flexmesh.runtime.trainer) and the scheduler and simulator price the padding by it.

    >>> runs_in_lockstep(1, (2, 2)), runs_in_lockstep(1, (2, 3)), runs_in_lockstep(2, (0,))
    (False, True, True)
    """
    return pp > 1 or any(z == 3 for z in zero)


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
