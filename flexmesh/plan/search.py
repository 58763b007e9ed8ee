"""The static search: the fastest plan (per-layer strategies, pipeline split, schedule, micro-batches) that fits.

Outer loop: pipeline degree ``pp`` (powers of two dividing the world), schedule (1F1B, GPipe,
interleaved with two chunks per rank) and micro-batch count ``m``. For each, and for each way of
splitting the layers into chunks, every pipeline rank gets a small set of options; an option is the
strategies of all its layers, summarised by what the step time and memory depend on. The ranks'
options are then combined exactly (:func:`_combine`) and the best few plans are re-evaluated with
:meth:`CostModel.evaluate_stages`, whose numbers are the ones reported.

Two ways of producing a rank's options:

- exact (small models and clusters): a dynamic program over the layers of each chunk; the state is
  the last layer's strategy (transitions between meshes cost :meth:`CostModel.transition`), and each
  state keeps the Pareto frontier of (time, memory, largest transient, gradient sync, optimizer,
  -backward) with exact values. The step time is monotone in each of these, so dropping dominated
  points never drops the optimum; with every split of the layers enumerated, the result equals
  brute-force enumeration (tests/test_search.py checks this).
- fast (everything else): layers are identical, so within a rank whose layers share one mesh and one
  ZeRO stage the only per-layer choice left is recomputation, and then only *how many* layers
  recompute matters (order changes no cost). Each rank's options are therefore
  ``mesh x zero x k recomputed layers``, evaluated in closed form with numpy from the cost model's
  per-layer :class:`LayerCost`; layer splits are a few time- and memory-balanced ones.

Uniform baselines (flexmesh.plan.baselines) lie inside this space; their best plans are ranked with
the searched ones, so the result is never worse than them, and ``origin`` says which one won.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import product

import numpy as np

from flexmesh.cost.model import CostModel, Evaluation, in_flight, pipeline_times
from flexmesh.units import GIB
from flexmesh.errors import PlanError
from flexmesh.plan.partition import balance, compositions, count_compositions, even_split, neighbours
from flexmesh.layout.plan import Plan, StagePlan
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.model import ModelSpec

# Exhaustive splits are enumerated up to this many per (pp, schedule); beyond it, balanced ones.
MAX_EXACT_SPLITS = 64
# "auto" mode runs the exact DP when a stage spanning the world has at most this many strategies.
EXACT_MAX_STRATEGIES = 16


@dataclass(frozen=True)
class SearchSpace:
    """Which choices the search may make. The defaults are the full space."""

    schedules: tuple[str, ...] = ("1f1b", "gpipe", "interleaved")
    cp_kinds: tuple[str, ...] = ("ulysses", "ring")
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[bool, ...] = (False, True)
    max_tp: int | None = None
    max_cp: int | None = None
    pp: tuple[int, ...] | None = None  # None: every power of two <= min(world, layers) dividing world
    microbatches: tuple[int, ...] | None = None  # None: every divisor of the global batch
    same_mesh: bool = False  # every layer of every stage on one (tp, cp, dp) mesh, as the runtime runs


@dataclass(frozen=True)
class Candidate:
    """A plan with its evaluation by the cost model."""

    plan: Plan
    evaluation: Evaluation
    origin: str = "search"  # "search", or the baseline that won ("megatron-3d", "zero3-ulysses")
    estimate: float = math.nan  # the search's own step-time figure (equals evaluation.step_time)


@dataclass
class SearchResult:
    plans: list[Candidate]  # best first; every one fits in memory
    search_seconds: float
    mode: str  # "exact" or "fast"
    configurations: int  # (pp, schedule, m, split) combinations examined
    baselines: dict[str, Candidate | None] = field(default_factory=dict)

    @property
    def best(self) -> Candidate:
        return self.plans[0]


# ---- candidate strategies ------------------------------------------------------------------------
def _pow2_upto(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if (1 << i) <= n]


def candidate_strategies(model: ModelSpec, cluster: ClusterSpec, devices: int,
                         space: SearchSpace = SearchSpace(), microbatch_seqs: int | None = None) -> list[LayerStrategy]:
    """Every strategy one layer may take on a stage of ``devices`` devices.

    tp: powers of two within a node dividing the heads (and the KV heads, or divided by them);
    cp: powers of two, Ulysses only when the heads split over tp x cp; dp fills the rest and must
    divide the micro-batch; ZeRO above 0 only when states are replicated (dp x cp > 1).

    >>> from flexmesh.spec import MODEL_PRESETS, parse_cluster
    >>> ss = candidate_strategies(MODEL_PRESETS["tiny"], parse_cluster("2xA100-80GB"), 2)
    >>> [str(s) for s in ss if not s.recompute and s.zero in (0, 3)]
    ['tp1-dp2z0', 'tp1-dp2z3', 'tp1-u2-dp1z0', 'tp1-u2-dp1z3', 'tp1-r2-dp1z0', 'tp1-r2-dp1z3', 'tp2-dp1z0']
    """
    return [s for s in _candidates(model, cluster, devices, space) if microbatch_seqs is None or microbatch_seqs % s.dp == 0]


@lru_cache(maxsize=256)
def _candidates(model: ModelSpec, cluster: ClusterSpec, devices: int, space: SearchSpace) -> tuple[LayerStrategy, ...]:
    # Cached: the search asks for the same stage size under every schedule and micro-batch count.
    out = []
    max_tp = min(cluster.devices_per_node, devices, space.max_tp or devices)
    for tp in _pow2_upto(max_tp):
        if model.num_heads % tp or not (model.num_kv_heads % tp == 0 or tp % model.num_kv_heads == 0):
            continue
        for cp in _pow2_upto(min(devices // tp, space.max_cp or devices)):
            if devices % (tp * cp):
                continue
            dp = devices // (tp * cp)
            kinds = ["none"] if cp == 1 else [k for k in space.cp_kinds if k != "ulysses" or model.num_heads % (tp * cp) == 0]
            for kind in kinds:
                zeros = [z for z in space.zero_stages if z == 0 or dp * cp > 1] or [0]
                for z, ac in product(zeros, space.recompute):
                    out.append(LayerStrategy(tp=tp, cp=cp, cp_kind=kind, dp=dp, zero=z, recompute=ac))
    return tuple(out)


def _mesh(s: LayerStrategy) -> tuple:
    return (s.tp, s.cp, s.cp_kind, s.dp)


# ---- what step time and memory depend on -----------------------------------------------------------
def _tail(cost: CostModel, grad_sync, bwd, optim, layers):
    """Exposed gradient sync + optimizer after the pipeline drains, as evaluate_stages computes it."""
    return cost.exposed_sync(grad_sync, bwd, layers) + optim


@dataclass(frozen=True)
class _Ctx:
    cost: CostModel
    seq_len: int
    mbs: int  # sequences per micro-batch across a stage
    pp: int
    v: int
    flight: tuple[float, ...]  # per pipeline rank
    budget: float

    def work(self, s: LayerStrategy):
        return self.cost.layer_work(s, self.mbs, self.seq_len)

    def layer(self, s: LayerStrategy):
        return self.cost.layer(s, self.work(s))

    def ends(self, s: LayerStrategy, embed: bool, head: bool):
        return self.cost.ends(s, self.work(s), embed, head)

    def p2p(self, s: LayerStrategy) -> float:
        return self.cost.pipeline_p2p(s, self.mbs, self.seq_len, self.pp) * self.v


# Vector of a partial chunk in the exact DP; every entry is one the step time or memory grows with.
_T, _MEM, _TRANS, _GS, _OPT, _NBWD = range(6)


def _vec(c, flight: float, extra_mem: float = 0.0) -> np.ndarray:
    return np.array([c.time, c.states + flight * c.act + extra_mem, c.transient, c.grad_sync, c.optim, -c.bwd])


def _pareto(vecs: np.ndarray) -> np.ndarray:
    """Indices of the points no other point weakly dominates (duplicates keep one)."""
    order = np.lexsort(vecs.T[::-1])
    kept: list[int] = []
    for i in order:
        # Lexicographic order puts every dominating point before the points it dominates.
        if kept and np.all(vecs[kept] <= vecs[i], axis=1).any():
            continue
        kept.append(int(i))
    return np.asarray(kept, dtype=int)


def _pareto2(t: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Indices of the (t, u) frontier sorted by t ascending (u then strictly descending)."""
    order = np.lexsort((u, t))
    best_u = np.minimum.accumulate(u[order])
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = u[order][1:] < best_u[:-1]
    return order[keep]


class _ExactChunks:
    """Pareto frontiers of every strategy sequence of a chunk, by dynamic programming over layers."""

    def __init__(self, ctx: _Ctx, strategies: list[LayerStrategy]):
        self.ctx = ctx
        self.strategies = strategies
        self.cache: dict = {}

    def frontier(self, n: int, embed: bool, head: bool, first_round: bool, flight: float):
        """List of (vector, strategies) for a chunk of ``n`` layers; memory counts ``flight`` micro-batches."""
        key = (n, embed, head, first_round, flight)
        if key in self.cache:
            return self.cache[key]
        ctx, S = self.ctx, self.strategies
        # states[j] = (array of vectors, list of sequences) ending with strategy S[j]
        states = []
        for s in S:
            c = ctx.layer(s)
            if embed:
                c = c + ctx.ends(s, True, False)
            v = _vec(c, flight)
            if first_round:
                v[_T] += ctx.p2p(s)
            states.append((v[None, :], [(s,)]))
        for _ in range(n - 1):
            new = []
            for s in S:
                add = _vec(ctx.layer(s), flight)
                vecs, seqs = [], []
                for (pv, ps), sp in zip(states, S):
                    if not len(pv):
                        continue
                    step = add.copy()
                    step[_T] += ctx.cost.transition(sp, s, ctx.work(sp))
                    nv = pv + step
                    nv[:, _TRANS] = np.maximum(pv[:, _TRANS], add[_TRANS])
                    vecs.append(nv)
                    seqs.extend(q + (s,) for q in ps)
                allv = np.vstack(vecs)
                keep = _pareto(allv)
                new.append((allv[keep], [seqs[i] for i in keep]))
            states = new
        vecs, seqs = [], []
        for (pv, ps), s in zip(states, S):
            if head:
                e = ctx.ends(s, False, True)
                # Logits count once on the rank holding the head; folded into the additive memory entry.
                ev = _vec(e, flight, extra_mem=e.transient)
                ev[_TRANS] = 0.0
                pv = pv + ev
            vecs.append(pv)
            seqs.extend(ps)
        allv = np.vstack(vecs)
        keep = _pareto(allv)
        out = (allv[keep], [seqs[i] for i in keep])
        self.cache[key] = out
        return out


def _exact_rank_options(chunker: _ExactChunks, sizes, pp, v, rank):
    """(times, tails, chunk strategy tuples) of a rank's feasible, non-dominated options."""
    ctx = chunker.ctx
    n_chunks = len(sizes)
    idx = list(range(rank, n_chunks, pp))
    fronts = [chunker.frontier(sizes[i], i == 0, i == n_chunks - 1, i < pp, ctx.flight[rank]) for i in idx]
    layers = sum(sizes[i] for i in idx)
    t, u, payload = [], [], []
    for combo in product(*[range(len(f[0])) for f in fronts]):
        vec = sum(fronts[k][0][j] for k, j in enumerate(combo))
        trans = max(fronts[k][0][j][_TRANS] for k, j in enumerate(combo))
        if vec[_MEM] + trans > ctx.budget:
            continue
        t.append(vec[_T])
        u.append(_tail(ctx.cost, vec[_GS], -vec[_NBWD], vec[_OPT], layers))
        payload.append(tuple(fronts[k][1][j] for k, j in enumerate(combo)))
    return np.asarray(t), np.asarray(u), payload


_ATTRS = ("time", "bwd", "states", "act", "grad_sync", "optim", "transient")


class _FastRanks:
    """Rank options for identical layers: one mesh and ZeRO stage per rank, k of its layers recomputed.

    ``groups`` lists per (mesh, zero) the strategies without and with recomputation (either may be
    None). All groups and all k are evaluated at once as (group x k) numpy arrays from the per-layer
    LayerCost; options are cached per (layers, embed, head, in-flight) since many ranks and splits share them.
    """

    def __init__(self, ctx: _Ctx, groups):
        self.ctx, self.groups = ctx, groups
        G = len(groups)

        def table(fn):
            out = np.zeros((G, len(_ATTRS)))
            for g, pair in enumerate(groups):
                s = pair[0] or pair[1]
                c = fn(pair, s)
                if c is not None:
                    out[g] = [getattr(c, a) for a in _ATTRS]
            return out

        self.l0 = table(lambda pr, s: ctx.layer(pr[0]) if pr[0] else None)
        self.l1 = table(lambda pr, s: ctx.layer(pr[1]) if pr[1] else None)
        self.emb = table(lambda pr, s: ctx.ends(s, True, False))
        self.head = table(lambda pr, s: ctx.ends(s, False, True))
        self.has0 = np.array([p[0] is not None for p in groups])[:, None]
        self.has1 = np.array([p[1] is not None for p in groups])[:, None]
        self.p2p = np.array([ctx.p2p(p[0] or p[1]) for p in groups])[:, None]
        self.cache: dict = {}

    def options(self, sizes, pp, rank, flight):
        """(times, tails, payload) on the (time, tail) frontier; payload[i] is (group, k) (see :meth:`pick`)."""
        idx = range(rank, len(sizes), pp)
        n = sum(sizes[i] for i in idx)
        key = (n, 0 in idx, (len(sizes) - 1) in idx, flight)
        if key not in self.cache:
            self.cache[key] = self._options(*key)
        return self.cache[key]

    def pick(self, payload_item):
        g, k = payload_item
        return (self.groups[g][0], self.groups[g][1], k)

    def _options(self, n, embed, head, flight):
        ctx = self.ctx
        k = np.arange(n + 1)[None, :]
        nk = n - k
        e = self.emb * embed + self.head * head

        def tot(a):
            i = _ATTRS.index(a)
            return nk * self.l0[:, i:i + 1] + k * self.l1[:, i:i + 1] + e[:, i:i + 1]

        ti = _ATTRS.index("transient")
        trans = np.maximum(np.where(nk > 0, self.l0[:, ti:ti + 1], 0.0), np.where(k > 0, self.l1[:, ti:ti + 1], 0.0))
        logits = self.head[:, ti:ti + 1] if head else 0.0
        mem = tot("states") + flight * tot("act") + trans + logits
        valid = (self.has0 | (k == n)) & (self.has1 | (k == 0)) & (mem <= ctx.budget)
        if not valid.any():
            return np.zeros(0), np.zeros(0), []
        time_ = tot("time") + self.p2p
        tail = _tail(ctx.cost, tot("grad_sync"), tot("bwd"), tot("optim"), n)
        g, kk = np.nonzero(valid)
        t, u = time_[g, kk], tail[g, kk]
        keep = _pareto2(t, u)
        return t[keep], u[keep], list(zip(g[keep].tolist(), kk[keep].tolist()))


def _combine(options, schedule: str, m: int, v: int):
    """Best choice of one option per rank for ``pipeline_time(times) + max(tails)``; exact.

    For a bound U on the largest tail, each rank's best option is its fastest one with tail <= U
    (the step time grows with every rank's time), so sweeping U over every tail value finds the
    optimum. Options arrive as per-rank (times, tails) already reduced to their Pareto frontier.
    Returns (objective, per-rank option index) or None when some rank has no option.
    """
    if any(len(t) == 0 for t, _ in options):
        return None
    all_u = np.unique(np.concatenate([u for _, u in options]))
    # The step is feasible only once every rank has an option with tail <= U.
    lo = max(u.min() for _, u in options)
    all_u = all_u[all_u >= lo]
    picks = []
    for t, u in options:
        # Frontier: t ascending, u descending; the first index with u <= U is the fastest allowed.
        j = np.searchsorted(-u, -all_u, side="left")
        picks.append(j)
    picks = np.stack(picks)  # ranks x len(all_u)
    times = np.stack([t[p] for (t, _), p in zip(options, picks)])
    tails = np.stack([u[p] for (_, u), p in zip(options, picks)])
    obj = pipeline_times(schedule, times.T, m, v) + tails.max(axis=0)
    c = int(np.argmin(obj))
    return float(obj[c]), picks[:, c]


# ---- the search ----------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def outer_configurations(model: ModelSpec, world: int, global_batch: int, space: SearchSpace):
    """(pp, schedule, v, m) tuples the search examines.

    pp = 1 runs only as 1F1B (gradient accumulation; GPipe holds more and interleaving needs pp > 1);
    interleaving uses two chunks per rank and, as Megatron requires, m divisible by pp.
    """
    pps = space.pp or [p for p in _pow2_upto(min(world, model.num_layers)) if world % p == 0]
    for pp in pps:
        if world % pp or pp > model.num_layers:
            continue
        for schedule in space.schedules:
            if pp == 1 and schedule != "1f1b":
                continue
            v = 2 if schedule == "interleaved" else 1
            if model.num_layers < pp * v:
                continue
            for m in space.microbatches or _divisors(global_batch):
                if global_batch % m or (schedule == "interleaved" and m % pp):
                    continue
                yield pp, schedule, v, m


def _splits(cost: CostModel, ctx: _Ctx, strategies, L: int, k: int, exact: bool):
    if exact or count_compositions(L, k) <= MAX_EXACT_SPLITS:
        return list(compositions(L, k))
    # Balance by time (the last chunk also runs the head, the first the embedding) and by memory
    # (early 1F1B ranks hold more micro-batches), with a reference strategy: the least-memory one.
    ref = min(strategies, key=lambda s: (ctx.layer(s).states + ctx.layer(s).act, ctx.layer(s).time))
    lt = ctx.layer(ref).time
    extra = [0.0] * k
    extra[0] += ctx.ends(ref, True, False).time / lt
    extra[-1] += ctx.ends(ref, False, True).time / lt
    pp = ctx.pp
    by_time = balance(L, k, extra)
    lc = ctx.layer(ref)
    mem_w = [lc.states + ctx.flight[i % pp] * lc.act for i in range(k)]
    mem_extra = [0.0] * k
    mem_extra[-1] = ctx.ends(ref, False, True).transient
    by_mem = balance(L, k, mem_extra, mem_w)
    seeds = {even_split(L, k), by_time, by_mem}
    out = set(seeds)
    for s in seeds:
        out.update(neighbours(s))
    return sorted(out)


def _expand_fast(payload, sizes, pp):
    """Per-chunk strategy tuples from per-rank (no_ac, ac, k): the first k layers of a rank recompute."""
    chunks: list[tuple] = [()] * len(sizes)
    for rank, (s0, s1, k) in enumerate(payload):
        left = k
        for i in range(rank, len(sizes), pp):
            a = min(left, sizes[i])
            chunks[i] = (s1,) * a + (s0,) * (sizes[i] - a)
            left -= a
    return chunks


def _to_plan(model, cluster, cost, chunks, pp, schedule, v, m, seq_len, global_batch, ev) -> Plan:
    stages, start = [], 0
    for st in chunks:
        stages.append(StagePlan(start, start + len(st), tuple(st)))
        start += len(st)
    return Plan(model=model.name, cluster=cluster.label, world_size=cluster.world_size, pp=pp, pipeline_schedule=schedule,
                num_microbatches=m, seq_len=seq_len, global_batch=global_batch, stages=tuple(stages),
                virtual_stages=v, predicted=ev.to_dict(), cost_source=cost.source)


def evaluate_chunks(cost: CostModel, chunks, pp, schedule, v, m, seq_len, global_batch) -> Evaluation:
    return cost.evaluate_stages(chunks, pp, schedule, m, v, global_batch // m, seq_len)


def search(model: ModelSpec, cluster: ClusterSpec, seq_len: int, global_batch: int,
           space: SearchSpace = SearchSpace(), cost: CostModel | None = None, top: int = 5,
           mode: str = "auto", with_baselines: bool = True, explain_no_fit: bool = True,
           progress: Callable[[int, int], None] | None = None) -> SearchResult:
    """Find the fastest plans that fit; best first. Raises PlanError when none fits.

    ``mode``: "exact" (layer DP + every split), "fast" (closed form per rank + balanced splits) or
    "auto" (exact for at most 6 layers and a small strategy set, see EXACT_MAX_STRATEGIES).
    """
    from flexmesh.plan.baselines import megatron_3d, zero3_ulysses  # baselines import this module

    t0 = time.perf_counter()
    if seq_len < 1 or global_batch < 1:
        raise PlanError(f"--seq-len and --global-batch must be positive, got {seq_len} and {global_batch}")
    cost = cost or CostModel(model, cluster)
    world = cluster.world_size
    if mode == "auto":
        # The exact DP's frontiers grow quickly with the number of strategies; keep it to small spaces.
        small = len(candidate_strategies(model, cluster, world, space)) <= EXACT_MAX_STRATEGIES
        mode = "exact" if model.num_layers <= 6 and small else "fast"
    if mode not in ("exact", "fast"):
        raise PlanError(f"search mode must be exact, fast or auto, got {mode!r}")
    configs = list(outer_configurations(model, world, global_batch, space))
    if not configs:
        raise PlanError(
            f"no pipeline/micro-batch layout for world size {world} with {model.num_layers} layers and global "
            f"batch {global_batch}: use a power-of-two device count or a global batch divisible by it")
    if not any(candidate_strategies(model, cluster, world // pp, space, global_batch // m)
               for pp, _, _, m in configs):
        raise PlanError(
            f"world size {world} cannot be factored into pp x tp x cp x dp for {model.name} ({model.num_heads} "
            f"heads) with global batch {global_batch}: dp must divide the sequences of a micro-batch and tp/cp "
            f"are powers of two; use a power-of-two device count or a global batch divisible by {world}")
    found: list[tuple[float, tuple]] = []  # best (estimate, plan pieces) per (pp, schedule, m, mesh)
    examined = 0
    pruned_cache: dict = {}
    fast_cache: dict = {}
    for ci, (pp, schedule, v, m) in enumerate(configs):
        if progress:
            progress(ci, len(configs))
        D, mbs = world // pp, global_batch // m
        strategies = candidate_strategies(model, cluster, D, space, mbs)
        if not strategies:
            continue
        flight = tuple(in_flight(schedule, pp, r, m, v) for r in range(pp))
        ctx = _Ctx(cost, seq_len, mbs, pp, v, flight, cost.memory_budget)
        meshes = sorted({_mesh(s) for s in strategies}) if space.same_mesh else [None]
        for mesh in meshes:
            if (D, mbs, mesh) not in pruned_cache:
                pruned_cache[D, mbs, mesh] = _prune(ctx, [s for s in strategies if mesh is None or _mesh(s) == mesh])
            pruned = pruned_cache[D, mbs, mesh]
            if mode == "exact":
                chunker = _ExactChunks(ctx, pruned)
            else:
                if (pp, v, mbs, mesh) not in fast_cache:
                    fast_cache[pp, v, mbs, mesh] = _FastRanks(ctx, _groups(pruned))
                fast = fast_cache[pp, v, mbs, mesh]
            best = None
            for sizes in _splits(cost, ctx, pruned, model.num_layers, pp * v, mode == "exact"):
                examined += 1
                options, payloads = [], []
                for r in range(pp):
                    if mode == "exact":
                        t, u, pay = _exact_rank_options(chunker, sizes, pp, v, r)
                        keep = _pareto2(t, u) if len(t) else []
                        t, u, pay = t[keep], u[keep], [pay[i] for i in keep]
                    else:
                        t, u, pay = fast.options(sizes, pp, r, flight[r])
                    if not len(t):
                        break
                    options.append((t, u))
                    payloads.append(pay)
                else:
                    res = _combine(options, schedule, m, v)
                    if res is not None and (best is None or res[0] < best[0]):
                        best = (res[0], sizes, [payloads[r][int(j)] for r, j in enumerate(res[1])])
            if best is None:
                continue
            obj, sizes, chosen = best
            if mode == "exact":
                chunks = [None] * len(sizes)
                for r, pay in enumerate(chosen):
                    for k, i in enumerate(range(r, len(sizes), pp)):
                        chunks[i] = pay[k]
            else:
                chunks = _expand_fast([fast.pick(c) for c in chosen], sizes, pp)
            found.append((obj, (tuple(map(tuple, chunks)), pp, schedule, v, m)))
    if progress:
        progress(len(configs), len(configs))
    found.sort(key=lambda x: x[0])
    results: list[Candidate] = []
    seen = set()
    for obj, (chunks, pp, schedule, v, m) in found:
        if len(results) >= max(top, 1) * 3:
            break
        ev = evaluate_chunks(cost, chunks, pp, schedule, v, m, seq_len, global_batch)
        if not ev.fits:
            continue
        plan = _to_plan(model, cluster, cost, chunks, pp, schedule, v, m, seq_len, global_batch, ev)
        if plan.layout in seen:
            continue
        seen.add(plan.layout)
        results.append(Candidate(plan, ev, "search", obj))
    baselines: dict[str, Candidate | None] = {}
    if with_baselines:
        baselines = {"megatron-3d": megatron_3d(model, cluster, seq_len, global_batch, cost, space),
                     "zero3-ulysses": zero3_ulysses(model, cluster, seq_len, global_batch, cost, space)}
        for name, b in baselines.items():
            if b is not None and b.plan.layout not in seen:
                results.append(replace(b, origin=name))
                seen.add(b.plan.layout)
    results.sort(key=lambda c: c.evaluation.step_time)
    if not results:
        if not explain_no_fit:
            raise PlanError(f"no plan fits on {cluster.label} at seq len {seq_len}")
        raise PlanError(no_fit_message(model, cluster, seq_len, global_batch, space, cost))
    return SearchResult(plans=results[:top], search_seconds=time.perf_counter() - t0, mode=mode,
                        configurations=examined, baselines=baselines)


def _prune(ctx: _Ctx, strategies: list[LayerStrategy]) -> list[LayerStrategy]:
    """Drop strategies another one of the same mesh beats in every cost entry, as a layer and as an end.

    Same mesh means identical transitions and pipeline sends, so a dominated strategy can be swapped
    for its dominator anywhere without making the step slower or larger (e.g. ZeRO-1 over ZeRO-0).
    """
    def key(s):
        parts = [ctx.layer(s), ctx.ends(s, True, False), ctx.ends(s, False, True)]
        return [x for c in parts for x in (c.time, c.states, c.act, c.transient, c.grad_sync, c.optim, -c.bwd)]

    by_mesh: dict[tuple, list[LayerStrategy]] = {}
    for s in sorted(strategies):
        by_mesh.setdefault(_mesh(s), []).append(s)
    out = []
    for group in by_mesh.values():
        keys = np.array([key(s) for s in group])
        for i, s in enumerate(group):
            le = np.all(keys <= keys[i], axis=1)
            lt = np.any(keys < keys[i], axis=1)
            le[i] = False
            # Equal keys: keep only the first in strategy order.
            if not (le & (lt | (np.arange(len(group)) < i))).any():
                out.append(s)
    return out


def _groups(strategies: list[LayerStrategy]):
    """(without, with) recomputation per (mesh, zero) for the fast mode."""
    by: dict[tuple, list] = {}
    for s in strategies:
        by.setdefault((_mesh(s), s.zero), [None, None])[int(s.recompute)] = s
    return [tuple(v) for v in by.values()]


def no_fit_message(model: ModelSpec, cluster: ClusterSpec, seq_len: int, global_batch: int,
                   space: SearchSpace, cost: CostModel) -> str:
    """Why nothing fits, and the smallest of the usual relaxations that makes a plan fit."""
    head = (f"no plan of {model.name} fits on {cluster.label} ({cost.memory_budget / GIB:.1f} GiB usable per device) "
            f"at seq len {seq_len}, global batch {global_batch}")
    tries: list[tuple[str, Callable[[], SearchResult]]] = []
    if True not in space.recompute:
        tries.append(("enable recomputation (drop --no-recompute)",
                      lambda: search(model, cluster, seq_len, global_batch, replace(space, recompute=(False, True)),
                                     top=1, with_baselines=False, explain_no_fit=False, mode="fast")))
    if space.same_mesh:
        tries.append(("let layers use different meshes (drop --same-mesh)",
                      lambda: search(model, cluster, seq_len, global_batch, replace(space, same_mesh=False),
                                     top=1, with_baselines=False, explain_no_fit=False, mode="fast")))
    bigger = cluster.with_devices(cluster.nodes * 2, cluster.devices_per_node)
    tries.append((f"use twice the devices (--cluster {bigger.label})",
                  lambda: search(model, bigger, seq_len, global_batch, space, top=1, with_baselines=False,
                                 explain_no_fit=False, mode="fast")))
    if seq_len > 1:
        tries.append((f"halve the sequence length (--seq-len {seq_len // 2})",
                      lambda: search(model, cluster, seq_len // 2, global_batch, space, top=1, with_baselines=False, explain_no_fit=False,
                                     mode="fast")))
    for what, attempt in tries:
        try:
            r = attempt()
        except PlanError:
            continue
        return f"{head}; smallest change that fits: {what} (best plan then: {r.best.plan.layout})"
    return f"{head}; even with twice the devices or half the sequence length nothing fits: use a larger device or a smaller model"
