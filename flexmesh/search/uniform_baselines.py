"""Uniform layouts the search is compared with, evaluated through the same cost model.

- Megatron-style 3D: one (tp, dp) strategy for every layer, ZeRO 0 or 1 (distributed optimizer),
  recomputation all on or all off, an even layer split over pp stages, 1F1B or interleaved.
- ZeRO-3 + Ulysses (DeepSpeed-Ulysses style): no pipeline, no tp, Ulysses degree cp, dp the rest.

Each function grid-searches its family and returns the fastest plan that fits (or None), counting
in a :class:`Misses` why the layouts it meets are left out, so that a family with none can say why. Both
families lie inside the search's space (flexmesh.search.driver); this module stands on
flexmesh.search.space only, and flexmesh.search.best ranks both beside each other. On a mixed
cluster the planner's plan is compared with flexmesh.search.baselines instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from flexmesh.cost import CostModel, Evaluation, pipeline_time
from flexmesh.cost.training.experts import ExpertParallel
from flexmesh.layout.enums import CPKind
from flexmesh.layout.overlap import Overlap
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.search.partition import even_split
from flexmesh.search.space import (
    FASTEST,
    FULL_SPACE,
    Candidate,
    SearchRequest,
    SearchSpace,
    candidate_strategies,
    divisors,
    evaluate_chunks,
    pipeline_degrees,
    pow2_upto,
    to_plan,
)
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.model import ModelSpec
from flexmesh.units import GIB


@dataclass
class Misses:
    """Why a uniform family's layouts were left out, counted as its grid meets them (no layout priced for it).

    - ``batch``: layouts whose data-parallel degree does not divide the global batch, so no micro-batch
      (``dp`` holds those degrees);
    - ``other``: layouts outside the search's strategies for other reasons (tp or Ulysses cp that does
      not divide the heads, degrees the search space leaves out);
    - ``memory``: layouts priced that do not fit; ``least_peak`` is the least of their peaks (bytes on
      the fullest device) and ``budget`` the usable bytes per device.

    >>> m = Misses(batch=12, dp={4, 8}, memory=2, least_peak=90 * GIB, budget=70 * GIB)
    >>> for part in m.reason(6, "H100 (80 GiB)").split("; "):
    ...     print(part)
    the batch rules out 12 layouts (data-parallel degrees 4, 8 do not divide its 6 sequences)
    memory rules out 2 layouts (the least peak 90.0 GiB, over the 70.0 GiB usable per H100 (80 GiB))
    """

    batch: int = 0
    dp: set[int] = field(default_factory=set)
    other: int = 0
    memory: int = 0
    least_peak: float = math.inf
    budget: float = 0.0

    def priced(self, ev: Evaluation) -> None:
        """Count a priced layout that does not fit."""
        if not ev.fits:
            self.memory += 1
            self.least_peak, self.budget = min(self.least_peak, ev.peak_memory), ev.budget

    def add(self, other: Misses) -> None:
        """Count ``other``'s misses too (the families of a search together)."""
        self.batch, self.other, self.memory = self.batch + other.batch, self.other + other.other, \
            self.memory + other.memory
        self.dp |= other.dp
        if other.least_peak < self.least_peak:
            self.least_peak, self.budget = other.least_peak, other.budget

    def reason(self, global_batch: int, device: str, first: str | None = None) -> str:
        """Why nothing fits, the most common reason first (``first``: "batch", "memory" or "other" before
        the rest, where it ruled any out); ``device`` names the device, e.g. "H100 (80 GiB)"."""
        degrees = ", ".join(map(str, sorted(self.dp)))
        one = len(self.dp) == 1
        parts = [(self.batch, "batch", f"the batch rules out {_layouts(self.batch)} (data-parallel "
                                       f"degree{'s' * (not one)} {degrees} {'does' if one else 'do'} not divide its "
                                       f"{global_batch} sequences)"),
                 (self.memory, "memory", f"memory rules out {_layouts(self.memory)} (the least peak "
                                         f"{self.least_peak / GIB:.1f} GiB, over the {self.budget / GIB:.1f} GiB "
                                         f"usable per {device})"),
                 (self.other, "other", f"other constraints rule out {_layouts(self.other)} (tp or Ulysses degrees "
                                       "the heads do not divide, or degrees the search space leaves out)")]
        said = [text for n, _, text in sorted(parts, key=lambda p: (p[1] != first, -p[0])) if n]
        return "; ".join(said) if said else "the cluster leaves it no layout"


def _layouts(n: int) -> str:
    return f"{n} layout{'s' * (n != 1)}"


def uniform_plan(model: ModelSpec, cluster: ClusterSpec, strategy: LayerStrategy, pp: int, schedule: str, m: int,
                 seq_len: int, global_batch: int, cost: CostModel, v: int = 1, overlap: Overlap = FASTEST) -> Candidate:
    """One strategy for every layer, layers split evenly over ``pp * v`` chunks, priced with the
    overlap Megatron-Core (--tp-comm-overlap, --overlap-grad-reduce) and FSDP2 (prefetch) run, or
    ``overlap`` (a search restricted to one, e.g. what flexmesh's runtime runs)."""
    return _priced(model, cluster, strategy, pp, schedule, m, seq_len, global_batch, cost, v, overlap).candidate()


@dataclass(frozen=True)
class _Priced:
    """A uniform layout priced, its Plan built only when it is the one kept (building every
    candidate's plan cost as much as pricing it)."""

    evaluation: Evaluation
    args: tuple

    def candidate(self) -> Candidate:
        model, cluster, cost, chunks, pp, schedule, v, m, seq_len, global_batch, overlap = self.args
        plan = to_plan(model, cluster, cost, chunks, pp, schedule, v, m, seq_len, global_batch, self.evaluation,
                       overlap)
        return Candidate(plan, self.evaluation, "uniform", self.evaluation.step_time)


def _priced(model: ModelSpec, cluster: ClusterSpec, strategy: LayerStrategy, pp: int, schedule: str, m: int,
            seq_len: int, global_batch: int, cost: CostModel, v: int = 1, overlap: Overlap = FASTEST) -> _Priced:
    chunks = [(strategy,) * n for n in even_split(model.num_layers, pp * v)]
    ev = evaluate_chunks(cost, chunks, pp, schedule, v, m, seq_len, global_batch, overlap)
    return _Priced(ev, (model, cluster, cost, chunks, pp, schedule, v, m, seq_len, global_batch, overlap))


def _best(cands: Iterable[_Priced | Candidate]) -> Candidate | None:
    fits = [c for c in cands if c.evaluation.fits]
    if not fits:
        return None
    best = min(fits, key=lambda c: c.evaluation.step_time)
    return best.candidate() if isinstance(best, _Priced) else best


def megatron_3d(model: ModelSpec, cluster: ClusterSpec, seq_len: int, global_batch: int, cost: CostModel,
                space: SearchSpace = FULL_SPACE, misses: Misses | None = None) -> Candidate | None:
    """Best uniform tp x pp x dp layout (ZeRO 0/1, recompute on/off, 1F1B or interleaved, any m); ``misses``
    counts why layouts were left out."""
    world, L = cluster.world_size, model.num_layers
    cands: list[_Priced] = []
    allowed = _allowed(space, model, cluster, misses, global_batch)
    best = [math.inf]  # the least step of a layout that fits so far: layouts whose floor reaches it are not priced
    for pp in space.pp or pipeline_degrees(world, L, cluster.devices_per_node):
        if world % pp or pp > L:
            continue
        D = world // pp
        for tp in divisors(min(D, cluster.devices_per_node)):
            if D % tp:
                continue
            dp = D // tp
            for m in divisors(global_batch):
                mbs = global_batch // m
                schedules = [("1f1b", 1)]
                if pp > 1 and "interleaved" in space.pipeline_schedules and L >= 2 * pp and m % pp == 0:
                    schedules.append(("interleaved", 2))
                for zero in (0, 1):
                    for schedule, v in schedules:
                        strategies = [LayerStrategy(tp=tp, dp=dp, zero=zero if dp > 1 else 0, recompute=ac)
                                      for ac in (False, True)]
                        cands.extend(_least_recompute([s for s in strategies if allowed(s, D, mbs)], model,
                                                      cluster, pp, schedule, m, seq_len, global_batch, cost, v,
                                                      _overlap(space), best, misses))
    return _best(cands)


def _floor(cost: CostModel, s: LayerStrategy, layers: int, pp: int, schedule: str, m: int, v: int, seq_len: int,
           global_batch: int, overlap: Overlap) -> float:
    """A lower bound of a uniform layout's step: every rank runs at least ``v x floor(layers / (pp v))``
    layers of ``s`` per micro-batch (an even split of ``pp x v`` chunks), priced as
    :meth:`CostModel.evaluate_stages` prices them (compute at the cluster's pace), without its ends,
    sends and tail (none negative); the pipeline time grows with every rank's time."""
    mbs = global_batch // m
    c = cost.layer(s, cost.layer_work(s, mbs, seq_len), cost.effective_overlap(overlap, m))
    per_layer = (c.fwd + c.bwd) / cost.cluster.pace + c.comm_fwd + c.comm_bwd
    return pipeline_time(schedule, [v * (layers // (pp * v)) * per_layer] * pp, m, v)


def _allowed(space: SearchSpace, model: ModelSpec, cluster: ClusterSpec, misses: Misses | None = None,
             global_batch: int = 0) -> Callable[[LayerStrategy, int, int], bool]:
    """Whether a strategy is among the search's candidates on ``devices`` per stage with ``mbs``
    sequences a micro-batch (the candidates of each (devices, mbs) listed once); ``misses`` counts
    why one is not: its dp divides no micro-batch of ``global_batch`` sequences, or it is no candidate
    at any batch (a dp dividing the batch but not this micro-batch only rules out this micro-batch count)."""
    listed: dict[tuple[int, int | None], set[LayerStrategy]] = {}

    def among(strategy: LayerStrategy, devices: int, mbs: int | None) -> bool:
        if (devices, mbs) not in listed:
            listed[(devices, mbs)] = set(candidate_strategies(model, cluster, devices, space, mbs))
        return strategy in listed[(devices, mbs)]

    def allowed(strategy: LayerStrategy, devices: int, mbs: int) -> bool:
        if among(strategy, devices, mbs):
            return True
        if misses is not None:
            if not among(strategy, devices, None):
                misses.other += 1
            elif global_batch % strategy.dp:  # a candidate at another batch
                misses.batch += 1
                misses.dp.add(strategy.dp)
        return False
    return allowed


def _overlap(space: SearchSpace) -> Overlap:
    """The overlap baselines are priced with: the one a restricted search allows, else FASTEST."""
    return space.overlaps[0] if space.overlaps else FASTEST


def _least_recompute(strategies: list[LayerStrategy], model: ModelSpec, cluster: ClusterSpec, pp: int, schedule: str,
                     m: int, seq_len: int, global_batch: int, cost: CostModel, v: int = 1,
                     overlap: Overlap = FASTEST, best: list[float] | None = None,
                     misses: Misses | None = None) -> list[_Priced]:
    """Uniform layouts of ``strategies`` (least recomputation first) up to the first that fits:
    recomputing more only adds backward time to the same layout, so the rest cannot be faster. With
    ``best`` (a one-item list, the least step that fits so far, kept up to date here) a layout whose
    :func:`_floor` reaches it is not priced, nor are those recomputing more: none of them can win (on a
    tie the one priced first is kept, as before)."""
    out = []
    for s in strategies:
        if best is not None and _floor(cost, s, model.num_layers, pp, schedule, m, v, seq_len, global_batch,
                                       overlap) >= best[0]:
            break
        out.append(_priced(model, cluster, s, pp, schedule, m, seq_len, global_batch, cost, v, overlap))
        if misses is not None:
            misses.priced(out[-1].evaluation)
        if out[-1].evaluation.fits:
            if best is not None:
                best[0] = min(best[0], out[-1].evaluation.step_time)
            break
    return out


def zero3_ulysses(model: ModelSpec, cluster: ClusterSpec, seq_len: int, global_batch: int, cost: CostModel,
                  space: SearchSpace = FULL_SPACE, misses: Misses | None = None) -> Candidate | None:
    """Best ZeRO-3 + Ulysses layout: pp 1, tp 1, Ulysses degree cp (heads % cp == 0), dp = world / cp;
    ``misses`` counts why layouts were left out."""
    world = cluster.world_size
    cands: list[_Priced] = []
    allowed = _allowed(space, model, cluster, misses, global_batch)
    for cp in pow2_upto(world):
        if world % cp:
            continue
        if model.num_heads % cp:
            if misses is not None:
                misses.other += 1
            continue
        dp = world // cp
        for m in divisors(global_batch):
            strategies = [LayerStrategy(tp=1, cp=cp, cp_kind=CPKind.ULYSSES if cp > 1 else CPKind.NONE, dp=dp,
                                        zero=3 if dp * cp > 1 else 0, recompute=ac) for ac in (False, True)]
            cands.extend(_least_recompute([s for s in strategies if allowed(s, world, global_batch // m)], model,
                                          cluster, 1, "1f1b", m, seq_len, global_batch, cost,
                                          overlap=_overlap(space), misses=misses))
    return _best(cands)


def runtime_runs(name: str, model: ModelSpec) -> bool:
    """Whether flexmesh's runtime runs baseline ``name``'s plan as it is priced: not Megatron-LM's whole-expert
    parallelism of a mixture of experts (the runtime shards experts over every data rank: flexmesh.runtime.
    parallel.expert_parallel), so such a baseline is a comparison only, never a plan the search returns."""
    return not (model.is_moe and name == "megatron-3d")


def baselines(request: SearchRequest, misses: dict[str, Misses] | None = None) -> dict[str, Candidate | None]:
    """The best plan of each uniform family for the request (None where none of the family fits; ``misses``
    receives each family's :class:`Misses`).

    A mixture of experts runs its experts as those stacks do: Megatron-LM's expert parallelism (whole
    experts over ``ep`` data ranks, its best ``ep`` dividing the experts within a node, never moved)
    and ZeRO-3's with experts fully sharded and placed statically (LAER-MoE's "FSDP+EP" baseline);
    the search prices flexmesh's runtime (its request's cost model: load-following placement)."""
    model, cluster, seq, gb = request.model, request.cluster, request.seq_len, request.global_batch
    cost = request.cost_model()
    why = {"megatron-3d": Misses(), "zero3-ulysses": Misses()}
    if misses is not None:
        misses.update(why)
    if model.moe is None:
        return {"megatron-3d": megatron_3d(model, cluster, seq, gb, cost, request.space, why["megatron-3d"]),
                "zero3-ulysses": zero3_ulysses(model, cluster, seq, gb, cost, request.space, why["zero3-ulysses"])}
    eps = [e for e in divisors(model.moe.num_experts) if e <= cluster.devices_per_node]
    measured = cost.experts.measured  # a replayed routing trace's static placement, where given
    ep = [megatron_3d(model, cluster, seq, gb, cost.replace(parts=replace(
        cost.parts, experts=ExpertParallel("static", ep=e, measured=measured))), request.space, why["megatron-3d"])
        for e in eps]
    static = cost.replace(parts=replace(cost.parts, experts=replace(cost.experts, placement="static", imbalance=None)))
    return {"megatron-3d": _best([c for c in ep if c is not None]),
            "zero3-ulysses": zero3_ulysses(model, cluster, seq, gb, static, request.space, why["zero3-ulysses"])}
