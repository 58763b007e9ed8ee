"""What the search may choose from, and the pieces the search and the uniform baselines share.

- :class:`SearchSpace`: which choices are allowed; :class:`SearchRequest`: one question to answer
  (model, cluster, sequence length, global batch, space, cost model, how many plans, which method).
- :func:`candidate_strategies`: every strategy one layer may take on a pipeline stage;
  :func:`outer_configurations`: every (pp, pipeline schedule, v, m) the search examines.
- :func:`evaluate_chunks` / :func:`to_plan`: price per-chunk strategies with the cost model and
  turn them into a :class:`~flexmesh.layout.plan.Plan`; :class:`Candidate` holds both.

Nothing here searches; flexmesh.search.driver and flexmesh.search.uniform_baselines both stand on this module
and neither imports the other.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import product

from flexmesh.cost import CostModel, Evaluation
from flexmesh.errors import PlanError
from flexmesh.layout.enums import CPKind, PipelineSchedule
from flexmesh.layout.overlap import FASTEST, NO_OVERLAP, Overlap  # noqa: F401 - FASTEST is named here too
from flexmesh.layout.plan import PIPELINE_SCHEDULES, Plan, StagePlan
from flexmesh.layout.strategy import LayerStrategy, Recompute
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.model import ModelSpec

Chunk = tuple[LayerStrategy, ...]  # the strategies of one pipeline chunk's layers, in layer order
Mesh = tuple  # (tp, cp, cp_kind, dp): what transitions and pipeline sends depend on
SEARCH_MODES = ("auto", "exact", "fast")


@dataclass(frozen=True)
class SearchSpace:
    """Which choices the search may make. The defaults are the full space."""

    pipeline_schedules: tuple[str, ...] = PIPELINE_SCHEDULES
    cp_kinds: tuple[str, ...] = ("ulysses", "ring")
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    # none / selective / full (a bool: full or none, as before selective existed)
    recompute: tuple[Recompute | bool, ...] = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
    max_tp: int | None = None
    tp: tuple[int, ...] | None = None  # the tensor-parallel degrees allowed (None: every one up to max_tp)
    max_cp: int | None = None
    pp: tuple[int, ...] | None = None  # None: pipeline_degrees(world, layers, devices per node)
    microbatches: tuple[int, ...] | None = None  # None: every divisor of the global batch
    virtual_stages: tuple[int, ...] = (2, 3, 4)  # chunks per rank the interleaved schedule may use

    @property
    def recompute_modes(self) -> tuple[Recompute, ...]:
        """``recompute`` as :class:`Recompute` values, each once, in the given order."""
        return tuple(dict.fromkeys(LayerStrategy(recompute=r).recompute_kind for r in self.recompute))
    same_mesh: bool = False  # every layer of every stage on one (tp, cp, dp) mesh, as the runtime runs
    # Plan-level overlap options to price (flexmesh.layout.overlap); None: the search's own choice
    # (flexmesh.search.driver.overlap_choices).
    overlaps: tuple[Overlap, ...] | None = None


FULL_SPACE = SearchSpace()

# Overlap options never slower than leaving them off: TP communication under the GEMMs and ZeRO-3
# gathers prefetched (what Megatron-Core with --tp-comm-overlap and FSDP2 run, so the uniform
# baselines are priced with them too). They cost buffers, so the search also prices the lean
# alternative (both off) where memory binds; reducing ZeRO-2/3 gradients once ("last") saves time
# for unsharded gradients.
LEAN = Overlap(tp_comm=False, grad_reduce="bucketed", zero3_prefetch=False)
REDUCE_ONCE = Overlap(tp_comm=True, grad_reduce="last", zero3_prefetch=True)


@dataclass(frozen=True)
class SearchRequest:
    """One search: what to plan for, within which space, priced by which cost model.

    ``cost`` None means the preset cost model of (model, cluster), built once by :meth:`resolved`.
    ``top`` is how many plans to return; ``mode`` picks the method: "exact" (layer DP + every layer
    split), "fast" (closed form per rank + balanced splits) or "auto" (exact on small problems).

    >>> from flexmesh.spec import MODEL_PRESETS, parse_cluster
    >>> r = SearchRequest(MODEL_PRESETS["tiny"], parse_cluster("2xA100-80GB"), 1024, 8).resolved()
    >>> (r.world_size, r.mode, r.cost is not None)
    (2, 'auto', True)
    """

    model: ModelSpec
    cluster: ClusterSpec
    seq_len: int
    global_batch: int
    space: SearchSpace = FULL_SPACE
    cost: CostModel | None = None
    top: int = 5
    mode: str = "auto"

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    def resolved(self) -> SearchRequest:
        """This request with its cost model built, so the search and the baselines share one."""
        return self if self.cost is not None else replace(self, cost=CostModel(self.model, self.cluster))

    def cost_model(self) -> CostModel:
        """The request's cost model (call :meth:`resolved` first to build it only once)."""
        return self.cost if self.cost is not None else CostModel(self.model, self.cluster)

    def check(self) -> None:
        """Raise PlanError on inputs no search can answer (before any work is spent on them)."""
        if self.seq_len < 1 or self.global_batch < 1:
            raise PlanError(f"--seq-len and --global-batch must be positive, got {self.seq_len} and "
                            f"{self.global_batch}")
        if self.mode not in SEARCH_MODES:
            raise PlanError(f"search mode must be exact, fast or auto, got {self.mode!r}")


@dataclass(frozen=True)
class Candidate:
    """A plan with its evaluation by the cost model."""

    plan: Plan
    evaluation: Evaluation
    origin: str = "search"  # "search", or the baseline that won ("megatron-3d", "zero3-ulysses")
    estimate: float = math.nan  # the search's own step-time figure (equals evaluation.step_time)


# ---- small integer helpers -----------------------------------------------------------------------
def pow2_upto(n: int) -> list[int]:
    """Powers of two up to ``n``.

    >>> pow2_upto(12)
    [1, 2, 4, 8]
    """
    return [1 << i for i in range(n.bit_length()) if (1 << i) <= n]


def pipeline_degrees(world: int, layers: int, per_node: int) -> list[int]:
    """Default pipeline degrees: divisors of ``world`` up to ``layers`` whose stages are whole nodes or
    divide a node (a stage straddling part of a node would split tp or data groups across nodes).

    >>> pipeline_degrees(384, 70, 8)  # BLOOM's 48 nodes of 8: 12 stages of 4 nodes among them
    [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    >>> pipeline_degrees(24, 32, 8)
    [1, 3, 6, 12, 24]
    """
    return [p for p in divisors(world) if p <= layers and
            ((world // p) % per_node == 0 or per_node % (world // p) == 0)]


# How far ``--tokens-per-batch`` may move the step's sequence count to one the layouts divide better
# (:func:`factoring_batch`). A choice, not a measurement: 2% of a batch trains alike (the critical batch
# size of McCandlish et al., 1812.06162, moves with the gradient noise by factors, not percents), while an
# odd count can leave data parallelism no degree above 1 (1,953 sequences on 1,024 devices).
BATCH_TOLERANCE = 0.02


def factoring_batch(sequences: int, world: int, tolerance: float = BATCH_TOLERANCE) -> int:
    """The sequence count within ``tolerance`` of ``sequences`` that splits over the most data-parallel
    ranks of a ``world`` of devices: the largest ``gcd(count, world)`` (every data-parallel degree divides
    the world, and the batch's micro-batches), the count nearest ``sequences`` among those (the lower
    one on equal distance); ``sequences`` itself where none splits further.

    >>> factoring_batch(1953, 1024)  # 3^2 x 7 x 31: 1,920 splits over 128 ranks, 1,952 over 32
    1920
    >>> factoring_batch(127, 8), factoring_batch(96, 8), factoring_batch(3, 8)
    (128, 96, 3)
    """
    lo, hi = max(1, math.ceil(sequences * (1 - tolerance))), math.floor(sequences * (1 + tolerance))
    # the best count is a multiple of a divisor of the world nearest ``sequences``: those few, not the range
    near = {sequences} | {n for d in divisors(world) for n in (sequences // d * d, -(-sequences // d) * d)
                          if lo <= n <= hi}
    return min(near, key=lambda n: (-math.gcd(n, world), abs(n - sequences), n))


def batches_near(batch: int, degrees: set[int], tries: int = 4) -> list[int]:
    """The ``tries`` sequence counts nearest ``batch`` that one of ``degrees`` divides, the nearest (then the
    smaller) first.

    >>> batches_near(1953, {2, 4, 8, 16})
    [1952, 1954, 1956, 1960]
    >>> batches_near(3, {8})
    [8]
    """
    near = {b for d in degrees for b in (batch // d * d, -(-batch // d) * d) if b > 0 and b != batch}
    return sorted(near, key=lambda b: (abs(b - batch), b))[:tries]


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending.

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    small, large = [], []
    d = 1
    while d * d <= n:  # pairs (d, n // d): sqrt(n) trials, so a huge prime world or batch stays instant
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def mesh_of(s: LayerStrategy) -> Mesh:
    """The device mesh a strategy runs on; strategies on one mesh differ only in ZeRO and recompute."""
    return (s.tp, s.cp, s.cp_kind, s.dp)


# ---- candidate strategies and outer configurations ---------------------------------------------------
def candidate_strategies(model: ModelSpec, cluster: ClusterSpec, devices: int, space: SearchSpace = FULL_SPACE,
                         microbatch_seqs: int | None = None) -> list[LayerStrategy]:
    """Every strategy one layer may take on a stage of ``devices`` devices.

    tp: divisors of the node size dividing the heads (and the KV heads, or divided by them); cp:
    powers of two, Ulysses only when the heads split over tp x cp; dp fills the rest (any integer)
    and must divide the micro-batch; ZeRO above 0 only when states are replicated (dp x cp > 1).

    >>> from flexmesh.spec import MODEL_PRESETS, parse_cluster
    >>> ss = candidate_strategies(MODEL_PRESETS["tiny"], parse_cluster("2xA100-80GB"), 2)
    >>> [str(s) for s in ss if s.recompute is Recompute.NONE and s.zero in (0, 3)]
    ['tp1-dp2z0', 'tp1-dp2z3', 'tp1-u2-dp1z0', 'tp1-u2-dp1z3', 'tp1-r2-dp1z0', 'tp1-r2-dp1z3', 'tp2-dp1z0']
    """
    return [s for s in _candidates(model, cluster, devices, space)
            if microbatch_seqs is None or microbatch_seqs % s.dp == 0]


@lru_cache(maxsize=256)
def _candidates(model: ModelSpec, cluster: ClusterSpec, devices: int, space: SearchSpace) -> tuple[LayerStrategy, ...]:
    # Cached: the search asks for the same stage size under every schedule and micro-batch count.
    out = []
    max_tp = min(cluster.devices_per_node, devices, space.max_tp or devices)
    for tp in divisors(max_tp):
        if devices % tp or cluster.devices_per_node % tp or (space.tp is not None and tp not in space.tp):
            continue
        if model.num_heads % tp or not (model.num_kv_heads % tp == 0 or tp % model.num_kv_heads == 0):
            continue
        for cp in pow2_upto(min(devices // tp, space.max_cp or devices)):
            if devices % (tp * cp):
                continue
            dp = devices // (tp * cp)
            kinds = [CPKind.NONE] if cp == 1 else [
                CPKind(k) for k in space.cp_kinds if k != "ulysses" or model.num_heads % (tp * cp) == 0]
            for kind in kinds:
                zeros = [z for z in space.zero_stages if z == 0 or dp * cp > 1] or [0]
                for z, ac in product(zeros, space.recompute_modes):
                    out.append(LayerStrategy(tp=tp, cp=cp, cp_kind=kind, dp=dp, zero=z, recompute=ac))
    return tuple(out)


def outer_configurations(model: ModelSpec, world: int, global_batch: int, space: SearchSpace,
                         per_node: int = 1) -> Iterator[tuple[int, str, int, int]]:
    """(pp, pipeline schedule, v, m) tuples the search examines.

    pp: ``space.pp``, else :func:`pipeline_degrees` (``per_node`` devices per node; 1: every divisor
    of the world up to the layers). pp = 1 runs only as 1F1B (gradient accumulation; GPipe holds more
    and interleaving needs pp > 1). GPipe only when 1F1B is not allowed: the cost model prices both
    alike in time (:func:`~flexmesh.cost.training.pipeline.pipeline_time`) and GPipe with all ``m``
    micro-batches in flight, so a GPipe layout never beats the same layout under 1F1B. Interleaving
    runs ``v`` chunks per rank for each ``v`` of ``space.virtual_stages`` (the first and last chunk may
    hold no layer, every other one at least one): two chunks per rank always, more only when they
    split the layers evenly, counting the embedding and the loss as a layer each where that makes
    them even (Megatron's rule for interleaving, with Megatron-Core's
    ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split``, as Llama 3's
    126 layers run in 16 x 8 chunks); m must divide by pp, as Megatron requires.

    >>> from flexmesh.spec import MODEL_PRESETS
    >>> list(outer_configurations(MODEL_PRESETS["tiny"], 2, 2, SearchSpace(pipeline_schedules=("1f1b",))))
    [(1, '1f1b', 1, 1), (1, '1f1b', 1, 2), (2, '1f1b', 1, 1), (2, '1f1b', 1, 2)]
    >>> list(outer_configurations(MODEL_PRESETS["tiny"], 2, 2, SearchSpace(pipeline_schedules=("interleaved",))))
    [(2, 'interleaved', 2, 2), (2, 'interleaved', 3, 2)]

    (tiny's 4 layers in 3 chunks per rank: 6 chunks, the first and last the embedding and head alone.)
    """
    L = model.num_layers
    pps = space.pp or pipeline_degrees(world, L, per_node)
    for pp in pps:
        if world % pp or pp > L:
            continue
        for schedule in space.pipeline_schedules:
            if (pp == 1 and schedule != "1f1b") or (schedule == "gpipe" and "1f1b" in space.pipeline_schedules):
                continue
            vs = [1] if schedule != "interleaved" else [v for v in space.virtual_stages if v >= 2 and L + 2 >= pp * v
                                                         and (v == 2 or any((L + e) % (pp * v) == 0 for e in range(3)))]
            for v in vs:
                for m in space.microbatches or divisors(global_batch):
                    if global_batch % m or (schedule == "interleaved" and m % pp):
                        continue
                    yield pp, schedule, v, m


# ---- pricing and writing a layout -----------------------------------------------------------------
def evaluate_chunks(cost: CostModel, chunks: Sequence[Chunk], pp: int, schedule: str, v: int, m: int, seq_len: int,
                    global_batch: int, overlap: Overlap = NO_OVERLAP) -> Evaluation:
    """The cost model's figures for ``pp * v`` chunks under ``schedule`` with ``m`` micro-batches."""
    return cost.evaluate_stages(chunks, pp, schedule, m, v, global_batch // m, seq_len, overlap)


def to_plan(model: ModelSpec, cluster: ClusterSpec, cost: CostModel, chunks: Sequence[Chunk], pp: int, schedule: str,
            v: int, m: int, seq_len: int, global_batch: int, ev: Evaluation, overlap: Overlap = NO_OVERLAP) -> Plan:
    """The Plan of consecutive chunks (chunk ``i`` on pipeline rank ``i % pp``) with its predicted figures."""
    stages, start = [], 0
    for st in chunks:
        stages.append(StagePlan(start, start + len(st), tuple(st)))
        start += len(st)
    return Plan.uniform(model=model.name, cluster=cluster.label, world_size=cluster.world_size, pp=pp,
                pipeline_schedule=PipelineSchedule(schedule), num_microbatches=m, seq_len=seq_len,
                global_batch=global_batch, stages=tuple(stages), virtual_stages=v, predicted=ev.to_dict(),
                cost_source=cost.source, overlap=overlap)
