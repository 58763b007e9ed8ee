"""A serving plan: replica groups on a cluster, their routing by length bucket, and what they are predicted to
do, as versioned, human-readable JSON.

As a training plan is a list of replica groups (flexmesh.layout.plan), a serving plan is a list of **replica
groups**: ``replicas`` identical replicas of a model (by index into ``models``; a cascade's models in order)
on a device group of ``cluster`` (``device`` names its type), each ``tp x pp`` devices in a ``role``
(aggregated, prefill, decode) with its engine knobs (vLLM's names: ``max_seqs``, ``max_batched_tokens``,
``block_tokens``, ``memory_fraction``, ``kv_blocks``, ``prefix_caching``). Requests are routed by their
length bucket (``buckets``: prompt edges x output edges, as :class:`~flexmesh.serve.layout.classes.LengthClasses`
numbers them): a group's ``entry`` gives, per bucket, the share of that bucket's new requests of its model
the group takes (spread evenly over its replicas); a decode group's ``decode`` the share of the bucket's
hand-offs it decodes. ``routing`` says how a replica is picked inside a bucket's shares (``weights``: in
proportion; ``least-work``: the replica of positive share whose work would finish first).

``slo`` (bounds in seconds and the attainment target), ``prices`` ($ per GPU-hour used), ``predicted`` (the
planner's figures: the MILP's rate, the simulated goodput, $/h), ``workload`` (the trace it was planned on)
and ``cascade`` (the quality curve, its target and the escalated fraction) record the rest. ``serve plan
--check`` validates a file (each error one line, :func:`flexmesh.serve.plan.check.check_plan` against its models and
cluster); ``serve simulate --plan`` simulates it (:meth:`flexmesh.serve.simulator.Fleet.from_plan`).

A small example (docs/serve-plan.md has a larger one):

.. code-block:: json

    {"version": 1, "kind": "flexmesh serving plan", "models": ["llama3.1-8b"], "cluster": "8xH100+8xL4",
     "slo": {"ttft_s": 0.25, "tpot_s": 0.1, "attainment": 0.9},
     "buckets": {"prompt_edges": [1024], "output_edges": [],
                 "buckets": [{"share": 0.7, "prompt_mean": 400, "output_mean": 200, "prompt_high": 900,
                              "output_high": 420, "longest": 1700},
                             {"share": 0.3, "prompt_mean": 2500, "output_mean": 250, "prompt_high": 3800,
                              "output_high": 500, "longest": 4800}]},
     "groups": [{"model": 0, "group": 0, "device": "H100-80GB", "replicas": 1, "tp": 1, "role": "aggregated",
                 "engine": {"max_seqs": 1024, "max_batched_tokens": 8192}, "entry": [0.2, 1.0]},
                {"model": 0, "group": 1, "device": "L4", "replicas": 2, "tp": 2, "role": "aggregated",
                 "engine": {"max_seqs": 256, "max_batched_tokens": 2048}, "entry": [0.8, 0.0]}],
     "routing": "weights", "prices": {"H100-80GB": 6.88, "L4": 0.8048}, "predicted": {}}

>>> example = __doc__.split(".. code-block:: json")[1].split(">>>")[0]
>>> plan = ServingPlan.from_dict(json.loads(example))
>>> [g.label for g in plan.groups], plan.devices, round(plan.dollars_per_hour, 2)
(['1x tp1 b8192 on H100-80GB', '2x tp2 b2048 on L4'], {'H100-80GB': 1, 'L4': 4}, 10.1)
>>> placed = plan.placement()
>>> [r.device.name for r in placed.replicas], placed.table.entry
(['H100-80GB', 'L4', 'L4'], ((0.2, 0.4, 0.4), (1.0, 0.0, 0.0)))
>>> ServingPlan.from_dict({**json.loads(example), "routing": "fastest"})
Traceback (most recent call last):
flexmesh.errors.PlanError: plan: routing 'fastest' is not one of weights, least-work
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from flexmesh.cost.inference.memory import VLLM_BLOCK_TOKENS, VLLM_MEMORY_FRACTION
from flexmesh.errors import FlexmeshError, PlanError, SpecError
from flexmesh.files import read_json, write_atomic
from flexmesh.layout.enums import choices
from flexmesh.serve.layout.buckets import Bucket, RequestBuckets
from flexmesh.serve.layout.classes import LengthClasses
from flexmesh.serve.layout.engine import EngineSpec, engine_spec, planned_engine
from flexmesh.serve.layout.knobs import EngineKnobs
from flexmesh.serve.layout.quality import QualityCurve
from flexmesh.serve.layout.replicas import PlacedReplica, ReplicaSpec, place
from flexmesh.serve.layout.roles import Role
from flexmesh.serve.layout.routing import RoutingPolicy, RoutingTable
from flexmesh.serve.layout.slo import SLO
from flexmesh.spec.cluster import Link, MixedCluster, parse_mixed_cluster
from flexmesh.spec.devices import device_name
from flexmesh.spec.model import ModelSpec, parse_model
from flexmesh.spec.values import flag, known_keys, mapping, number, sequence, text, whole

SERVING_PLAN_VERSION = 1
KIND = "flexmesh serving plan"
_KEYS = ("version", "kind", "models", "cluster", "links", "slo", "buckets", "groups", "routing", "cascade", "prices",
         "predicted", "workload", "planner", "engine")
_GROUP_KEYS = ("model", "group", "device", "replicas", "tp", "pp", "role", "engine", "entry", "decode")
_ENGINE_KEYS = ("max_seqs", "max_batched_tokens", "block_tokens", "memory_fraction", "kv_blocks", "prefix_caching")
_BUCKET_KEYS = ("share", "prompt_mean", "output_mean", "prompt_high", "output_high", "longest", "context_rms")
# Shares of a bucket over the groups taking it sum to 1 within this.
SHARE_TOLERANCE = 1e-6


@dataclass(frozen=True)
class ServingGroup:
    """``replicas`` identical replicas: a model on a device group at ``tp x pp`` in a role, with engine knobs, and
    per bucket the share of its model's requests the group takes (``entry``; ``decode`` for decode groups)."""

    model: int
    group: int
    device: str
    replicas: int
    tp: int
    pp: int
    role: Role
    knobs: EngineKnobs
    entry: tuple[float, ...]
    decode: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))  # a role's name given is the role

    @property
    def devices(self) -> int:
        return self.replicas * self.tp * self.pp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.model, self.group, self.tp, self.pp)

    @property
    def label(self) -> str:
        """``3x tp1-prefill b2048 on H100-80GB``: replicas, degrees, role, the knob the planner chose (the
        batched-token budget ``b``, a decode replica's ``max_seqs`` ``s``), device."""
        pp = f"pp{self.pp}" if self.pp > 1 else ""
        role = "" if self.role is Role.AGGREGATED else f"-{self.role}"
        knob = f"s{self.knobs.max_seqs}" if self.role is Role.DECODE else f"b{self.knobs.max_batched_tokens}"
        return f"{self.replicas}x tp{self.tp}{pp}{role} {knob} on {self.device}"

    def to_json(self) -> dict:
        k = self.knobs
        engine: dict[str, Any] = {"max_seqs": k.max_seqs, "max_batched_tokens": k.max_batched_tokens,
                                  "block_tokens": k.block_tokens, "memory_fraction": k.memory_fraction,
                                  "prefix_caching": k.prefix_caching}
        if k.kv_blocks is not None:
            engine["kv_blocks"] = k.kv_blocks
        d: dict[str, Any] = {"model": self.model, "group": self.group, "device": self.device,
                             "replicas": self.replicas, "tp": self.tp, "pp": self.pp, "role": self.role,
                             "engine": engine, "entry": [round(x, 9) for x in self.entry]}
        if self.decode:
            d["decode"] = [round(x, 9) for x in self.decode]
        return d


@dataclass(frozen=True)
class CascadeSpec:
    """The models are a cascade: ``quality`` against the escalated fraction, the ``target`` quality, and the
    ``escalated`` fraction of requests the plan carries to the second model."""

    quality: QualityCurve
    target: float
    escalated: float

    def to_json(self) -> dict:
        return {"quality": self.quality.to_json(), "target": self.target, "escalated": round(self.escalated, 6)}


@dataclass(frozen=True)
class PlanPlacement:
    """A serving plan's replicas on its cluster: each placed, its engine knobs, the routing table over them."""

    cluster: MixedCluster
    replicas: tuple[PlacedReplica, ...]
    knobs: tuple[EngineKnobs, ...]
    table: RoutingTable


@dataclass(frozen=True)
class ServingPlan:
    models: tuple[str, ...]
    cluster: str
    buckets: RequestBuckets
    slo: SLO
    attainment: float
    groups: tuple[ServingGroup, ...]
    routing: RoutingPolicy = RoutingPolicy.WEIGHTS
    prices: dict[str, float] = field(default_factory=dict)
    links: tuple[tuple[int, int, float, float], ...] = ()  # (group, group, GB/s, latency us) as the file gave them
    cascade: CascadeSpec | None = None
    predicted: dict = field(default_factory=dict)
    workload: dict = field(default_factory=dict)
    planner: dict = field(default_factory=dict)
    engine: EngineSpec = field(default_factory=engine_spec)  # what its replicas run (default: current vLLM)

    # ---- what it is -----------------------------------------------------------------------------------
    def model_specs(self) -> tuple[ModelSpec, ...]:
        return tuple(parse_model(m) for m in self.models)

    def mixed_cluster(self) -> MixedCluster:
        c = parse_mixed_cluster(self.cluster)
        if not self.links:
            return c
        return MixedCluster(c.groups, tuple((i, j, Link(gbps, lat)) for i, j, gbps, lat in self.links))

    @property
    def devices(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.groups:
            out[g.device] = out.get(g.device, 0) + g.devices
        return out

    @property
    def dollars_per_hour(self) -> float:
        return sum(self.prices.get(d, math.nan) * n for d, n in self.devices.items())

    @property
    def layout(self) -> str:
        """One line: ``2x tp1 on H100-80GB + 4x tp2-decode on L4``."""
        return " + ".join(g.label if len(self.models) == 1 else f"{self.models[g.model]}: {g.label}"
                          for g in self.groups)

    def with_predicted(self, **values: Any) -> ServingPlan:
        return replace(self, predicted={**self.predicted, **values})

    # ---- its replicas ---------------------------------------------------------------------------------
    def placement(self) -> PlanPlacement:
        """The plan's replicas placed on its cluster (each device group's widest replicas first, so a replica
        never straddles a node), each one's knobs, and its routing table over them."""
        cluster = self.mixed_cluster()
        order = sorted(range(len(self.groups)), key=lambda i: (self.groups[i].group, -self.groups[i].tp
                                                               * self.groups[i].pp, i))
        specs: list[ReplicaSpec] = []
        knobs: list[EngineKnobs] = []
        owner: list[int] = []
        for i in order:
            g = self.groups[i]
            specs += [ReplicaSpec(g.group, g.tp, g.pp, g.role, g.model)] * g.replicas
            knobs += [g.knobs] * g.replicas
            owner += [i] * g.replicas
        placed = place(tuple(specs), cluster)
        nb = len(self.buckets)
        entry = [[0.0] * len(placed) for _ in range(nb)]
        decode = [[0.0] * len(placed) for _ in range(nb)]
        for r, i in enumerate(owner):
            g = self.groups[i]
            for b in range(nb):
                if g.entry:
                    entry[b][r] = g.entry[b] / g.replicas
                if g.decode:
                    decode[b][r] = g.decode[b] / g.replicas
        any_decode = any(g.decode for g in self.groups)
        table = RoutingTable(self.buckets.prompt_edges, self.buckets.output_edges, tuple(map(tuple, entry)),
                             tuple(map(tuple, decode)) if any_decode else (), self.routing)
        return PlanPlacement(cluster, placed, tuple(knobs), table)

    # ---- JSON ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        b = self.buckets
        d: dict[str, Any] = {
            "version": SERVING_PLAN_VERSION, "kind": KIND, "models": list(self.models), "cluster": self.cluster,
            "slo": {"ttft_s": self.slo.ttft_s, "tpot_s": self.slo.tpot_s, "e2e_s": self.slo.e2e_s,
                    "attainment": self.attainment},
            "buckets": {"prompt_edges": list(b.prompt_edges), "output_edges": list(b.output_edges),
                        "buckets": [{k: (round(getattr(x, k), 9) if k == "share" else
                                         round(getattr(x, k), 3) if isinstance(getattr(x, k), float) else
                                         getattr(x, k)) for k in _BUCKET_KEYS} for x in b.buckets]},
            "engine": self.engine.to_dict(), "groups": [g.to_json() for g in self.groups], "routing": self.routing,
            "prices": dict(self.prices), "predicted": self.predicted,
        }
        if self.links:
            d["links"] = {f"{i}-{j}": {"gbps": gbps, "latency_us": lat} for i, j, gbps, lat in self.links}
        if self.cascade is not None:
            d["cascade"] = self.cascade.to_json()
        if self.workload:
            d["workload"] = self.workload
        if self.planner:
            d["planner"] = self.planner
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "plan") -> ServingPlan:
        """A plan from its JSON form, every field checked (PlanError in one line naming the field)."""
        d = mapping(d, where, PlanError)
        known_keys(d, _KEYS, where, PlanError)
        version = d.get("version")
        if version != SERVING_PLAN_VERSION:
            raise PlanError(f"{where}: version {version!r} is not a serving plan version this flexmesh reads "
                            f"({SERVING_PLAN_VERSION})")
        if d.get("kind") != KIND:
            raise PlanError(f"{where}: kind must be {KIND!r} (a training plan is read by flexmesh plan --check), got "
                            f"{d.get('kind')!r}")
        models = tuple(text(m, f"{where}: models[{i}]", PlanError)
                       for i, m in enumerate(sequence(d.get("models"), f"{where}: models", PlanError)))
        if not models:
            raise PlanError(f"{where}: models names none; give at least one model")
        cluster = text(d.get("cluster"), f"{where}: cluster", PlanError)
        links = []
        for key, value in mapping(d.get("links", {}), f"{where}: links", PlanError).items():
            a, sep, b = str(key).partition("-")
            if not (sep and a.isdigit() and b.isdigit()):
                raise PlanError(f"{where}: links key {key!r} is not a pair of groups like \"0-1\"")
            v = mapping(value, f"{where}: links.{key}", PlanError)
            known_keys(v, ("gbps", "latency_us"), f"{where}: links.{key}", PlanError)
            links.append((int(a), int(b), number(v.get("gbps"), f"{where}: links.{key}.gbps", PlanError),
                          number(v.get("latency_us", 0.0), f"{where}: links.{key}.latency_us", PlanError,
                                 strict=False)))
        slo_d = mapping(d.get("slo"), f"{where}: slo", PlanError)
        known_keys(slo_d, ("ttft_s", "tpot_s", "e2e_s", "attainment"), f"{where}: slo", PlanError)
        bounds = {k: (None if slo_d.get(k) is None else number(slo_d[k], f"{where}: slo.{k}", PlanError))
                  for k in ("ttft_s", "tpot_s", "e2e_s")}
        attainment = number(slo_d.get("attainment", 0.9), f"{where}: slo.attainment", PlanError, maximum=1.0)
        buckets = _buckets(d.get("buckets"), f"{where}: buckets")
        nb = len(buckets)
        routing = d.get("routing", "weights")
        if routing not in choices(RoutingPolicy):
            raise PlanError(f"{where}: routing {routing!r} is not one of {', '.join(choices(RoutingPolicy))}")
        routing = RoutingPolicy(routing)
        groups = tuple(_group(g, f"{where}: groups[{i}]", nb, len(models))
                       for i, g in enumerate(sequence(d.get("groups"), f"{where}: groups", PlanError)))
        if not groups:
            raise PlanError(f"{where}: groups lists none; a plan has at least one replica group")
        prices = {str(k): number(v, f"{where}: prices.{k}", PlanError, strict=False)
                  for k, v in mapping(d.get("prices", {}), f"{where}: prices", PlanError).items()}
        unpriced = sorted({g.device for g in groups} - set(prices))
        if unpriced:  # priced as the presets price them; a part they do not price needs its price here
            from flexmesh.spec.prices import gpu_prices

            preset = gpu_prices()
            missing = [name for name in unpriced if name not in preset]
            if missing:
                raise PlanError(f"{where}: prices has no price for {', '.join(missing)}; give each device's USD per "
                                "GPU-hour (e.g. \"prices\": {\"" + missing[0] + "\": 2.49})")
            prices.update({name: preset[name].usd_per_hour for name in unpriced})
        cascade = None
        if d.get("cascade") is not None:
            c = mapping(d["cascade"], f"{where}: cascade", PlanError)
            known_keys(c, ("quality", "target", "escalated"), f"{where}: cascade", PlanError)
            try:
                pts = tuple((float(x), float(y)) for x, y in sequence(c.get("quality"), f"{where}: cascade.quality",
                                                                      PlanError))
                curve = QualityCurve(pts)
            except (TypeError, ValueError, FlexmeshError) as e:
                raise PlanError(f"{where}: cascade.quality: {e}") from None
            cascade = CascadeSpec(curve, number(c.get("target"), f"{where}: cascade.target", PlanError, strict=False),
                                  number(c.get("escalated"), f"{where}: cascade.escalated", PlanError, strict=False,
                                         maximum=1.0))
            if len(models) != 2:
                raise PlanError(f"{where}: a cascade has two models in order, got {len(models)}")
        try:
            engine = planned_engine(d["engine"], f"{where}: engine") if "engine" in d else engine_spec()
        except SpecError as err:
            raise PlanError(str(err)) from None
        plan = cls(models, cluster, buckets, SLO(**bounds), attainment, groups, routing, prices, tuple(links), cascade,
                   _predicted(d.get("predicted", {}), f"{where}: predicted"),
                   _workload(d.get("workload", {}), f"{where}: workload"),
                   mapping(d.get("planner", {}), f"{where}: planner", PlanError), engine)
        plan._check_routing(where)
        return plan

    def _check_routing(self, where: str) -> None:
        """Each bucket's shares sum to 1 over the groups of each model that take it."""
        for m in range(len(self.models)):
            mine = [g for g in self.groups if g.model == m]
            if not mine:
                if self.cascade is not None or m == 0:
                    raise PlanError(f"{where}: model {m} ({self.models[m]}) has no replica group; give it one")
                continue
            roles = {g.role for g in mine}
            if (Role.PREFILL in roles) != (Role.DECODE in roles):
                raise PlanError(f"{where}: model {m}'s {'prefill' if 'prefill' in roles else 'decode'} groups need "
                                f"{'decode' if 'prefill' in roles else 'prefill'} groups to hand requests to")
            for b, bucket in enumerate(self.buckets.buckets):
                if bucket.share <= 0:
                    continue
                total = sum(g.entry[b] for g in mine if g.role.takes_new)
                if abs(total - 1) > SHARE_TOLERANCE:
                    raise PlanError(f"{where}: bucket {b} ({bucket.label}) of model {m}: the groups' entry shares sum "
                                    f"to {total:.6g}, not 1; give each bucket's shares over its groups summing to 1")
                if Role.DECODE in roles:
                    dec = sum(g.decode[b] for g in mine if g.role is Role.DECODE)
                    if abs(dec - 1) > SHARE_TOLERANCE and any(g.entry[b] > 0 for g in mine if g.role is Role.PREFILL):
                        raise PlanError(f"{where}: bucket {b} ({bucket.label}) of model {m}: the decode groups' "
                                        f"shares sum to {dec:.6g}, not 1")


def _buckets(raw: Any, where: str) -> RequestBuckets:
    d = mapping(raw, where, PlanError)
    known_keys(d, ("prompt_edges", "output_edges", "buckets"), where, PlanError)
    edges = {}
    for key in ("prompt_edges", "output_edges"):
        vals = [whole(x, f"{where}.{key}[{i}]", PlanError)
                for i, x in enumerate(sequence(d.get(key, []), f"{where}.{key}", PlanError))]
        if any(b <= a for a, b in zip(vals, vals[1:])):
            raise PlanError(f"{where}.{key} must rise, got {vals}")
        edges[key] = tuple(vals)
    items = sequence(d.get("buckets"), f"{where}.buckets", PlanError)
    want = (len(edges["prompt_edges"]) + 1) * (len(edges["output_edges"]) + 1)
    if len(items) != want:
        raise PlanError(f"{where}: {len(items)} buckets for {len(edges['prompt_edges'])} prompt edges and "
                        f"{len(edges['output_edges'])} output edges; give {want}, one per class")
    spans = LengthClasses(edges["prompt_edges"], edges["output_edges"]).intervals()
    out = []
    for i, (item, (p, o)) in enumerate(zip(items, spans)):
        w = f"{where}.buckets[{i}]"
        b = mapping(item, w, PlanError)
        known_keys(b, _BUCKET_KEYS, w, PlanError)
        share = number(b.get("share"), f"{w}.share", PlanError, strict=False, maximum=1.0)
        means = [number(b.get(k, 0), f"{w}.{k}", PlanError, strict=False) for k in ("prompt_mean", "output_mean")]
        high, out_high, longest = (whole(b.get(k, 0), f"{w}.{k}", PlanError, minimum=0)
                                   for k in ("prompt_high", "output_high", "longest"))
        rms = number(b.get("context_rms", 0), f"{w}.context_rms", PlanError, strict=False)
        out.append(Bucket(p, o, share, means[0], means[1], high, out_high, longest, rms))
    try:
        return RequestBuckets(edges["prompt_edges"], edges["output_edges"], tuple(out))
    except FlexmeshError as e:
        raise PlanError(f"{where}: {e}") from None


def _group(raw: Any, where: str, nb: int, nm: int) -> ServingGroup:
    g = mapping(raw, where, PlanError)
    known_keys(g, _GROUP_KEYS, where, PlanError)
    model = whole(g.get("model", 0), f"{where}.model", PlanError, minimum=0)
    if model >= nm:
        raise PlanError(f"{where}.model is {model}; the plan's models are 0..{nm - 1}")
    try:
        role = Role.parse(text(g.get("role", "aggregated"), f"{where}.role", PlanError))
    except FlexmeshError as e:
        raise PlanError(f"{where}.{e}") from None
    eng = mapping(g.get("engine", {}), f"{where}.engine", PlanError)
    known_keys(eng, _ENGINE_KEYS, f"{where}.engine", PlanError)
    try:
        knobs = EngineKnobs(
            whole(eng.get("max_seqs"), f"{where}.engine.max_seqs", PlanError),
            whole(eng.get("max_batched_tokens"), f"{where}.engine.max_batched_tokens", PlanError),
            whole(eng.get("block_tokens", VLLM_BLOCK_TOKENS), f"{where}.engine.block_tokens", PlanError),
            number(eng.get("memory_fraction", VLLM_MEMORY_FRACTION), f"{where}.engine.memory_fraction", PlanError,
                   maximum=1.0),
            flag(eng.get("prefix_caching", True), f"{where}.engine.prefix_caching", PlanError),
            None, None if eng.get("kv_blocks") is None else whole(eng["kv_blocks"], f"{where}.engine.kv_blocks",
                                                                   PlanError))
    except FlexmeshError as err:
        raise PlanError(f"{where}.engine: {err}") from None

    def shares(key: str) -> tuple[float, ...]:
        if key not in g:
            return ()
        vals = tuple(number(x, f"{where}.{key}[{i}]", PlanError, strict=False, maximum=1.0 + SHARE_TOLERANCE)
                     for i, x in enumerate(sequence(g[key], f"{where}.{key}", PlanError)))
        if len(vals) != nb:
            raise PlanError(f"{where}.{key} gives {len(vals)} shares for {nb} buckets; give one per bucket")
        return vals

    entry, decode = shares("entry"), shares("decode")
    if role is Role.DECODE:
        if not decode:
            raise PlanError(f"{where}: a decode group gives decode shares (per bucket, of the hand-offs it decodes)")
        entry = entry or (0.0,) * nb
        if any(entry):
            raise PlanError(f"{where}: a decode group takes no new requests; its entry shares are 0")
    else:
        if not entry:
            raise PlanError(f"{where}: give entry shares (per bucket, of the new requests it takes)")
        if decode:
            raise PlanError(f"{where}: only decode groups give decode shares")
    return ServingGroup(model, whole(g.get("group", 0), f"{where}.group", PlanError, minimum=0),
                        device_name(g.get("device"), f"{where}.device", PlanError),
                        whole(g.get("replicas", 1), f"{where}.replicas", PlanError),
                        whole(g.get("tp", 1), f"{where}.tp", PlanError),
                        whole(g.get("pp", 1), f"{where}.pp", PlanError), role, knobs, entry, decode)


def save_plan(plan: ServingPlan, path: str | Path) -> None:
    write_atomic(path, json.dumps(plan.to_dict(), indent=1) + "\n")


def load_plan(path: str | Path) -> ServingPlan:
    """The serving plan in ``path``, its fields checked (:meth:`ServingPlan.check` checks it against its models and
    cluster)."""
    d = read_json(path, PlanError, missing=f"{path}: no such plan file; write one with flexmesh serve plan --out")
    return ServingPlan.from_dict(d, str(path))


_WORKLOAD_KEYS = ("trace", "window", "requests", "fit_context", "buckets")


def _workload(value: Any, where: str) -> dict:
    """A plan's ``workload``: what ``serve plan`` planned on and ``serve simulate --plan`` replays (a trace, its
    window and request count, or the length buckets), each checked as the flags that wrote it are."""
    w = mapping(value, where, PlanError)
    known_keys(w, _WORKLOAD_KEYS, where, PlanError)
    for key in ("trace", "buckets"):
        if w.get(key) is not None:
            text(w[key], f"{where}.{key}", PlanError)
    if w.get("window") is not None:
        start, sep, end = text(w["window"], f"{where}.window", PlanError).partition(":")
        try:
            ok = bool(sep) and float(start or 0) >= 0 and (not end or float(end) > float(start or 0))
        except ValueError:
            ok = False
        if not ok:
            raise PlanError(f"{where}.window must be \"START:END\" in seconds (e.g. \"0:600\"), got {w['window']!r}")
    if w.get("requests") is not None:
        whole(w["requests"], f"{where}.requests", PlanError)
    if "fit_context" in w:
        flag(w["fit_context"], f"{where}.fit_context", PlanError)
    return w


def _predicted(value: Any, where: str) -> dict:
    """A plan's ``predicted`` figures (rates, goodput, $/h, latencies): each a finite number >= 0."""
    p = mapping(value, where, PlanError)
    for key, v in p.items():
        number(v, f"{where}.{key}", PlanError, strict=False)
    return p

