"""Replica configurations and what one replica of each serves per bucket at the SLO.

A configuration is a model on a device group of the cluster at ``tp x pp`` in a role (aggregated, prefill or
decode) with its engine knobs (:func:`configurations`: every one whose weights and activations leave room for
a KV cache; pipelining only where a node's tp is reached, as in this pricing a pipeline runs one batch at a
time and buys memory, not speed). The knobs tried: the batched-token budget of aggregated and prefill
replicas (:data:`BATCH_BUDGETS`: a smaller one shortens every iteration, hence the wait of a request that
arrives during one, at the price of smaller batches), and for decode replicas vLLM's ``max_seqs`` and the
largest of its defaults (decode batches are bound by it on devices whose default is 256).

Its **capacity** for a bucket is the highest rate of that bucket's requests one replica serves in steady
state with its estimates of the SLO's metrics within their bounds (:func:`capacity`), priced by the
replica's :class:`~flexmesh.cost.inference.analytic.AnalyticIteration` (the simulator's own cost terms).
With mean prompt ``p``, mean output ``o`` (``s = o - 1`` decode steps after the first token) and mean
context ``c = p + o / 2`` while decoding, at ``B`` requests decoding at once:

- **aggregated**: an iteration decodes ``B`` tokens and prefills the ``B p / s`` tokens that keep the batch
  full (Little's law: ``B = rate x s x t``); ``t = T(B decodes over B c keys, prefill chunks)``; the rate is
  ``B / (s t)``. TPOT is an iteration at the quantile batch with the mean prefill (a request's TPOT
  averages the iterations it decodes in, which smooths the prefill that comes and goes, not the batch, which
  changes slowly); TTFT is the wait for the iteration under way when the request arrives plus
  the iterations its prompt (the bucket's quantile prompt) needs in the budget the decodes leave; E2E adds
  ``s`` iterations at the quantile output. A request arriving at random during an iteration waits a uniform
  share of it, so at the attainment quantile ``q`` it waits ``q t``;
- **prefill**: ``k`` prompts per iteration (within the batched-token budget), rate ``k / t``, TTFT ``q t``
  plus an iteration holding the quantile prompt;
- **decode**: ``B`` decodes, ``t = T(B, B c)``, rate ``B / (s t)``, TPOT ``t``.

Requests arrive at random, so the batch a replica holds and the prompts an iteration takes vary: at the
attainment quantile ``q`` a Poisson count of mean ``n`` is ``n + z sqrt(n)`` (its normal approximation, ``z``
the standard normal quantile), and the KV of that many requests ``n c + z sqrt(n E[c^2])`` (a compound Poisson
sum over the bucket's contexts). Each is bounded by the KV cache at the quantile batch (plus a prompt in
flight), ``max_seqs`` and the batched-token budget (on average: a prompt that does not fit waits an
iteration, which its TTFT counts). Every estimate rises with ``B`` (or ``k``) and so does the rate, so the
capacity is at the largest feasible one (bisection). Queueing beyond the iteration under way is not in these
estimates: the simulator judges the plans (:mod:`flexmesh.serve.plan.search`).

>>> from flexmesh.serve.layout.slo import SLO
>>> from flexmesh.serve.plan.workload import parse_buckets
>>> from flexmesh.spec import parse_model
>>> from flexmesh.spec.cluster import parse_mixed_cluster
>>> b = parse_buckets("1000:200=1")
>>> cfgs = configurations((parse_model("llama3.1-8b"),), parse_mixed_cluster("8xH100"), b.longest)
>>> agg = next(c for c in cfgs if c.tp == 1 and c.role == Role.AGGREGATED)
>>> cap = Pricing((parse_model("llama3.1-8b"),), parse_mixed_cluster("8xH100")).capacity(agg, b.buckets[0],
...                                                                                       SLO(ttft_s=1, tpot_s=0.05))
>>> round(cap.rate, 1), cap.bound, cap.tpot_s <= 0.05
(26.8, 'budget', True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import Protocol

from flexmesh.cost.device.hardware import Hardware
from flexmesh.cost.inference.analytic import AnalyticIteration
from flexmesh.cost.inference.memory import FULL_ATTENTION, KVGroups, check_tp, kv_capacity, kv_groups, served_dtype
from flexmesh.cost.inference.overhead import EngineOverhead
from flexmesh.errors import FlexmeshError
from flexmesh.serve.layout.buckets import Bucket
from flexmesh.serve.layout.engine import EngineSpec, engine_spec
from flexmesh.serve.layout.knobs import EngineKnobs
from flexmesh.serve.layout.roles import Role
from flexmesh.serve.layout.slo import SLO
from flexmesh.spec.cluster import MixedCluster
from flexmesh.spec.model import ModelSpec

# Tensor-parallel degrees tried: powers of two up to a node (vLLM splits heads evenly).
TP_DEGREES = (1, 2, 4, 8, 16)
# Pipeline degrees tried where a node's tp is reached.
PP_DEGREES = (2, 4)
# Batched-token budgets (vLLM max_num_batched_tokens) tried for aggregated and prefill replicas: vLLM's two
# defaults (2048, 8192) and half the smaller (shorter iterations for a tight TTFT).
BATCH_BUDGETS = (1024, 2048, 8192)
# Token (request) counts whose count-only terms an iteration timing prices at once (AnalyticIteration's block):
# the bisections ask for several hundred counts scattered up to the batched-token budget.
COUNT_BLOCK = 1024
# The relative tolerance of a capacity (the bisection's): two estimates nearer than this are not told apart.
CAPACITY_TOL = 0.02
# Decode replicas' max_seqs tried: vLLM's two defaults (256 on most devices, 1024 on large ones).
DECODE_SEQS = (256, 1024)


@dataclass(frozen=True)
class ReplicaConfig:
    """One kind of replica: a model (by its index: a tier) on a device group, ``tp x pp``, a role, engine knobs,
    and the KV tokens its cache holds there."""

    model: int
    group: int
    tp: int
    pp: int
    role: Role
    knobs: EngineKnobs
    kv_tokens: int  # what its KV cache holds in KVGroups.held's tokens (its tokens where no layer slides)

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))  # a role's name given is the role

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """What its weights are (model, group, tp, pp): a replica changes role without moving them."""
        return (self.model, self.group, self.tp, self.pp)

    @property
    def key(self) -> tuple[int, int, int, int, Role, int, int]:
        """What tells configurations apart: shape, role, batched-token budget, max_seqs."""
        return (*self.shape, self.role, self.knobs.max_batched_tokens, self.knobs.max_seqs)

    @property
    def label(self) -> str:
        pp = f"pp{self.pp}" if self.pp > 1 else ""
        role = "" if self.role == Role.AGGREGATED else f"-{self.role}"
        return f"tp{self.tp}{pp}{role}"


def knob_variants(role: str, base: EngineKnobs) -> list[EngineKnobs]:
    """The engine knobs tried for a role (see the module doc), from the device's defaults ``base``."""
    if role == Role.DECODE:
        return [replace(base, max_seqs=n, max_batched_tokens=max(base.max_batched_tokens, n))
                for n in sorted({*DECODE_SEQS, base.max_seqs})]
    return [replace(base, max_batched_tokens=b, max_seqs=min(base.max_seqs, b))
            for b in sorted({*BATCH_BUDGETS, base.max_batched_tokens})]


@dataclass(frozen=True)
class Capacity:
    """What one replica of a configuration serves of one bucket: ``rate`` requests per second (0 when it
    cannot meet the SLO or hold the requests), at ``batch`` requests decoding at once (prefill: prompts per
    iteration) and iterations of ``iteration_s``, with the SLO metrics as estimated there, and what bounds it
    (``tpot``, ``ttft``, ``e2e``, ``kv``, ``max-seqs``, ``budget``; ``fit`` where nothing is feasible)."""

    rate: float
    batch: float  # mean requests decoding at once (prefill: prompts arriving per iteration)
    iteration_s: float
    ttft_s: float
    tpot_s: float
    bound: str


NONE = Capacity(0.0, 0.0, 0.0, math.inf, math.inf, "fit")


def configurations(models: Sequence[ModelSpec], cluster: MixedCluster, longest: int | Sequence[int],
                   roles: Sequence[Role] = tuple(Role), knobs: dict[int, EngineKnobs] | None = None,
                   groups: Sequence[int] | None = None, engine: EngineSpec | None = None) -> list[ReplicaConfig]:
    """Every configuration of ``models`` on the cluster's device ``groups`` (default all) in ``roles`` whose KV
    cache holds at least a block, with the knob variants of its role (:func:`knob_variants` of the ``engine``'s
    default knobs, current vLLM's by default; ``knobs`` given for a group: those only). ``longest`` is for
    reporting: a configuration holding fewer tokens is kept, its capacity for longer buckets 0."""
    out = []
    engine = engine_spec(engine)
    for m, model in enumerate(models):
        for g, group in enumerate(cluster.groups):
            if groups is not None and g not in groups:
                continue
            k = (knobs or {}).get(g) or engine.knobs(group.device, model.max_position)
            node = min(group.devices_per_node, group.world_size)
            for tp in TP_DEGREES:
                if tp > node:
                    break
                try:
                    check_tp(model, tp)
                except FlexmeshError:
                    continue
                for pp in (1, *(PP_DEGREES if tp == node else ())):
                    if tp * pp > group.world_size or pp > model.num_layers:
                        continue
                    for role in roles:
                        for kk in (knob_variants(role, k) if knobs is None or g not in knobs else [k]):
                            try:
                                cap = kv_capacity(model, group.device, tp, pp, kk.max_batched_tokens, kk.max_seqs,
                                                  kk.block_tokens, kk.memory_fraction)
                            except FlexmeshError:
                                continue
                            if kk.kv_blocks is not None:
                                cap = replace(cap, blocks_given=kk.kv_blocks)
                            out.append(ReplicaConfig(m, g, tp, pp, role, kk, kv_groups(model).room(cap)))
    return out


class _Iterations:
    """An iteration timing whose answers are kept: the bisections of one weights shape's configurations (its
    roles and knob variants) over the buckets ask for many of the same iterations."""

    def __init__(self, timing: AnalyticIteration):
        self.timing = timing
        self._seen: dict[tuple, float] = {}

    def split_s(self, decodes: int, decode_context: int, chunks: Sequence[tuple[int, int]]) -> float:
        key = (decodes, decode_context, *chunks)
        got = self._seen.get(key)
        if got is None:
            got = self._seen[key] = self.timing.split_s(decodes, decode_context, chunks)
        return got


class Pricing:
    """Capacities of configurations (their iteration timings built once per model, group, tp and pp, and each
    iteration priced once)."""

    def __init__(self, models: Sequence[ModelSpec], cluster: MixedCluster, overhead: EngineOverhead | None = None,
                 quantile: float = 0.9, engine: EngineSpec | str | None = None):
        self.models, self.cluster, self.quantile = tuple(models), cluster, quantile
        self.engine = engine_spec(engine)  # what the replicas run (its prices); ``overhead`` in place of its own
        if overhead is not None:
            self.engine = replace(self.engine, overhead=overhead)
        self.overhead = self.engine.overhead
        self._timing: dict[tuple[int, int, int, int], AnalyticIteration] = {}
        self._hw: dict[tuple[int, int], Hardware] = {}
        self._memo: dict[tuple, Capacity] = {}
        self._iterations: dict[tuple[int, int, int, int], _Iterations] = {}

    def timing(self, c: ReplicaConfig) -> AnalyticIteration:
        t = self._timing.get(c.shape)
        if t is None:
            model = self.models[c.model]
            hw = self._hw.get((c.model, c.group))
            if hw is None:
                g = self.cluster.groups[c.group]
                hw = self._hw[c.model, c.group] = Hardware(g, served_dtype(model.dtype, g.device))
            t = self._timing[c.shape] = self.engine.iteration(model, hw, c.tp, c.pp, block=COUNT_BLOCK)
        return t

    def capacity(self, c: ReplicaConfig, b: Bucket, slo: SLO) -> Capacity:
        key = (c, b, slo)
        got = self._memo.get(key)
        if got is None:
            it = self._iterations.get(c.shape)
            if it is None:
                it = self._iterations[c.shape] = _Iterations(self.timing(c))
            got = self._memo[key] = capacity(it, c, b, slo, self.quantile, kv_groups(self.models[c.model]))
        return got

    def table(self, configs: Sequence[ReplicaConfig], buckets: Sequence[Bucket], slo: SLO) -> list[list[Capacity]]:
        """``[config][bucket]`` capacities."""
        return [[self.capacity(c, b, slo) if b.share > 0 else NONE for b in buckets] for c in configs]


def _largest(feasible: Callable[[float], bool], hi: float, lo: float = 1e-2, rel_tol: float = CAPACITY_TOL) -> float:
    """The largest ``n`` in ``[lo, hi]`` with ``feasible(n)`` (which holds up to some point, then not), within
    ``rel_tol`` (bisection in log space); 0 if none."""
    if hi < lo or not feasible(lo):
        return 0.0
    if feasible(hi):
        return hi
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        if feasible(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _prefill_chunks(tokens: float, prompt: float) -> list[tuple[int, int]]:
    """``tokens`` of prefill as whole prompts of ``prompt`` tokens and a remainder (each its own attention)."""
    p = max(1, round(prompt))
    whole, rest = divmod(max(0, round(tokens)), p)
    return [(0, p)] * whole + ([(0, rest)] if rest > 1 else [])


class _SplitTiming(Protocol):
    def split_s(self, decodes: int, decode_context: int, chunks: Sequence[tuple[int, int]]) -> float: ...


def _prompt_s(t: _SplitTiming, prompt: int, room: int, decodes: int, context: int) -> tuple[int, float]:
    """Iterations and seconds to compute a ``prompt`` in chunks of at most ``room`` tokens beside ``decodes``
    decoding requests of ``context`` keys in all: its whole chunks each priced at their mean context (every
    term but attention's efficiency is affine in it), then the rest."""
    room = max(1, room)
    whole, rest = divmod(prompt, room)
    secs = 0.0
    if whole:
        secs = whole * t.split_s(decodes, context, [((whole - 1) * room // 2, room)])
    if rest:
        secs += t.split_s(decodes, context, [(whole * room, rest)])
    return whole + (1 if rest else 0), secs


def capacity(t: _SplitTiming, c: ReplicaConfig, b: Bucket, slo: SLO, quantile: float = 0.9,
             groups: KVGroups = FULL_ATTENTION) -> Capacity:
    """One replica of ``c`` serving bucket ``b`` within ``slo`` at the attainment ``quantile`` (see the module
    doc), priced by ``t``; a model whose layers slide (``groups``) holds and reads at most its window of them."""
    if b.share <= 0 or groups.held(b.longest) > c.kv_tokens:
        return NONE
    judge = _Judge(t, c, b, slo, quantile, groups)
    if c.role == Role.PREFILL or (c.role == Role.AGGREGATED and judge.s < 1e-9):
        return judge.prefill_capacity()
    if c.role == Role.DECODE:
        return judge.decode_capacity()
    return judge.aggregated_capacity()


class _Judge:
    """Whether one replica of a configuration serves ``n`` of a bucket's requests (in prefill, decoding or both, by
    its role) within the SLO at the quantile, and what bound binds first (module doc); the figures of the last
    ``record``ed rate kept (its iteration, rate, TTFT, TPOT)."""

    def __init__(self, t: _SplitTiming, c: ReplicaConfig, b: Bucket, slo: SLO, quantile: float,
                 groups: KVGroups = FULL_ATTENTION):
        k = c.knobs
        self.t = t
        self.p, self.p_hi = max(1.0, b.prompt_mean), max(1, b.prompt_high)
        self.s, self.s_hi = max(0.0, b.output_mean - 1), max(0, b.output_high - 1)
        # the KV a request holds and its decodes read: its context, at most the window in sliding layers (the
        # spread scaled alike); the prompts' KV likewise
        self.ctx = groups.held(b.context)
        self.spread = b.context_spread * (self.ctx / b.context if b.context > 0 else 1.0)
        self.kv_p, self.kv_p_hi = groups.held(self.p), groups.held(self.p_hi)
        self.budget, self.seqs, self.kv = k.max_batched_tokens, k.max_seqs, c.kv_tokens
        self.ttft_bound = slo.ttft_s if slo.ttft_s is not None else math.inf
        self.tpot_bound = slo.tpot_s if slo.tpot_s is not None else math.inf
        self.e2e_bound = slo.e2e_s if slo.e2e_s is not None else math.inf
        self.quantile = quantile
        self.z = NormalDist().inv_cdf(quantile) if quantile < 1 else 3.0
        self.why: str | None = None  # the bound the last failing check met
        self.it = self.rate = self.ttft = self.tpot = 0.0  # the recorded figures

    def hi(self, n: float) -> float:
        """A Poisson count of mean ``n`` at the quantile (its normal approximation)."""
        return n + self.z * math.sqrt(n)

    def kv_hi(self, n: float) -> float:
        """The KV tokens of a Poisson number (mean ``n``) of requests of the bucket's contexts at the quantile: a
        compound Poisson sum's mean ``n c`` and its deviation ``sqrt(n E[c^2])``."""
        return n * self.ctx + self.z * math.sqrt(n) * self.spread

    def fail(self, why: str) -> bool:
        self.why = why
        return False

    def none(self) -> Capacity:
        return Capacity(0.0, 0.0, 0.0, math.inf, math.inf, self.why or "fit")

    # ---- prefill: n prompts arriving per iteration (mean); a prompt longer than the budget takes several
    # iterations alone, and then n is the prompts arriving while one is computed ----
    def prefill(self, n: float, record: bool = False) -> bool:
        t, p, p_hi, budget, q = self.t, self.p, self.p_hi, self.budget, self.quantile
        n_hi = self.hi(n)
        if n_hi > self.seqs or (n_hi - 1) * self.kv_p + self.kv_p_hi > self.kv:
            return self.fail("max-seqs" if n_hi > self.seqs else "kv")
        if p > budget:
            if n_hi > 1:
                return self.fail("budget")
            if record:
                full = _prompt_s(t, round(p), budget, 0, 0)[1]
                self.it, self.rate = full, n / full
            own = _prompt_s(t, p_hi, budget, 0, 0)[1]
            ttft = q * own + own
        else:
            if n_hi * p > budget and n_hi > 1:
                return self.fail("budget")
            if record:  # a busy iteration holds one prompt at least
                full = t.split_s(0, 0, _prefill_chunks(max(n, 1.0) * p, p))
                self.it, self.rate = full, n / full
            room = budget - round(max(0.0, n_hi - 1) * p)
            if room >= p_hi:
                own = t.split_s(0, 0, _prefill_chunks(max(0.0, n_hi - 1) * p, p) + [(0, p_hi)])
            else:
                own = _prompt_s(t, p_hi, budget, 0, 0)[1]
            ttft = q * own + own
        self.ttft = ttft
        if ttft > min(self.ttft_bound, self.e2e_bound):
            return self.fail("ttft" if self.ttft_bound <= self.e2e_bound else "e2e")
        return True

    def prefill_capacity(self) -> Capacity:
        top = 1.0 if self.p > self.budget else self.budget / self.p
        n = _largest(self.prefill, top)
        if n <= 0:
            return self.none()
        self.prefill(n)
        bound = "budget" if n >= top else (self.why or "budget")
        self.prefill(n * 1.02)
        bound = self.why or bound
        self.prefill(n, record=True)
        return Capacity(self.rate, n, self.it, self.ttft, 0.0, bound)

    # ---- decode: n requests decoding ----
    def decode(self, n: float, record: bool = False) -> bool:
        t, ctx = self.t, self.ctx
        n_hi = self.hi(n)
        if n_hi > self.seqs or self.kv_hi(n) + self.kv_p_hi > self.kv:
            return self.fail("max-seqs" if n_hi > self.seqs else "kv")
        tpot = t.split_s(max(1, round(n_hi)), round(n_hi * ctx), [])
        if record:
            self.it, self.tpot = t.split_s(max(1, round(n)), round(n * ctx), []), tpot
        if tpot > self.tpot_bound:
            return self.fail("tpot")
        if self.s_hi * tpot > self.e2e_bound:  # its decoding alone within the end-to-end bound
            return self.fail("e2e")
        return True

    def decode_capacity(self) -> Capacity:
        n = _largest(self.decode, float(self.seqs))
        if n <= 0:
            return self.none()
        self.decode(n * 1.02)
        bound = self.why or "max-seqs"
        self.decode(n, record=True)
        s, it = self.s, self.it
        return Capacity(n / (s * it) if s > 0 else math.inf, n, it, 0.0, self.tpot, bound)

    # ---- aggregated: n requests decoding, and the prompts arriving meanwhile ----
    def aggregated(self, n: float, record: bool = False) -> bool:
        t, p, ctx, budget = self.t, self.p, self.ctx, self.budget
        n_hi, a = self.hi(n), n / self.s  # decoding requests; requests arriving per iteration
        a_hi = self.hi(a)
        if n_hi > self.seqs or self.kv_hi(n) + self.kv_p_hi > self.kv:
            return self.fail("max-seqs" if n_hi > self.seqs else "kv")
        if n + a * p > budget:  # the prefill that keeps the batch full fits the budget on average
            return self.fail("budget")
        tpot = t.split_s(max(1, round(n_hi)), round(n_hi * ctx), _prefill_chunks(a * p, p))
        if tpot > self.tpot_bound:
            return self.fail("tpot")
        it_hi = t.split_s(max(1, round(n_hi)), round(n_hi * ctx), _prefill_chunks(min(a_hi * p, budget - n_hi), p))
        if record:
            self.it, self.tpot = t.split_s(max(1, round(n)), round(n * ctx), _prefill_chunks(a * p, p)), tpot
        # The prompts that arrived with it take their room first; when they fill the budget it waits an iteration.
        room = budget - n_hi - max(0.0, a_hi - 1) * p
        wait = 0.0
        if room < 1:
            wait, room = it_hi, budget - n_hi
        if room < 1:
            return self.fail("budget")
        _, own = _prompt_s(t, self.p_hi, int(room), max(1, round(n_hi)), round(n_hi * ctx))
        ttft = self.quantile * it_hi + wait + own
        self.ttft = ttft
        if ttft > self.ttft_bound:
            return self.fail("ttft")
        if ttft + self.s_hi * tpot > self.e2e_bound:
            return self.fail("e2e")
        return True

    def aggregated_capacity(self) -> Capacity:
        n = _largest(self.aggregated, float(self.seqs))
        if n <= 0:
            return self.none()
        self.aggregated(n * 1.02)
        bound = self.why or "max-seqs"
        self.aggregated(n, record=True)
        return Capacity(n / (self.s * self.it), n, self.it, self.ttft, self.tpot, bound)
