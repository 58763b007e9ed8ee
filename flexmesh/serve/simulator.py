"""The request simulator: a deterministic discrete-event simulation of a fleet of replicas serving a workload.

Events: a request arrives and is routed (over the aggregated and prefill replicas), a replica's iteration
ends (:class:`~flexmesh.serve.replica.SimulatedReplica`: tokens computed, requests finished or handed off,
the next iteration scheduled at once), a KV transfer lands (prefill/decode disaggregation: the prefill
replica frees the request's blocks, the decode replica decodes it). A prefill replica emits the first token
(TTFT ends there, as DistServe and Splitwise count it); a decode replica chosen by the router at that moment
admits the request when it has room for its KV, fetches it over the link between the two replicas
(:mod:`flexmesh.cost.inference.transfer`), then decodes.

Several models (``tier``): each replica serves one model of the fleet's (its spec's ``tier``) and a request
goes to the replicas of its tier. In a **cascade** (``cascade=True``) the models are stages in order: a
request of tier ``k`` is served by models ``0, 1, ..., k`` one after another (its tier: how far it is
escalated), each stage starting when the one before has finished (a judge read its answer); its record is
the last stage's, from its arrival (TTFT and E2E include the stages before).

One :class:`FleetRun` a run: the replicas' state, the routers and a heap of events, each handled by one
method (``on_iteration_end``, ``on_transfer_done``; arrivals come in order from the workload, ``on_arrival``).
Ties in time go to arrivals, then to events in the order they were made: the same inputs give the same
records, bit for bit. What a replica admits each iteration is its engine's scheduler's
(:mod:`flexmesh.serve.schedulers`, the ``engine``'s); its iterations are priced by a declared
:class:`~flexmesh.serve.replica.ReplicaTiming` built once from each replica's ``IterationTiming``.

>>> from flexmesh.data.requests import constant_lengths, with_arrivals
>>> from flexmesh.serve.layout.replicas import parse_replicas, place
>>> from flexmesh.serve.metrics import summarize
>>> from flexmesh.spec import parse_model
>>> from flexmesh.spec.cluster import parse_mixed_cluster
>>> c = parse_mixed_cluster("2xH100")
>>> fleet = Fleet(parse_model("llama3-8b"), c, place(parse_replicas("2xtp1", c), c))
>>> out = fleet.run(with_arrivals(constant_lengths(2000, 100), rate=12.0, n=200))
>>> len(out.records), sorted({r.replica for r in out.records})
(200, [0, 1])
>>> s = summarize(out.records)
>>> 0.03 < s.ttft["p50"] < 0.2, 0.006 < s.tpot["p50"] < 0.02
(True, True)
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from flexmesh.cost.device.hardware import Hardware
from flexmesh.cost.inference.band import Band, part_bands
from flexmesh.cost.inference.memory import kv_bytes_per_token, kv_capacity, kv_groups, served_dtype
from flexmesh.cost.inference.overhead import EngineOverhead
from flexmesh.cost.inference.timing import (
    EngineLoop,
    IterationTiming,
    LoopTiming,
    RunTiming,
    SplitTiming,
    split_s,
)
from flexmesh.cost.inference.transfer import Path, kv_path
from flexmesh.data.requests import Request, Workload
from flexmesh.errors import FlexmeshError, SpecError
from flexmesh.serve.branches import Score, to_prune
from flexmesh.serve.kv import KVBlocks
from flexmesh.serve.layout.engine import EngineSpec, engine_spec
from flexmesh.serve.layout.knobs import EngineKnobs
from flexmesh.serve.layout.plan import ServingPlan
from flexmesh.serve.layout.replicas import PlacedReplica
from flexmesh.serve.layout.roles import Role
from flexmesh.serve.layout.routing import RoutingTable
from flexmesh.serve.lengths import LengthPredictor
from flexmesh.serve.metrics import RequestRecord
from flexmesh.serve.queues import QUEUES, make_queue
from flexmesh.serve.replica import Charges, ReplicaTiming, Req, SimulatedReplica
from flexmesh.serve.router import Router, make_router
from flexmesh.serve.schedulers import scheduler as make_scheduler
from flexmesh.spec.cluster import MixedCluster
from flexmesh.spec.model import ModelSpec

# A busy decode batch: the least-work router prices a replica's decode token as one of this many.
ROUTER_DECODE_BATCH = 32


def replica_timing(timing: IterationTiming) -> ReplicaTiming:
    """What the simulator's replicas price iterations by, from what ``timing`` declares: its own split form or its
    iteration price with the decodes spelled out, decode-only runs at once where it prices them, its engine's
    loop costs where it names them."""
    price = timing.split_s if isinstance(timing, SplitTiming) else (
        lambda d, c, ch: split_s(timing, d, c, ch))
    run = timing.decode_run_s if isinstance(timing, RunTiming) else None
    loop = timing.loop if isinstance(timing, LoopTiming) else EngineLoop()
    return ReplicaTiming(price, run, loop)


@dataclass(frozen=True)
class RunOptions:
    """How :meth:`Fleet.run` serves a workload: ``router`` over the replicas that take new requests (``weights``
    for the weights router, ``routing`` the plan router's table), ``queue`` each replica's queue policy
    (length-aware queues and routers by ``predictor``'s lengths); requests with branches (test-time scaling,
    :mod:`flexmesh.serve.branches`) finish with their ``needed``-th branch, the others cancelled then
    (``cancel_lag`` 1: a running branch only after one more iteration, as a cancellation sent by a router reaches
    its engine); ``score`` prunes branches scored below ``prune_below`` each time one finishes;
    ``timeline_points`` samples of each replica's state over the run."""

    router: str = "round-robin"
    weights: tuple[float, ...] | None = None
    queue: str = "fcfs"
    routing: RoutingTable | None = None
    predictor: LengthPredictor | None = None
    score: Score | None = None
    prune_below: float = 0.5
    cancel_lag: int = 0
    timeline_points: int = 400


@dataclass(frozen=True)
class ReplicaReport:
    """What one replica was and did in a run."""

    index: int
    label: str  # tp / pp / role
    device: str
    group: int
    role: str
    kv_blocks: int
    kv_tokens: int
    kv_explain: str
    iterations: int
    tokens: int  # computed (prompt tokens not found in a cache, recomputed ones, one per decode step)
    busy_fraction: float  # of the run's span
    preemptions: int
    prefix_hit_rate: float | None  # prefix blocks found in its cache over those its admissions asked for
    samples: tuple[tuple[float, int, int, int, float], ...]  # (time, waiting, running, batch tokens, KV used)


@dataclass(frozen=True)
class SimResult:
    records: tuple[RequestRecord, ...]  # in request id order
    replicas: tuple[ReplicaReport, ...]
    gpus: dict[str, int]  # devices the replicas use, by type
    events: int
    wall_s: float
    notes: tuple[str, ...]  # what the simulation did not do as asked, and why


# How often a run's progress callback hears from it, in seconds of wall time
PROGRESS_S = 0.5
# The most replicas one simulated fleet holds (16,384 took 15 s to build on a core, 80,000 100 s)
MAX_REPLICAS = 8_192


class Fleet:
    """A deployment built once (each replica's pricing, KV capacity, the KV paths between replicas); :meth:`run`
    simulates a workload on fresh replicas, as often as asked (a rate sweep, a goodput search).

    ``model``: the model, or the models by tier (several models on one fleet, or a cascade's stages in order:
    ``cascade``); ``knobs``: engine knobs per device group (default: vLLM's for the device), or
    ``replica_knobs``, one per replica; ``timing``: each replica's
    :class:`~flexmesh.cost.inference.timing.IterationTiming` (default: the engine's
    :class:`~flexmesh.cost.inference.analytic.AnalyticIteration` on the device layer); ``engine``: what the replicas
    run (:class:`~flexmesh.serve.layout.engine.EngineSpec` or a preset's name; default current vLLM: its scheduler,
    default knobs and prices); ``overhead``: its per-iteration CPU cost in place of the engine's;
    ``charges``: work outside the engines that their iterations pay (made for each run's replicas: a local fleet's
    host, :mod:`flexmesh.serve.engine.twin`); ``admission_s``: every request reaches its replica that long after it
    reached the router (the hop; its record keeps the router's arrival); ``scale``: a factor on the device layer's
    prices per device name (an end of each part's price band: :meth:`at_band`)."""

    def __init__(self, model: ModelSpec | Sequence[ModelSpec], cluster: MixedCluster,
                 replicas: tuple[PlacedReplica, ...], knobs: dict[int, EngineKnobs] | None = None,
                 overhead: EngineOverhead | None = None,
                 timing: Callable[[PlacedReplica], IterationTiming] | None = None,
                 replica_knobs: Sequence[EngineKnobs] | None = None, cascade: bool = False,
                 engine: str | EngineSpec | None = None,
                 charges: Callable[[Sequence[SimulatedReplica]], Charges] | None = None, admission_s: float = 0.0,
                 scale: dict[str, float] | None = None):
        if len(replicas) > MAX_REPLICAS:
            raise SpecError(f"a fleet of {len(replicas):,} replicas is more than the {MAX_REPLICAS:,} one simulation "
                            "holds (building it alone takes minutes); simulate a part of it: replicas of a group "
                            "are alike, so its goodput scales with their count")
        self.models: tuple[ModelSpec, ...] = (model,) if isinstance(model, ModelSpec) else tuple(model)
        if not self.models:
            raise SpecError("a fleet serves at least one model")
        self.model, self.cluster, self.replicas, self.cascade = self.models[0], cluster, replicas, cascade
        for r in replicas:
            if not 0 <= r.spec.tier < len(self.models):
                raise SpecError(f"replica {r.index} serves model {r.spec.tier}; the fleet has {len(self.models)} "
                                f"(0..{len(self.models) - 1})")
        if replica_knobs is not None and len(replica_knobs) != len(replicas):
            raise SpecError(f"{len(replica_knobs)} engine knobs given for {len(replicas)} replicas; give one each")
        self.engine = engine_spec(engine)
        if overhead is not None:  # given apart from the engine (--engine-overhead, a profile's)
            self.engine = replace(self.engine, overhead=overhead)
        make_scheduler(self.engine.scheduler_name)  # one not registered refused here, not at the first run
        self.charges, self.admission_s = charges, admission_s
        self.scale, self._timing = dict(scale or {}), timing
        context = min(m.max_position for m in self.models)
        self.knobs = {g: (knobs or {}).get(g) or self.engine.knobs(c.device, context)
                      for g, c in enumerate(cluster.groups)}
        self.replica_knobs = (tuple(replica_knobs) if replica_knobs is not None
                              else tuple(self.knobs[r.spec.group] for r in replicas))
        self.overhead = self.engine.overhead
        hardware: dict[tuple[int, int], Hardware] = {}
        built: dict[tuple[int, int, int, int], IterationTiming] = {}
        self.timings: list[ReplicaTiming] = []
        self.capacities = []
        for r, k in zip(replicas, self.replica_knobs):
            s = r.spec
            m = self.models[s.tier]
            if timing is not None:
                t = timing(r)
            else:
                key = (s.tier, s.group, s.tp, s.pp)
                if key not in built:
                    hw = hardware.get((s.tier, s.group))
                    if hw is None:
                        g = cluster.groups[s.group]
                        hw = hardware[s.tier, s.group] = Hardware(g, served_dtype(m.dtype, g.device))
                    built[key] = self.engine.iteration(m, hw, s.tp, s.pp, scale=self.scale.get(r.device.name, 1.0))
                t = built[key]
            self.timings.append(replica_timing(t))
            cap = kv_capacity(m, r.device, s.tp, s.pp, k.max_batched_tokens, k.max_seqs, k.block_tokens,
                              k.memory_fraction)
            most = kv_groups(m).pool(cap)
            if k.kv_blocks is not None and k.kv_blocks > most:
                raise SpecError(f"kv-blocks {k.kv_blocks:,} is more than {r.device.name} holds for {m.name} at tp "
                                f"{s.tp}, pp {s.pp} ({cap.explain()}{kv_groups(m).explain()}); give at most {most:,}")
            self.capacities.append(cap if k.kv_blocks is None else replace(cap, blocks_given=k.kv_blocks))
        self._paths: dict[tuple[int, int], Path] = {}

    @classmethod
    def from_plan(cls, plan: ServingPlan, overhead: EngineOverhead | None = None) -> tuple[Fleet, RoutingTable]:
        """The fleet of a serving plan (its replicas placed on its cluster, each with its group's knobs) and its
        routing table over them."""
        placed = plan.placement()
        fleet = cls(plan.model_specs(), placed.cluster, placed.replicas, overhead=overhead, replica_knobs=placed.knobs,
                    cascade=plan.cascade is not None, engine=plan.engine)
        return fleet, placed.table

    def bands(self) -> dict[str, Band]:
        """Each of its parts' price band on the first model it serves (flexmesh.cost.inference.band)."""
        return part_bands(self.model, (r.device for r in self.replicas))

    def at_band(self, end: str) -> Fleet:
        """The same fleet with every part's device-layer prices at the ``low`` (fast) or ``high`` (slow) end of its
        price band (refused where its timings are not the device layer's: a profile's, a measured engine's)."""
        if self._timing is not None:
            raise SpecError("a fleet priced by its own timings (a profile) has no price band")
        scale = {name: getattr(b, end) for name, b in self.bands().items()}
        return Fleet(self.models, self.cluster, self.replicas, replica_knobs=self.replica_knobs, cascade=self.cascade,
                     engine=self.engine, charges=self.charges, admission_s=self.admission_s, scale=scale)

    @property
    def gpus(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.replicas:
            out[r.device.name] = out.get(r.device.name, 0) + r.spec.devices
        return out

    def path(self, src: int, dst: int) -> Path:
        if (src, dst) not in self._paths:
            self._paths[src, dst] = kv_path(self.replicas[src].span, self.replicas[dst].span, self.cluster)
        return self._paths[src, dst]

    def _stages(self, tier: int) -> range:
        """The models a request of ``tier`` visits."""
        return range(tier + 1) if self.cascade else range(tier, tier + 1)

    def check(self, workload: Workload, routing: RoutingTable | None = None) -> None:
        """Refuse (one line) a workload this fleet cannot serve as asked (``routing``: the plan router's table,
        whose classes go only to the replicas it weighs)."""
        tiers = len(self.models)
        longest: dict[tuple[int, int], Request] = {}  # (model, length class) -> its longest request
        for r in workload.requests:
            if not 0 <= r.tier < tiers:
                raise FlexmeshError(f"request {r.id} asks for model tier {r.tier}; this fleet serves "
                                    + ("one model (tier 0)" if tiers == 1 else f"tiers 0..{tiers - 1}"))
            if r.branches != 1 and (self.cascade or any(rep.spec.role != Role.AGGREGATED for rep in self.replicas
                                                         if rep.spec.tier == r.tier)):
                raise FlexmeshError(f"request {r.id} samples {r.branches} branches; test-time scaling runs on "
                                    "aggregated replicas outside a cascade (its branches share one replica)")
            k = routing.of(r.prompt_tokens, r.output_tokens) if routing is not None else 0
            for t in self._stages(r.tier):
                held = longest.get((t, k))
                if held is None or r.prompt_tokens + r.output_tokens > held.prompt_tokens + held.output_tokens:
                    longest[t, k] = r
        for (t, k), r in sorted(longest.items()):
            total = r.prompt_tokens + r.output_tokens
            m = self.models[t]
            if total > m.max_position:
                raise FlexmeshError(f"request {r.id} needs {total:,} tokens, more than {m.name}'s context of "
                                    f"{m.max_position:,}; scale the lengths to the context (--fit-context) or give a "
                                    "model with a longer one")
            serving = [rep for rep in self.replicas if rep.spec.tier == t]
            if not any(rep.spec.role != Role.DECODE for rep in serving):
                raise FlexmeshError(f"request {r.id} needs model {t} ({m.name}); no replica of the fleet serves it")
            groups = kv_groups(m)
            needs = f"{total:,}" if not groups.windowed else \
                f"{total:,} ({groups.held(total):,.0f} of every layer's, its sliding layers holding {groups.window:,})"
            for rep, cap in zip(self.replicas, self.capacities):
                decode = rep.spec.role == Role.DECODE
                if rep.spec.tier != t or (routing is not None and not routing.weighs(k, rep.index, decode)):
                    continue
                if not groups.fits(total, cap):
                    raise FlexmeshError(f"replica {rep.index} ({rep.spec.label} on {rep.device.name}) holds "
                                        f"{cap.tokens:,} KV tokens, fewer than request {r.id}'s {needs}; raise its "
                                        "tp or pp, or scale the lengths (--fit-context)")

    def run(self, workload: Workload, options: RunOptions | None = None,
            progress: Callable[[int, int], None] | None = None, **given: Any) -> SimResult:
        """Simulate ``workload`` as ``options`` (or the :class:`RunOptions` fields ``given``) say; ``progress(done,
        total)`` is called now and then."""
        opts = replace(options or RunOptions(), **given)
        t0 = time.perf_counter()
        self.check(workload, opts.routing if opts.router == "plan" else None)
        delay = self.admission_s
        if delay > 0:  # each request reaches its replica late; its record keeps the router's arrival
            workload = replace(workload, requests=tuple(replace(r, arrival_s=r.arrival_s + delay)
                                                        for r in workload.requests))
        out = FleetRun(self, workload, opts, progress).run()
        if delay > 0:
            out = replace(out, records=tuple(replace(rec, arrival_s=rec.arrival_s - delay) for rec in out.records))
        return replace(out, wall_s=time.perf_counter() - t0)


class _Branches:
    """A request's branches on their replica: those alive by index, how many finished, their tokens so far."""

    __slots__ = ("r", "rep", "alive", "finished", "tokens", "first", "waiting")

    def __init__(self, r: Request, rep: SimulatedReplica):
        self.r, self.rep = r, rep
        self.alive: dict[int, Req] = {}
        self.finished = self.tokens = self.waiting = 0  # waiting: cancellations not landed yet
        self.first = math.inf


class FleetRun:
    """One run of a fleet over a workload: fresh replicas, their routers, and the events (module doc)."""

    def __init__(self, fleet: Fleet, workload: Workload, opts: RunOptions,
                 progress: Callable[[int, int], None] | None):
        if opts.queue not in QUEUES:
            raise SpecError(f"unknown queue policy {opts.queue!r}; policies: {', '.join(QUEUES)}")
        self.fleet, self.opts, self.progress = fleet, opts, progress
        self.arrivals = workload.requests
        self.notes: list[str] = []
        self.records: list[RequestRecord] = []
        self.events: list[tuple[float, int, Callable[[Any, float], None], Any]] = []
        self.seq = self.count = 0
        self.next_arrival = math.inf
        self.reps = self._replicas(workload)
        self.caching = [bool(p.prefix_tokens) for p in self.reps]
        if fleet.charges is not None:
            charges = fleet.charges(self.reps)
            for rep in self.reps:
                rep.charges = charges
        for rep in self.reps:
            rep.on_finish, rep.on_handoff, rep.on_fetch = self.on_finish, self.on_handoff, self.on_fetch
        self.route, self.route_decode = self._routers()

    def _replicas(self, workload: Workload) -> list[SimulatedReplica]:
        fleet, opts = self.fleet, self.opts
        prefix_tokens = workload.block_tokens
        span = max(workload.duration_s, 1e-3)
        typical = (sum(r.prompt_tokens for r in workload.requests) + sum(r.output_tokens for r in workload.requests)
                   / 2) / len(workload)
        reps = []
        for r, t, cap, k in zip(fleet.replicas, fleet.timings, fleet.capacities, fleet.replica_knobs):
            model = fleet.models[r.spec.tier]
            groups = kv_groups(model)
            caching = k.prefix_caching and prefix_tokens > 0
            if caching and prefix_tokens % k.block_tokens:
                self.notes.append(f"replica {r.index}: prefix blocks of {prefix_tokens} tokens are not whole KV blocks "
                                  f"of {k.block_tokens}; prefix caching off")
                caching = False
            if caching and groups.windowed and not groups.full:
                self.notes.append(f"replica {r.index}: every layer of {model.name} slides; a prefix cache of its "
                                  "window's blocks is not simulated, prefix caching off")
                caching = False
            batch = min(k.max_seqs, ROUTER_DECODE_BATCH)
            rates = (t.price(0, 0, [(0, k.max_batched_tokens)]) / k.max_batched_tokens,
                     t.price(batch, int(batch * groups.held(typical)), []) / batch)
            queue = make_queue(opts.queue, opts.predictor, k.max_seqs, model.max_position)
            # with sliding layers the pool is of group blocks (flexmesh.serve.replica's module doc)
            kv = KVBlocks(groups.pool(cap), k.block_tokens, prefix_tokens if caching else 0, k.prefix_cache_blocks,
                          groups.full)
            scheduler = make_scheduler(fleet.engine.scheduler_name)
            reps.append(SimulatedReplica(r.index, r.spec.role, t, kv, k, queue, scheduler, rates,
                                         span / max(opts.timeline_points, 1), groups=groups,
                                         admit_whole=fleet.engine.admit_whole))
        return reps

    def _routers(self) -> tuple[list[Router[SimulatedReplica] | None], list[Router[SimulatedReplica] | None]]:
        """Per model: the router over its replicas that take new requests, and the one over its decode replicas."""
        fleet, opts = self.fleet, self.opts
        if opts.router == "weights" and len({r.spec.tier for r in fleet.replicas}) > 1:
            raise SpecError("the weights router spreads one pool; a fleet of several models needs the plan router (a "
                            "routing table) or another router")
        route: list[Router[SimulatedReplica] | None] = []
        route_decode: list[Router[SimulatedReplica] | None] = []
        for tier, model in enumerate(fleet.models):
            mine = [(r, p) for r, p in zip(fleet.replicas, self.reps) if r.spec.tier == tier]
            entry = [p for _, p in mine if p.role != Role.DECODE]
            decoders = [p for _, p in mine if p.role == Role.DECODE]
            context = model.max_position
            route.append(make_router(opts.router, entry, opts.weights, opts.routing, predictor=opts.predictor,
                                     context=context) if entry else None)
            route_decode.append(make_router("least-work" if opts.router == "weights" else opts.router, decoders,
                                            table=opts.routing, decode=True, predictor=opts.predictor,
                                            context=context) if decoders else None)
        return route, route_decode

    # ---- the loop --------------------------------------------------------------------------------------
    def push(self, t: float, handle: Callable[[Any, float], None], payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, handle, payload))

    def run(self) -> SimResult:
        arrivals, events = self.arrivals, self.events
        n, a = len(arrivals), 0
        ticked = time.monotonic()
        while a < n or events:
            self.count += 1
            # progress about every PROGRESS_S of wall time (an event may be one iteration or thousands at once)
            if self.progress is not None and time.monotonic() - ticked >= PROGRESS_S:
                ticked = time.monotonic()
                self.progress(len(self.records), n)
            if a < n and (not events or arrivals[a].arrival_s <= events[0][0]):
                self.on_arrival(arrivals[a], arrivals[a].arrival_s)
                a += 1
                continue
            now, _, handle, payload = heapq.heappop(events)
            self.next_arrival = arrivals[a].arrival_s if a < n else math.inf  # what a replica may run ahead to
            handle(payload, now)
        if self.progress is not None:
            self.progress(len(self.records), n)
        return self._result()

    # ---- the events -------------------------------------------------------------------------------------
    def on_arrival(self, r: Request, now: float) -> None:
        """A request reaches the router: the first model it visits takes it."""
        self.enter(r, 0 if self.fleet.cascade else r.tier, now)

    def on_iteration_end(self, rep: SimulatedReplica, now: float) -> None:
        """``rep``'s iteration ends: its tokens land, and it starts the next one at once.

        An aggregated replica meets the others only at arrivals (routers read its state then): its iterations
        that end before the next arrival are run here, without the heap, decode-only runs at once. A prefill or
        decode replica hands requests over (and in a cascade every replica may hand its finished requests on), so
        it runs ahead only to the next event anywhere. The records are those of strict time order."""
        rep.finish(now)
        alone = not self.fleet.cascade and rep.role == Role.AGGREGATED
        while True:
            limit = self.next_arrival
            if self.events and not alone:
                limit = min(limit, self.events[0][0])
            now = rep.coast(now, limit)
            end = rep.start(now)
            if end is None:
                return
            if end < limit:
                self.count += 1
                rep.finish(end)
                now = end
                continue
            self.push(end, self.on_iteration_end, rep)
            return

    def on_transfer_done(self, q: Req, now: float) -> None:
        """``q``'s KV has reached its decode replica: the prefill replica frees it, the decode replica decodes it."""
        assert q.src is not None and q.decode_replica is not None
        src, dst = q.src, self.reps[q.decode_replica]
        src.release_held(q)
        dst.kv_arrived(q)
        for rep in (src, dst):
            if not rep.busy:
                self.kick(rep, now)

    # ---- what the replicas report --------------------------------------------------------------------------
    def on_finish(self, q: Req, now: float) -> None:
        assert q.first_token_s is not None
        r = q.r
        if q.group is not None:
            self.branch_done(q, now)
            return
        if self.fleet.cascade and q.stage < r.tier:  # escalated: the next model of the cascade takes it now
            self.enter(r, q.stage + 1, now, q.preemptions)
            return
        self.records.append(RequestRecord(r.id, q.replica, r.arrival_s, q.first_token_s, now, r.prompt_tokens,
                                          r.output_tokens, None, q.decode_replica, q.preemptions, q.cached))

    def on_handoff(self, q: Req, now: float) -> None:
        """A prefill replica has ``q``'s first token: a decode replica of its model takes it."""
        to = self.route_decode[q.stage]
        assert to is not None
        dst = to.choose(q.r)
        src = self.reps[q.replica]
        q.src, q.decode_replica, q.handed_s = src, dst.index, now
        q.remote, q.target = True, q.r.output_tokens
        q.computed, q.tokens = q.r.prompt_tokens, q.r.prompt_tokens + 1
        q.shared = q.own = 0
        q.ids = q.r.prefix_blocks if self.caching[dst.index] else ()
        dst.push(q, now)
        if not dst.busy:
            self.kick(dst, now)

    def on_fetch(self, q: Req, now: float) -> None:
        """A decode replica admitted ``q``: its KV crosses the link between the two replicas."""
        assert q.src is not None and q.decode_replica is not None
        model = self.fleet.model
        nbytes = kv_groups(model).held(q.r.prompt_tokens) * kv_bytes_per_token(model)
        self.push(now + self.fleet.path(q.src.index, q.decode_replica).seconds(nbytes), self.on_transfer_done, q)

    # ---- helpers -----------------------------------------------------------------------------------------
    def kick(self, rep: SimulatedReplica, now: float) -> None:
        end = rep.start(now)
        if end is not None:
            self.push(end, self.on_iteration_end, rep)

    def enter(self, r: Request, stage: int, now: float, preemptions: int = 0) -> None:
        """``r`` arrives at ``stage``'s replicas (routed now)."""
        route = self.route[stage]
        assert route is not None, "Fleet.check saw every stage's entry pool"
        rep = route.choose(r)
        if r.branches > 1:  # every branch on this replica, each its own state
            group = _Branches(r, rep)
            for b, n in enumerate(r.branch_lengths()):
                q = Req(r, n, ())
                q.uid, q.group, q.branch = -(r.id * 1024 + b) - 1, group, b
                group.alive[b] = q
                rep.push(q, now)
            if not rep.busy:
                self.kick(rep, now)
            return
        q = Req(r, 1 if rep.role == Role.PREFILL else r.output_tokens,
                r.prefix_blocks if self.caching[rep.index] else ())
        q.stage, q.preemptions = stage, preemptions
        rep.push(q, now)
        if not rep.busy:
            self.kick(rep, now)

    def drop(self, g: _Branches, q: Req, then: Callable[[], None]) -> None:
        """Cancel branch ``q`` (after one more iteration where it runs and ``cancel_lag`` says so)."""
        if self.opts.cancel_lag and q.uid in g.rep.running:
            g.waiting += 1

            def done(tokens: int) -> None:
                g.tokens += tokens
                g.waiting -= 1
                if not g.waiting:
                    then()
            g.rep.cancel_later(q, done)
        else:
            g.tokens += g.rep.cancel(q)

    def branch_done(self, q: Req, now: float) -> None:
        g = q.group
        assert isinstance(g, _Branches)
        if q.branch not in g.alive:  # it finished before its cancellation landed, which counts its tokens
            return
        del g.alive[q.branch]
        g.finished += 1
        g.tokens += q.outputs
        assert q.first_token_s is not None
        g.first = min(g.first, q.first_token_s)
        if g.finished < g.r.needed:
            for b in to_prune(g.r, sorted(g.alive), g.finished, self.opts.score, self.opts.prune_below):
                self.drop(g, g.alive.pop(b), lambda: None)
            return
        r = g.r

        def record() -> None:
            self.records.append(RequestRecord(r.id, q.replica, r.arrival_s, g.first, now, r.prompt_tokens, q.outputs,
                                              None, None, q.preemptions, q.cached, g.tokens, r.branches))
        for b in sorted(g.alive):
            self.drop(g, g.alive.pop(b), record)
        if not g.waiting:
            record()

    def _result(self) -> SimResult:
        fleet, records, n = self.fleet, self.records, len(self.arrivals)
        if len(records) != n:  # every replica idle with requests left: none could ever be admitted
            raise FlexmeshError(f"{n - len(records)} requests were never served (no replica could admit them); "
                                "this is a simulator bug: report it with the command line")
        records.sort(key=lambda rec: rec.id)
        end = max(rec.finish_s for rec in records)
        start = min(rec.arrival_s for rec in records)
        reports = tuple(
            ReplicaReport(r.index, r.spec.label, r.device.name, r.spec.group, r.spec.role, cap.blocks, cap.tokens,
                          cap.explain() + p.groups.explain(), p.iterations, p.tokens,
                          p.busy_s / max(end - start, 1e-12), p.preemptions,
                          p.kv.hits / p.kv.lookups if p.kv.lookups else None, tuple(p.samples))
            for r, cap, p in zip(fleet.replicas, fleet.capacities, self.reps))
        return SimResult(tuple(records), reports, fleet.gpus, self.count, 0.0, tuple(self.notes))
