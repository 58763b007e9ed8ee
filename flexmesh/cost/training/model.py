"""The cost model: time and memory of a layer, a stage, a micro-batch and a whole step.

This is the single source of truth for "how long" and "how much memory". The search
(flexmesh.search), the per-step scheduler (flexmesh.schedule) and the simulator (flexmesh.sim) all ask
it; none keeps a private formula. docs/cost-model.md has every formula with its source.

:class:`CostModel` is assembled in one place, its constructor, from the model, the devices and the
job's :class:`~flexmesh.cost.training.parts.Parts`:

- the layer timing (:mod:`flexmesh.cost.training.timing`): FLOPs over throughput by default
  (:mod:`flexmesh.cost.training.analytic`, for the parts' stack and experts), or a model profile's fits;
- what the step trains (:mod:`flexmesh.cost.training.weights`: every weight; or LoRA adapters on a
  frozen base, :mod:`flexmesh.cost.training.adapters`) and, for a mixture of experts, its experts
  (:mod:`flexmesh.cost.training.expert_layers`): parts the layer's pricing asks;
- the layer's pricing (:mod:`flexmesh.cost.training.layer`: one layer and the ends on one device) and
  the step's (:mod:`flexmesh.cost.training.step`: micro-batches for the scheduler and the simulator).

This module adds the whole plan: a stage's layers, the pipeline (:mod:`flexmesh.cost.training.pipeline`,
2104.04473), the gradient sync that overlaps the last micro-batch's backward (overlapped compute slows
down by the factor Galvatron measured on A100, 1.13, 2211.13878, or a hardware profile's measured
overlap), and the memory per pipeline rank (:mod:`flexmesh.cost.training.memory`). Another variant of a
cost model (other parts, devices, kernel model or per-step overlap) is built by :meth:`CostModel.replace`,
through the same constructor.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from flexmesh.cost.device.hardware import GroupShape, Hardware, pipeline_crossings
from flexmesh.cost.device.kernels import Kernels
from flexmesh.cost.training.adapters import AdapterCosts
from flexmesh.cost.training.analytic import AnalyticTiming
from flexmesh.cost.training.evaluation import Evaluation
from flexmesh.cost.training.expert_layers import ExpertLayers
from flexmesh.cost.training.experts import ExpertParallel
from flexmesh.cost.training.layer import LayerPricing
from flexmesh.cost.training.parts import Parts
from flexmesh.cost.training.pipeline import in_flight, pipeline_time
from flexmesh.cost.training.step import activation_bytes_per_token, max_tokens, microbatch_phases, step_grad_sync
from flexmesh.cost.training.timing import LayerTiming
from flexmesh.cost.training.weights import FullTraining, Trained
from flexmesh.cost.training.work import LayerCost, MicrobatchPhases, Work
from flexmesh.errors import SpecError
from flexmesh.layout.overlap import NO_OVERLAP, Overlap
from flexmesh.layout.stack import RUNTIME_STACK
from flexmesh.layout.strategy import LayerStrategy, chunk_anchors
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.model import ModelSpec
from flexmesh.spec.shape import DTYPE_BYTES
from flexmesh.units import GIB


class CostModel:
    """Time and memory for a model on a cluster.

    ``hardware``: a :class:`Hardware` (``flexmesh.profile.use.hardware_from_profile(cluster, profile)`` for a
    measured machine; default: the cluster's device preset). ``timing``: the model's (checked)
    :class:`~flexmesh.cost.training.timing.LayerTiming`, which prices each layer's and the ends' compute and the
    bytes they keep; default :class:`~flexmesh.cost.training.analytic.AnalyticTiming` (FLOPs over the hardware's
    throughput) of the parts' stack and experts. Bytes are counted in the timing's dtype: with a model
    profile's timing the dtype the profile measured, the runtime's. Tensor- and context-parallel
    communication is added unless the timing says its layer times include it (timed under real process
    groups). ``parts``: what the job trains and how (:class:`~flexmesh.cost.training.parts.Parts`: another
    stack's layers, a mixture of experts' parallelism, LoRA adapters). ``step_overlap``: the overlap
    options the per-step methods price (a plan's :attr:`~flexmesh.layout.plan.Plan.overlap`: the scheduler
    and the simulator set it).

    >>> from flexmesh.spec import parse_cluster, parse_model
    >>> cm = CostModel(parse_model("llama2-7b"), parse_cluster("8xA100-80GB"))
    >>> cm.source, type(cm.timing).__name__, type(cm.trained).__name__
    ('preset:A100-80GB', 'AnalyticTiming', 'FullTraining')
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, hardware: Hardware | None = None,
                 timing: LayerTiming | None = None, *, parts: Parts | None = None,
                 step_overlap: Overlap = NO_OVERLAP):
        if timing is not None:
            timing.check_model(model)
            model = replace(model, dtype=timing.dtype)  # bytes in the dtype the timing measured (the runtime's)
        self.model = model
        self.cluster = cluster
        self.hw = hardware or Hardware(cluster, model.dtype)
        self.parts = parts = Parts() if parts is None else parts
        self.step_overlap = step_overlap  # what the per-step methods price
        self.timing: LayerTiming = timing if timing is not None else AnalyticTiming(
            model, self.hw, stack=parts.stack, experts=parts.experts)
        if self.timing.stack != parts.stack:
            raise SpecError(f"a model profile times flexmesh's own runtime ({RUNTIME_STACK.label}, no dropout), "
                            f"not {parts.stack.label}: drop --model-profile to price that stack")
        state_bytes = self.timing.state_bytes_per_param()
        self.weight_bytes, self.grad_bytes, self.optim_bytes = state_bytes
        # what a gradient element moves in the data-parallel reduction (and its buffer holds)
        self.reduce_bytes = DTYPE_BYTES["fp32"] if parts.stack.fp32_grad_reduce else self.grad_bytes
        optimizer = self.timing.optimizer_s_per_param()
        trained: Trained
        if parts.tasks is None:
            trained = FullTraining(self.hw, cluster, state_bytes, optimizer, self.reduce_bytes)
        else:
            analytic = self.timing if isinstance(self.timing, AnalyticTiming) else AnalyticTiming(model, self.hw)
            trained = AdapterCosts(model, self.hw, cluster, state_bytes, optimizer, parts.tasks, analytic,
                                   self.reduce_bytes)
        experts = ExpertLayers(model, cluster, self.hw, self.timing, parts.experts) if model.is_moe else None
        self.layer_pricing = LayerPricing(model, cluster, self.hw, self.timing, trained, experts)

    def replace(self, *, parts: Parts | None = None, cluster: ClusterSpec | None = None,
                hardware: Hardware | None = None, kernels: Callable[[Kernels], Kernels] | None = None,
                step_overlap: Overlap | None = None) -> CostModel:
        """This cost model with some of what it is built from changed, through the one constructor:

        - ``parts``: other parts (another stack, placement of experts, tasks); a model profile prices
          flexmesh's own runtime only;
        - ``cluster``: other devices, priced by their preset unless ``hardware`` is given;
        - ``kernels``: the kernel-time model changed (``Kernels.envelope``, whose collectives are made
          additive too (``CommTable.envelope``), ``Kernels.floor``: for lower bounds); measured timings
          (a model profile) are linear in tokens and squared tokens beyond their fixed cost, and
          monotone, so they stay as they are;
        - ``step_overlap``: alone, a copy sharing this one's caches.

        An analytic timing is rebuilt for the new parts and hardware; a measured one is kept.

        >>> from flexmesh.layout.stack import Stack
        >>> from flexmesh.spec import parse_cluster, parse_model
        >>> cm = CostModel(parse_model("llama2-7b"), parse_cluster("8xA100-80GB"))
        >>> cm.replace(parts=Parts(stack=Stack(dropout=True))).timing.stack.label
        'fused attention, sequence parallel, dropout'
        """
        if kernels is not None and not isinstance(self.timing, AnalyticTiming):
            kernels = None
        if parts == self.parts:
            parts = None
        if parts is None and cluster is None and hardware is None and kernels is None:
            if step_overlap is None or step_overlap == self.step_overlap:
                return self
            other = copy.copy(self)
            other.step_overlap = step_overlap
            return other
        parts = self.parts if parts is None else parts
        hw = hardware if hardware is not None else Hardware(cluster, self.model.dtype) if cluster is not None \
            else self.hw
        timing = self.timing
        if kernels is not None and isinstance(timing, AnalyticTiming):
            hw = hw.additive() if kernels is Kernels.envelope else copy.copy(hw)
            hw.kernels = kernels(timing.kernels)
        if isinstance(timing, AnalyticTiming):
            timing = AnalyticTiming(self.model, hw, timing.ring_balanced, parts.stack, parts.experts)
        return CostModel(self.model, cluster or self.cluster, hw, timing, parts=parts,
                         step_overlap=self.step_overlap if step_overlap is None else step_overlap)

    @property
    def source(self) -> str:
        """``preset:<dev>``, ``profile:<hw>``, ``profile:<hw>+<model>`` or ``preset:<dev>+profile:<model>``."""
        return self.timing.source(self.hw.source)

    @property
    def memory_budget(self) -> float:
        """Bytes per device the estimates may fill (:attr:`DeviceSpec.usable_memory_bytes`, the one formula)."""
        return self.hw.memory_bytes

    @property
    def experts(self) -> ExpertParallel:
        """How a mixture of experts runs (the parts')."""
        return self.parts.experts

    @property
    def trained(self) -> Trained:
        """What the step trains (:class:`FullTraining`, or :class:`AdapterCosts` for LoRA tasks)."""
        return self.layer_pricing.trained

    # ---- one layer (flexmesh.cost.training.layer) ------------------------------------------------------
    def layer(self, s: LayerStrategy, work: Work, overlap: Overlap = NO_OVERLAP) -> LayerCost:
        """One transformer layer on one device of a tp x cp group processing ``work``."""
        return self.layer_pricing.layer(s, work, overlap)

    def ends(self, s: LayerStrategy, work: Work, embed: bool, head: bool, overlap: Overlap = NO_OVERLAP) -> LayerCost:
        """Embedding (first stage) and final norm + LM head + loss (last stage), vocab-parallel over tp."""
        return self.layer_pricing.ends(s, work, embed, head, overlap)

    def transition(self, a: LayerStrategy, b: LayerStrategy, work_a: Work) -> float:
        """Resharding activations between consecutive layers placed differently (fwd + bwd), s."""
        return self.layer_pricing.transition(a, b, work_a)

    def layer_work(self, s: LayerStrategy, microbatch_seqs: int, seq_len: int) -> Work:
        """Work of one replica of a layer when a stage's micro-batch of equal-length sequences splits over dp."""
        return self.layer_pricing.layer_work(s, microbatch_seqs, seq_len)

    def ring_hops(self, cp: int, block_tokens):  # noqa: ANN001, ANN201 - floats or numpy arrays
        """K/V hops of ring attention per pass with blocks of ``block_tokens``, mean over layers; None
        without a sliding window (all ``cp - 1``).

        A block ``h`` ranks back is within reach of a window ``w`` while ``(h - 1) * block + 1 < w``, so
        ``min(cp - 1, ceil((w - 1) / block))`` hops (the runtime's ``ring_steps`` minus one).

        >>> from flexmesh.spec import parse_cluster, parse_model
        >>> cm = CostModel(replace(parse_model("tiny"), sliding_window=1000), parse_cluster("8xA100-80GB"))
        >>> cm.ring_hops(8, 512.0), cm.ring_hops(8, 100.0), cm.ring_hops(8, 1000.0)
        (2.0, 7.0, 1.0)
        """
        return self.layer_pricing.ring_hops(cp, block_tokens)

    def attention_sq(self, start, end):  # noqa: ANN001, ANN201 - floats or numpy arrays
        """Squared-token attention work of queries [start, end) of a sequence under this model's
        sliding windows (:func:`flexmesh.cost.training.work.attention_sq`); ``end**2 - start**2`` without one."""
        return self.layer_pricing.attention_sq(start, end)

    # ---- a step's micro-batches (flexmesh.cost.training.step) ------------------------------------------
    def microbatch_time(self, s: LayerStrategy, tokens, sq_tokens, layers: int | None = None,  # noqa: ANN001, ANN201
                        embed: bool = True, head: bool = True):
        """Forward + backward seconds of one micro-batch on a tp x cp group; numpy arrays accepted. ZeRO
        collectives are per step and left to :meth:`step_grad_sync`."""
        return self.microbatch_phases(s, tokens, sq_tokens, layers, head, embed=embed).total

    def microbatch_phases(self, s: LayerStrategy, tokens, sq_tokens, layers: int | None = None,  # noqa: ANN001
                          head: bool = True, embed: bool = False) -> MicrobatchPhases:
        """:meth:`microbatch_time` split into forward and backward, compute and exposed communication,
        so that a pipeline simulation can order the passes. The embedding costs what the timing says
        (nothing analytically: a lookup has no FLOPs to count; a model profile's fit). TP communication
        is exposed or overlapped as :attr:`step_overlap` says."""
        layers = self.model.num_layers if layers is None else layers
        return microbatch_phases(self.layer_pricing, s, tokens, sq_tokens, layers, head, embed, self.step_overlap)

    def activation_bytes_per_token(self, s: LayerStrategy, layers: int | None = None,
                                   in_flight_mbs: float = 1.0) -> float:
        """Saved-activation bytes per token of a micro-batch on each device of a tp x cp group."""
        layers = self.model.num_layers if layers is None else layers
        return activation_bytes_per_token(self.layer_pricing, s, layers, in_flight_mbs)

    def max_tokens(self, s: LayerStrategy, layers: int | None = None, embed: bool = True, head: bool = True,
                   in_flight_mbs: float = 1.0, overlap: Overlap | None = None) -> int:
        """Largest micro-batch (tokens on the tp x cp group) that fits in device memory under ``s``
        (and ``overlap``, default :attr:`step_overlap`)."""
        layers = self.model.num_layers if layers is None else layers
        overlap = self.step_overlap if overlap is None else overlap
        return max_tokens(self.layer_pricing, s, layers, embed, head, in_flight_mbs, overlap, self.memory_budget)

    def step_grad_sync(self, s: LayerStrategy, data_ranks: int, layers: int | None = None,
                       embed: bool = True, head: bool = True) -> tuple[float, float]:
        """(gradient sync, optimizer) seconds, once per step, for one stage's parameters over
        ``data_ranks`` (:func:`flexmesh.cost.training.step.step_grad_sync`)."""
        layers = self.model.num_layers if layers is None else layers
        return step_grad_sync(self.layer_pricing, s, data_ranks, layers, embed, head)

    # ---- a whole plan ---------------------------------------------------------------------------------
    def stage_cost(self, strategies, microbatch_seqs: int, seq_len: int, embed: bool, head: bool,
                   overlap: Overlap = NO_OVERLAP, anchor: LayerStrategy | None = None) -> LayerCost:
        """Sum over a stage's layers (plus embedding/head), per device, for one micro-batch; a stage of no
        layers runs its embedding or head as ``anchor`` (flexmesh.layout.strategy.chunk_anchors)."""
        total = LayerCost()
        prev = None
        for s in strategies:
            work = self.layer_work(s, microbatch_seqs, seq_len)
            if prev is not None and not prev[0].same_mesh(s):
                total = total + LayerCost(comm_fwd=self.transition(prev[0], s, prev[1]))
            total = total + self.layer(s, work, overlap)
            prev = (s, work)
        first, last = (strategies[0], strategies[-1]) if strategies else (anchor, anchor)
        for s, e, h in ((first, embed, False), (last, False, head)):
            if (e or h) and s is not None:
                total = total + self.ends(s, self.layer_work(s, microbatch_seqs, seq_len), e, h, overlap)
        return total

    @staticmethod
    def effective_overlap(overlap: Overlap, m: int) -> Overlap:
        """``overlap`` as it acts with ``m`` micro-batches: with one, its backward is the last, so
        reducing once and reducing every micro-batch are the same thing (priced as ``"bucketed"``)."""
        return replace(overlap, grad_reduce="bucketed") if m == 1 else overlap

    def pipeline_crossings(self, pp: int, v: int = 1) -> tuple[bool, ...]:
        """Per pipeline rank, whether its pipeline sends leave its node (:func:`pipeline_crossings`)."""
        return pipeline_crossings(self.cluster.world_size, self.cluster.devices_per_node, pp, v)

    def pipeline_p2p(self, s: LayerStrategy, microbatch_seqs: int, seq_len: int, pp: int,
                     crosses_nodes: bool = True) -> float:
        """Send + receive of one micro-batch's boundary activations, forward and backward (exposed), over
        the node network or, for a rank whose boundary stays inside its node (``crosses_nodes`` False,
        :meth:`pipeline_crossings`), over the node's links; plus the framework's fixed seconds per
        pipeline chunk (:meth:`LayerTiming.stage_fixed_s`)."""
        if pp == 1:
            return 0.0
        work = self.layer_work(s, microbatch_seqs, seq_len)
        nbytes = work.tokens / s.cp / s.tp * self.model.hidden * self.model.dtype_bytes
        shape = GroupShape(2, 1 if crosses_nodes else 2)
        return 2 * self.hw.collective_time("send_recv", nbytes, shape) + self.timing.stage_fixed_s()

    def evaluate_stages(self, stage_strategies, pp: int, pipeline_schedule: str, m: int, v: int,
                        microbatch_seqs: int, seq_len: int, overlap: Overlap = NO_OVERLAP, speed: float | None = None,
                        cross_sync=()) -> Evaluation:  # noqa: ANN001 - seconds per pipeline rank
        """Predict a step from per-chunk layer strategies (``pp * v`` chunks, Megatron's rank order)
        under ``overlap`` (default :data:`NO_OVERLAP`; a plan carries its own), every device at ``speed``
        (default: the cluster's ``pace``, its slowest device's, which a layout over all of them waits
        for); a replica group (flexmesh.cost.training.mixed) passes its devices' and adds ``cross_sync`` seconds
        per pipeline rank of once-per-step gradient sync with the other groups."""
        speed = self.cluster.pace if speed is None else speed
        chunks = list(stage_strategies)
        n = len(chunks)
        overlap = self.effective_overlap(overlap, m)
        anchors = chunk_anchors(chunks, pp)
        # Chunks of the same layers cost the same (a uniform plan has a handful of distinct chunks).
        priced: dict[tuple, LayerCost] = {}
        costs = []
        for i, st in enumerate(chunks):
            key = (tuple(st), i == 0, i == n - 1, anchors[i])
            if key not in priced:
                priced[key] = self.stage_cost(st, microbatch_seqs, seq_len, i == 0, i == n - 1, overlap, anchors[i])
            costs.append(priced[key])
        rank_cost = [LayerCost() for _ in range(pp)]
        rank_layers = [0] * pp
        for i, c in enumerate(costs):
            rank_cost[i % pp] = rank_cost[i % pp] + c
            rank_layers[i % pp] += len(chunks[i])
        if speed != 1.0:  # a slow device stretches compute, not communication (the simulator's rule)
            rank_cost = [replace(rc, fwd=rc.fwd / speed, bwd=rc.bwd / speed, optim=rc.optim / speed)
                         for rc in rank_cost]
        crossings = self.pipeline_crossings(pp, v)
        sends: dict[tuple, float] = {}  # per (first strategy, leaves the node): most ranks share one
        for i in range(pp):
            if (anchors[i], crossings[i]) not in sends:
                sends[(anchors[i], crossings[i])] = self.pipeline_p2p(anchors[i], microbatch_seqs, seq_len, pp,
                                                                      crossings[i]) * v
        p2p = [sends[(anchors[i], crossings[i])] for i in range(pp)]
        rank_times = [rc.time + p for rc, p in zip(rank_cost, p2p, strict=True)]
        t_pipe = pipeline_time(pipeline_schedule, rank_times, m, v)
        # Gradient sync and optimizer after the pipeline drains; sync overlaps the last backward.
        tails = [self.exposed_sync(rc.grad_sync + (cross_sync[r] if cross_sync else 0.0), rc.bwd, layers) + rc.optim
                 for r, (rc, layers) in enumerate(zip(rank_cost, rank_layers, strict=True))]
        step = t_pipe + max(tails)
        busiest = int(np.argmax(rank_times))
        compute = m * (rank_cost[busiest].fwd + rank_cost[busiest].bwd)
        exposed = m * (rank_cost[busiest].comm_fwd + rank_cost[busiest].comm_bwd + p2p[busiest])
        bubble = t_pipe - m * rank_times[busiest]
        last = (chunks[-1] or anchors[-1:])[-1]
        logits = self.ends(last, self.layer_work(last, microbatch_seqs, seq_len), False, True, overlap).transient
        memory = []
        transients: dict[frozenset, float] = {}  # per set of strategies a rank runs
        for r in range(pp):
            rc = rank_cost[r]
            flight = in_flight(pipeline_schedule, pp, r, m, v)
            held = frozenset(s for i in range(r, n, pp) for s in chunks[i])
            if held not in transients:
                transients[held] = max((self.layer(s, self.layer_work(s, microbatch_seqs, seq_len), overlap).transient
                                        for s in held), default=0.0)
            layer_transient = transients[held]
            mem = {"states": rc.states, "activations": rc.act * flight, "transient": layer_transient,
                   "logits": logits if r == (n - 1) % pp else 0.0}
            mem["total"] = sum(mem.values())
            memory.append(mem)
        tokens = microbatch_seqs * m * seq_len
        mfu = self.model.model_flops(tokens, microbatch_seqs * m * float(self.attention_sq(0.0, float(seq_len)))) / (
            step * self.cluster.world_size * self.hw.peak_flops)
        budget = self.memory_budget
        return Evaluation(step_time=step, tokens_per_s=tokens / step, mfu=mfu, compute=compute,
                          exposed_comm=exposed, bubble=bubble, grad_sync=max(tails), stage_times=rank_times,
                          memory=memory, fits=all(x["total"] <= budget for x in memory), budget=budget,
                          reserve=self.cluster.device.framework_reserve_gib * GIB,
                          fragmentation=self.cluster.device.allocator_headroom)

    def exposed_sync(self, sync, last_backward, layers):
        """Seconds of a once-per-step gradient sync left after the last backward pass ends (arrays too).

        Layer by layer the gradients become ready during the last micro-batch's backward, so the sync
        hides under it except for the first layer's share, as far as the hardware overlaps
        communication with compute (:meth:`Hardware.exposed`); a stack that reduces after the backward
        (``Framework.grad_sync_overlapped`` False) leaves all of it exposed. The same rule serves the plan
        evaluation, the search and the step simulator.

        >>> from flexmesh.spec import parse_cluster, parse_model
        >>> cm = CostModel(parse_model("llama2-7b"), parse_cluster("1x8xA100-80GB"))
        >>> round(float(cm.exposed_sync(1.0, 4.0, layers=4)), 3)  # all hidden; 13% slowdown on 1 s
        0.13
        >>> round(float(cm.exposed_sync(1.0, 0.4, layers=4)), 3)  # 0.3 s hidden, 0.7 s exposed
        0.739
        """
        if not self.parts.stack.framework.grad_sync_overlapped:
            return sync
        window = last_backward * (1 - 1 / np.maximum(layers, 1))
        return self.hw.exposed(sync, window)

    def evaluate(self, plan) -> Evaluation:
        """Predict a :class:`flexmesh.search.Plan` of one replica group (flexmesh.cost.training.mixed: several)."""
        return self.evaluate_stages([st.strategies for st in plan.stages], plan.pp, plan.pipeline_schedule,
                                    plan.num_microbatches, plan.virtual_stages, plan.microbatch_size, plan.seq_len,
                                    plan.overlap)
