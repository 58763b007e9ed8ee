"""The simulated twin of N local engines: the request simulator (:class:`flexmesh.serve.simulator.Fleet`) set
up as ``flexmesh serve run`` starts them, each iteration priced by a given ``IterationTiming`` (this
machine's engine profile: flexmesh.profile.iteration.ProfiledIterationTiming). Torch-free.

What is carried over from the :class:`~flexmesh.serve.engine.config.EngineConfig`: the token budget
(``max_batch_tokens``), the KV cache exactly as sized (``num_blocks`` blocks of ``page_size`` tokens,
not derived from device memory), the request cap (``max_requests_per_batch``, which the simulator applies
to running requests, as vLLM's ``max_num_seqs``; set it to the token budget and neither binds before the
budget does) and prefix caching (``block_sharing``). transformers' FIFO scheduler and the simulator's
vLLM-style one agree on the order (decoding requests, then prompts part way through prefill, then
waiting requests, chunked to the budget). What the simulator does not model: transformers' safety margin
(no new prefill beyond the first while fewer than ``safety_margin`` of the blocks are free), which binds
only when the KV cache is nearly full.

A request's way from the router into its engine's batch (the router's HTTP hop, the engine's parsing and checks,
its queue hand-off, the loop waking: a millisecond or two, measured by the engine profile as ``admission_s``) is
a delay on every arrival (the fleet's ``admission_s``): the request joins its engine's queue that long after the
router received it; its record keeps the router's arrival, from which TTFT counts. The router reads the replicas'
state at the delayed arrival (the same choice for round robin).

An engine whose queue ran empty sleeps, and the iteration that wakes it costs more than its batch's price (its
caches went cold): the timing's loop ``after_idle`` (an engine profile's, :class:`~flexmesh.cost.inference.timing.
EngineLoop`), which the simulator's replicas apply to every iteration that starts their busy period. A busy engine's
HTTP thread takes requests in and answers them beside its loop, which waits for it: the loop's ``intake_s`` and
``answer_s``, which the replicas charge per request reaching and leaving them while busy to their next iteration.

The router and the client share the engines' cores (:class:`SharedHost`): the timing's ``host_cores``,
``host_request_s``, ``host_token_s`` and ``host_output_s`` (an engine profile's, :class:`HostCosts`). A request's
``host_request_s`` and ``host_token_s`` per prompt token when it reaches its replica, and ``host_output_s`` per output
token when it is answered, are added to that replica's next iteration whenever as many of the host's replicas are
busy as it has cores (else a free core runs the process). The displaced time is charged whole to the replica whose
request caused it; the engines share it alike on average. A GPU engine's iterations run on its GPU, not on the host's
cores: its timing names no host.

The engines run on this machine's cores, which the catalogue does not describe: the fleet's device is a
placeholder named ``local-engine`` whose numbers nothing reads (the timing prices every iteration, the
KV blocks are given, as vLLM's ``num_gpu_blocks_override``, and aggregated replicas move no KV between
them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from flexmesh.cost.inference.memory import kv_bytes_per_token
from flexmesh.cost.inference.timing import IterationTiming, LoopTiming
from flexmesh.errors import SpecError
from flexmesh.serve.engine.config import EngineConfig
from flexmesh.serve.layout.knobs import EngineKnobs
from flexmesh.serve.layout.replicas import ReplicaSpec, place
from flexmesh.serve.replica import Req, SimulatedReplica
from flexmesh.serve.simulator import Fleet
from flexmesh.spec.cluster import ClusterSpec, MixedCluster
from flexmesh.spec.devices import DeviceSpec
from flexmesh.spec.model import parse_model


def engine_knobs(cfg: EngineConfig, max_running: int | None = None) -> EngineKnobs:
    """The simulator's knobs of an engine (see the module doc); ``max_running``: the router's cap on requests
    sent to it at once, where it is below the engine's own."""
    seqs = min(cfg.max_requests_per_batch, max_running or cfg.max_requests_per_batch)
    return EngineKnobs(max_seqs=seqs, max_batched_tokens=max(cfg.max_batch_tokens, seqs),
                       block_tokens=cfg.page_size, memory_fraction=1.0, prefix_caching=cfg.block_sharing,
                       kv_blocks=cfg.num_blocks)


@runtime_checkable
class HostCosts(Protocol):
    """A timing that names the host its engines share with the router's and the client's process (module doc)."""

    host_cores: int
    host_request_s: float
    host_token_s: float
    host_output_s: float


class SharedHost:
    """The CPU cores a fleet's local engines share with the router's and the client's process, and what that process
    costs them (module doc): :class:`~flexmesh.serve.replica.Charges` of every replica of a run.

    >>> class Rep:
    ...     def __init__(self, busy, ended):
    ...         self.busy, self.ended = busy, ended
    >>> host = SharedHost(2, 0.003, 0.0001, 0.0003, [Rep(True, 0.0), Rep(False, 1.5)])  # the second idles from 1.5 s
    >>> host.saturated(1.0), host.saturated(2.0), host.saturated(2.0, also=host.replicas[1])
    (True, False, True)
    """

    def __init__(self, cores: int, request_s: float, token_s: float, output_s: float,
                 replicas: Sequence[SimulatedReplica]):
        self.cores, self.request_s, self.token_s, self.output_s = cores, request_s, token_s, output_s
        self.replicas = replicas

    def saturated(self, now: float, also: object = None) -> bool:
        """Whether as many replicas as cores are busy at ``now`` (``also`` counted busy: the one asking, at work).
        A replica that ran ahead of ``now`` and idles since counts busy until its last iteration ended."""
        busy = sum(1 for r in self.replicas if r is also or r.busy or r.ended > now)
        return busy >= self.cores

    def arrival_s(self, rep: SimulatedReplica, q: Req, now: float) -> float:
        if self.saturated(now, rep if rep.busy else None):
            return self.request_s + self.token_s * q.r.prompt_tokens
        return 0.0

    def answer_s(self, rep: SimulatedReplica, q: Req, now: float) -> float:
        return self.output_s * q.outputs if self.saturated(now, rep) else 0.0


def twin_fleet(cfg: EngineConfig | list[EngineConfig], engines: int, timing: IterationTiming,
               max_running: int | list[int] | None = None, admission_s: float | None = None,
               engine: str = "transformers") -> Fleet:
    """A simulated fleet of ``engines`` aggregated replicas of ``cfg`` (or one per config of a list), priced by
    ``timing``, each admitting at most ``max_running`` requests at once (the router's cap; one per engine or one
    for all), every request reaching its engine ``admission_s`` after the router received it (default: the
    timing's loop's ``admission_s``, an engine profile's, else 0), each scheduling as ``engine``'s description says
    (flexmesh's own engine, or vLLM / SGLang started with the same knobs: flexmesh.serve.engine.external).

    >>> class Flat:
    ...     def iteration_s(self, batch):
    ...         return 0.01
    >>> from flexmesh.data.requests import constant_lengths, with_arrivals
    >>> cfg = EngineConfig(num_blocks=64, page_size=16, max_batch_tokens=64, max_requests_per_batch=8)
    >>> fleet = twin_fleet(cfg, 2, Flat())
    >>> out = fleet.run(with_arrivals(constant_lengths(32, 5), rate=2.0, n=10))
    >>> [r.kv_tokens for r in out.replicas], round(out.records[0].first_token_s - out.records[0].arrival_s, 3)
    ([1024, 1024], 0.01)
    >>> late = twin_fleet(cfg, 2, Flat(), admission_s=0.002)
    >>> rec = late.run(with_arrivals(constant_lengths(32, 5), rate=2.0, n=10)).records
    >>> round(rec[0].first_token_s - rec[0].arrival_s, 3), rec[3].arrival_s == out.records[3].arrival_s
    (0.012, True)
    """
    cfgs = list(cfg) if isinstance(cfg, list) else [cfg] * engines
    caps = max_running if isinstance(max_running, list) else [max_running] * len(cfgs)
    engines = len(cfgs)
    model = parse_model(cfgs[0].model)
    memory = 2.0 * max(c.num_blocks * c.page_size for c in cfgs) * kv_bytes_per_token(model) / 2**30 + 64.0
    dev = DeviceSpec(name="local-engine", peak_tflops={"fp32": 1.0, "bf16": 1.0, "fp16": 1.0}, memory_gib=memory,
                     hbm_gbps=1.0, nvlink_gbps=1.0, node_net_gbps=1.0, intra_latency_us=1.0, inter_latency_us=1.0,
                     framework_reserve_gib=0.0, allocator_headroom=0.0, source="placeholder: priced by a profile",
                     mm_efficiency=1.0, attn_efficiency=1.0, intra_efficiency=1.0, inter_efficiency=1.0,
                     a2a_intra_efficiency=1.0, a2a_inter_efficiency=1.0)
    cluster = MixedCluster((ClusterSpec(nodes=1, devices_per_node=engines, device=dev),))
    replicas = place(tuple(ReplicaSpec(group=0) for _ in range(engines)), cluster)
    knobs = tuple(engine_knobs(c, m) for c, m in zip(cfgs, caps))
    own = timing.loop.admission_s if isinstance(timing, LoopTiming) else 0.0
    delay = float(own if admission_s is None else admission_s)
    if not 0.0 <= delay < 60.0:
        raise SpecError(f"admission_s is the seconds from the router into an engine's batch, 0 to 60; got {delay}")
    host = timing if isinstance(timing, HostCosts) and timing.host_cores > 0 else None
    charges = (None if host is None else
               lambda reps: SharedHost(host.host_cores, host.host_request_s, host.host_token_s, host.host_output_s,
                                       reps))
    return Fleet(model, cluster, replicas, knobs={0: knobs[0]}, timing=lambda r: timing, replica_knobs=knobs,
                 engine=engine, charges=charges, admission_s=delay)
