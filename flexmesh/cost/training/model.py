"""The cost model: time and memory of a layer, a stage, a micro-batch and a whole step.

This is the single source of truth for "how long" and "how much memory". The search
(flexmesh.search), the per-step scheduler (flexmesh.schedule) and the simulator (flexmesh.sim) all ask
it; none keeps a private formula. docs/cost-model.md has every formula with its source.

A layer's compute times and the bytes it keeps come from a :class:`~flexmesh.cost.training.timing.LayerTiming`:
FLOPs over throughput by default (:mod:`flexmesh.cost.training.analytic`, which cites its sources), a model
profile's fits with ``flexmesh.profile`` (``flexmesh.profile.use.cost_model_from_profiles``). This
module adds what depends on the cluster and the strategy, with these sources:

- Tensor parallelism with sequence parallelism: two all-gathers and two reduce-scatters of the
  layer's activation per pass (Korthikanti et al., 2205.05198); Ulysses: all-to-all of q, k, v and
  of the output per pass (DeepSpeed-Ulysses, 2309.14509); ring attention: ``cp - 1`` K/V hops per
  pass, each hidden under one block of attention (Liu et al., 2310.01889); with a sliding window
  only the hops to blocks within reach (:meth:`CostModel.ring_hops`, the runtime's ``ring_steps``).
- ZeRO (1910.02054): ZeRO-3 gathers weights for forward and backward and reduce-scatters gradients
  per micro-batch, prefetched under the layer's compute; DP to ZeRO-2 sync gradients once per step.
- Gradient sync overlaps the last micro-batch's backward; overlapped compute slows down by the
  factor Galvatron measured on A100 (1.13, 2211.13878), or a hardware profile's measured overlap.
- Overlap options (:class:`~flexmesh.layout.overlap.Overlap`, a plan-level choice): TP communication
  under the GEMMs, ZeRO-2/3 gradients reduced once or every micro-batch, ZeRO-3 gathers prefetched;
  every overlapped collective costs what does not fit under its compute (:meth:`Hardware.exposed`).
- Memory: states, activations, logits and per-layer transient buffers (:mod:`flexmesh.cost.training.memory`);
  pipeline step time and in-flight micro-batches: :mod:`flexmesh.cost.training.pipeline` (2104.04473).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from functools import lru_cache
from typing import Callable, cast

import numpy as np

from flexmesh.cost.device.hardware import GroupShape, Hardware, group_shape, pipeline_crossings
from flexmesh.cost.device.kernels import Kernels
from flexmesh.cost.training.analytic import AnalyticTiming
from flexmesh.cost.training.evaluation import Evaluation
from flexmesh.cost.training.experts import (
    ExpertParallel,
    expert_imbalanced,
    expert_states,
    expert_sync,
    gathered_expert_bytes,
    moe_communication,
    synced_params,
)
from flexmesh.cost.training.memory import layer_transient_bytes
from flexmesh.cost.training.pipeline import in_flight, pipeline_time
from flexmesh.cost.training.step_pricing import StepPricing
from flexmesh.cost.training.timing import LayerTiming
from flexmesh.cost.training.work import NO_WINDOW, LayerCost, Work, attention_sq, ring_hops
from flexmesh.layout.overlap import NO_OVERLAP, Overlap, acting
from flexmesh.layout.strategy import LayerStrategy, Recompute, chunk_anchors
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.model import ModelSpec
from flexmesh.units import GIB


class CostModel(StepPricing):
    """Time and memory for a model on a cluster.

    ``hardware``: a :class:`Hardware` (``flexmesh.profile.use.hardware_from_profile(cluster, profile)`` for a
    measured machine; default: the cluster's device preset). ``timing``: the model's (checked)
    :class:`~flexmesh.cost.training.timing.LayerTiming`, which prices each layer's and the ends' compute and the
    bytes they keep; default :class:`~flexmesh.cost.training.analytic.AnalyticTiming` (FLOPs over the hardware's
    throughput). Bytes are counted in the timing's dtype: with a model profile's timing the dtype the
    profile measured, the runtime's. Tensor- and context-parallel communication is added unless the
    timing says its layer times include it (timed under real process groups).

    >>> from flexmesh.spec import parse_cluster, parse_model
    >>> cm = CostModel(parse_model("llama2-7b"), parse_cluster("8xA100-80GB"))
    >>> cm.source, type(cm.timing).__name__
    ('preset:A100-80GB', 'AnalyticTiming')
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, hardware: Hardware | None = None,
                 timing: LayerTiming | None = None, experts: ExpertParallel | None = None):
        if timing is not None:
            timing.check_model(model)
            model = replace(model, dtype=timing.dtype)  # bytes in the dtype the timing measured (the runtime's)
        self.model = model
        self.windows = model.attention_windows if model.sliding_window is not None else NO_WINDOW  # NO_WINDOW: s^2
        self.cluster = cluster
        self.hw = hardware or Hardware(cluster, model.dtype)
        self.experts = experts or ExpertParallel()  # how a mixture of experts runs (flexmesh.cost.training.experts)
        self.timing: LayerTiming = timing if timing is not None else AnalyticTiming(model, self.hw,
                                                                                    experts=self.experts)
        self.weight_bytes, self.grad_bytes, self.optim_bytes = self.timing.state_bytes_per_param()
        self._layer = lru_cache(maxsize=None)(self._layer_uncached)
        self.step_overlap: Overlap = NO_OVERLAP  # what the per-step methods price (with_step_overlap)
        self._ends = lru_cache(maxsize=None)(self._ends_uncached)
        self._phases = lru_cache(maxsize=None)(self._layer_phases)
        self._dp_collectives = lru_cache(maxsize=None)(self._dp_collectives_uncached)
        self._work = lru_cache(maxsize=None)(lambda seqs, seq_len: Work.uniform(seqs, seq_len, self.windows))
        self._even: AnalyticTiming | None = None  # experts at an even load (flexmesh.cost.training.experts)

    @property
    def source(self) -> str:
        """``preset:<dev>``, ``profile:<hw>``, ``profile:<hw>+<model>`` or ``preset:<dev>+profile:<model>``."""
        return self.timing.source(self.hw.source)

    @property
    def memory_budget(self) -> float:
        """Bytes per device the estimates may fill (:attr:`DeviceSpec.usable_memory_bytes`, the one formula)."""
        return self.hw.memory_bytes

    # ---- building blocks ---------------------------------------------------------------------------
    def _states(self, params: float, s: LayerStrategy, overlap: Overlap = NO_OVERLAP) -> float:
        """Bytes of weights, gradients and optimizer states for ``params`` parameters on one device.

        With ``grad_reduce="last"`` ZeRO-2/3 gradients accumulate unsharded until the step's one
        reduce-scatter (FSDP2 without gradient sync on the other micro-batches keeps them so).
        """
        p = params / s.tp
        w, g, o = self.weight_bytes, self.grad_bytes, self.optim_bytes
        d = s.shard_degree
        if s.zero >= 1:
            o /= d
        if s.zero >= 2 and overlap.grad_reduce == "bucketed":
            g /= d
        if s.zero >= 3:
            w /= d
        return p * (w + g + o)

    def _grad_comm(self, params: float, s: LayerStrategy, work_fwd: float, work_bwd: float,
                   overlap: Overlap = NO_OVERLAP):
        """(exposed fwd, exposed bwd, per-step sync, optimizer time) for ZeRO / DP of ``params``.

        ZeRO-0/1 reduce once per step. ZeRO-2/3 reduce-scatter every micro-batch under its backward
        (``grad_reduce="bucketed"``) or once per step (``"last"``, the step's sync). ZeRO-3 gathers
        weights for forward and backward every micro-batch, under the previous layer's compute when
        prefetched, exposed when not.

        Sharded data parallelism also copies on the compute stream, which no overlap hides (counted from
        FSDP2, torch.distributed.fsdp._fully_shard._fsdp_collectives): every all-gather's output is
        split into the parameters (``foreach_all_gather_copy_out``: the layer's weights read and
        written), and every reduce-scatter's input is first packed from the unsharded gradients
        (``foreach_reduce_scatter_copy_in``: its gradients read and written).
        """
        d = s.shard_degree
        optim = params / s.tp / (d if s.zero >= 1 else 1) * self.timing.optimizer_s_per_param()
        if d == 1:
            return 0.0, 0.0, 0.0, optim
        ar, rs, ag, copy_out, copy_in = self._dp_collectives(params, s.tp, d, s.zero >= 2)
        if s.zero <= 1:  # all-reduce, or reduce-scatter + all-gather of the same volume
            return 0.0, 0.0, ar, optim
        exposed = self.hw.exposed
        every = overlap.grad_reduce == "bucketed"
        if s.zero == 2:  # reduce-scatter (every micro-batch or once), all-gather updated weights once
            ag_once = ag + copy_out
            if every:
                return 0.0, float(exposed(rs, work_bwd)) + copy_in, ag_once, optim
            return 0.0, 0.0, ag_once + rs + copy_in, optim
        # ZeRO-3: gather weights for forward and for backward every micro-batch, under the previous
        # layer's compute when prefetched (a window of 0 leaves a gather exposed).
        win_f, win_b = (work_fwd, work_bwd) if overlap.zero3_prefetch else (0.0, 0.0)
        fwd = float(exposed(ag, win_f)) + copy_out
        if every:
            bwd = exposed(ag + rs, win_b) if overlap.zero3_prefetch else ag + exposed(rs, work_bwd)
            return fwd, float(bwd) + copy_out + copy_in, 0.0, optim
        return fwd, float(exposed(ag, win_b)) + copy_out, rs + copy_in, optim

    def _dp_collectives_uncached(self, params: float, tp: int, d: int,
                                 sharded: bool) -> tuple[float, float, float, float, float]:
        """(all-reduce, reduce-scatter, all-gather, copy-out, copy-in) seconds of :meth:`_grad_comm` for
        ``params`` over ``tp`` x ``d`` ranks, unsharded or ZeRO-2/3; no micro-batch enters them."""
        shape = group_shape(d, tp, self.cluster)
        ct = self.hw.collective_time
        grads, weights = params / tp * self.grad_bytes, params / tp * self.weight_bytes
        if not sharded:
            return float(ct("all_reduce", grads, shape)), 0.0, 0.0, 0.0, 0.0
        return (0.0, float(ct("reduce_scatter", grads, shape)), float(ct("all_gather", weights, shape)),
                float(self.hw.copy_time(2 * weights)), float(self.hw.copy_time(2 * grads)))

    # ---- a transformer layer ----------------------------------------------------------------------
    def layer(self, s: LayerStrategy, work: Work, overlap: Overlap = NO_OVERLAP) -> LayerCost:
        """One transformer layer on one device of a tp x cp group processing ``work``."""
        return self._layer(s, work, acting(overlap, s, True))

    def _layer_phases(self, s: LayerStrategy, tokens, sq_tokens, overlap: Overlap = NO_OVERLAP):
        """(fwd, bwd, comm_fwd, comm_bwd) seconds of one layer on a tp x cp group; scalars or arrays.

        Compute, and the tensor- and context-parallel communication that does not hide under it. With
        ``overlap.tp_comm`` the TP collectives are pipelined with the GEMMs (Megatron-Core's TP
        overlap): exposed is what does not fit under the layer's matmul time of that pass.
        """
        m, hw, ct = self.model, self.hw, self.hw.collective_time
        times = self.timing.layer_times(s, tokens, sq_tokens)
        if m.is_moe and not isinstance(self.timing, AnalyticTiming):  # measured on one rank: experts even there
            if self._even is None:
                self._even = AnalyticTiming(m, hw, experts=replace(self.experts, imbalance=1.0, measured=()))
            times = expert_imbalanced(times, self._even, self.experts.imbalance_at(s.dp * s.cp * s.tp), s, tokens,
                                      sq_tokens)
        if times.includes_communication:  # timed under real tp x cp groups: their communication is in the times
            return times.fwd, times.bwd, 0.0, 0.0
        fwd, bwd, t_attn = times.fwd, times.bwd, times.attention
        b = m.dtype_bytes
        dev_tokens = tokens / s.cp  # tokens held by each tp rank of the group (sequence split by cp)
        bwd_passes = 2 if s.recompute else 1  # recomputation repeats the forward's collectives
        # Selective recomputation reruns the attention core with its CP collectives (the runtime's
        # Attention.recompute_core checkpoints attend: all-to-alls, ring passes), not the TP ones.
        cp_passes = 2 if s.recompute or s.recompute is Recompute.SELECTIVE else 1
        comm_f = comm_b = 0.0
        if s.tp > 1:
            # Sequence parallelism: all-gather before and reduce-scatter after each of the two blocks.
            shape = group_shape(s.tp, 1, self.cluster)
            act = dev_tokens * m.hidden * b
            per_pass = 2 * ct("all_gather", act, shape) + 2 * ct("reduce_scatter", act, shape)
            if overlap.tp_comm:  # under the GEMMs: the pass's compute less its attention core
                gemm_f = fwd - t_attn
                gemm_b = bwd * np.where(fwd > 0, gemm_f / np.where(fwd > 0, fwd, 1.0), 1.0)  # same share in bwd
                comm_f = comm_f + hw.exposed(per_pass, gemm_f)
                comm_b = comm_b + hw.exposed(bwd_passes * per_pass, gemm_b)
            else:
                comm_f, comm_b = comm_f + per_pass, comm_b + bwd_passes * per_pass
        if s.cp > 1:
            shape = group_shape(s.cp, s.tp, self.cluster)
            if s.cp_kind == "ulysses":
                # q, k, v scattered by head and gathered by sequence, then the output back.
                qkv = dev_tokens * (m.q_dim + 2 * m.kv_dim) / s.tp * b
                out = dev_tokens * m.q_dim / s.tp * b
                per_pass = ct("all_to_all", qkv, shape) + ct("all_to_all", out, shape)
                comm_f, comm_b = comm_f + per_pass, comm_b + cp_passes * per_pass
            else:
                # Ring: cp - 1 hops of the local K/V block, each hidden under one block of attention;
                # backward moves K/V and dK/dV (twice the bytes) under twice the attention work.
                hop = ct("send_recv", dev_tokens * 2 * m.kv_dim / s.tp * b, shape)
                hops = self.ring_hops(s.cp, dev_tokens)
                if hops is None:
                    exposed_f = (s.cp - 1) * hw.exposed(hop, t_attn / s.cp)
                else:  # the attention work spreads over the blocks visited, own block included
                    exposed_f = hops * hw.exposed(hop, t_attn / (hops + 1))
                comm_f, comm_b = comm_f + exposed_f, comm_b + exposed_f * (1 + cp_passes)
        if m.is_moe:  # the experts' exchanges over the data ranks (flexmesh.cost.training.experts)
            tf, tb, wf, wb = moe_communication(ct, self.cluster, m, self.experts, s.dp * s.cp * s.tp, dev_tokens / s.tp,
                                               bool(s.recompute))
            if self.experts.prefetch:  # the weights' exchanges under the layer's compute
                wf, wb = hw.exposed(wf, fwd), hw.exposed(wb, bwd)
            comm_f, comm_b = comm_f + tf + wf, comm_b + tb + wb
        return fwd, bwd, comm_f, comm_b

    def _layer_uncached(self, s: LayerStrategy, work: Work, overlap: Overlap) -> LayerCost:
        m = self.model
        group = s.phase_group(m.is_moe)  # phases are shared by every dp and ZeRO stage of a tp x cp group
        fwd, bwd, comm_f, comm_b = map(float, self._phases(group, float(work.tokens), float(work.sq_tokens), overlap))
        # routed experts: below; the router and shared expert are whole on every tp rank (tp x as many)
        params = synced_params(m, s.tp)
        zf, zb, sync, optim = self._grad_comm(params, s, fwd, bwd, overlap)
        timing = self.timing
        act_full = timing.activation_bytes(s, work.tokens, False) + timing.mask_bytes(s, work.tokens, work.sq_tokens)
        # Hook for partial recomputation: the timing says what a strategy keeps; full recomputation
        # keeps the layer input and holds the full set again while the layer is recomputed.
        act = timing.activation_bytes(s, work.tokens, True) if s.recompute else act_full
        transient = layer_transient_bytes(m, s, work.tokens, overlap, act_full if s.recompute else 0.0,
                                          self.grad_bytes)
        states = self._states(params, s, overlap)
        if m.is_moe:  # experts sharded over the stage's ranks, their gathered copies kept for backward
            n = s.dp * s.cp * s.tp
            states += expert_states(m, self.experts, n, (self.weight_bytes, self.grad_bytes, self.optim_bytes))
            esync, eopt = expert_sync(self.hw.collective_time, self.cluster, m, self.experts, n, self.grad_bytes,
                                      timing.optimizer_s_per_param())
            sync, optim = sync + esync, optim + eopt
            gathered = gathered_expert_bytes(m, self.experts, n)
            act, transient = (act, transient + gathered) if s.recompute else (act + gathered, transient)
        return LayerCost(fwd=fwd, bwd=bwd, comm_fwd=comm_f + zf, comm_bwd=comm_b + zb, grad_sync=sync,
                         optim=optim, states=states, act=act, transient=transient)

    def transition(self, a: LayerStrategy, b: LayerStrategy, work_a: Work) -> float:
        """Resharding activations between consecutive layers placed differently (fwd + bwd), s.

        The boundary activation is redistributed over the stage's devices by an all-to-all, and its
        gradient comes back the same way.
        """
        if a.same_mesh(b):
            return 0.0
        nbytes = work_a.tokens / (a.cp * a.tp) * self.model.hidden * self.model.dtype_bytes
        shape = group_shape(a.devices, 1, self.cluster)
        return 2 * self.hw.collective_time("all_to_all", nbytes, shape)

    # ---- embedding and LM head ----------------------------------------------------------------------
    def ends(self, s: LayerStrategy, work: Work, embed: bool, head: bool, overlap: Overlap = NO_OVERLAP) -> LayerCost:
        """Embedding (first stage) and final norm + LM head + loss (last stage), vocab-parallel over tp."""
        return self._ends(s, work, embed, head, acting(overlap, s, False))

    def _ends_uncached(self, s: LayerStrategy, work: Work, embed: bool, head: bool, overlap: Overlap) -> LayerCost:
        m = self.model
        total = LayerCost()
        if embed:
            fwd, bwd = (float(x) for x in self.timing.embedding_times(s, work.tokens))
            act = self.timing.embedding_activation_bytes(s, work.tokens)
            zf, zb, sync, optim = self._grad_comm(m.embedding_params, s, fwd, bwd, overlap)
            total = total + LayerCost(fwd=fwd, bwd=bwd, comm_fwd=zf, comm_bwd=zb, grad_sync=sync, optim=optim,
                                      states=self._states(m.embedding_params, s, overlap), act=act)
        if head:
            params = m.head_params
            if m.tie_embeddings and not embed:  # a tied head on another stage keeps its own copy
                params += m.vocab * m.hidden
            fwd, bwd = cast(tuple[float, float], self.timing.head_times(s, work.tokens))  # scalars in, scalars out
            zf, zb, sync, optim = self._grad_comm(params, s, fwd, bwd, overlap)
            total = total + LayerCost(fwd=fwd, bwd=bwd, comm_fwd=zf, comm_bwd=zb, grad_sync=sync, optim=optim,
                                      states=self._states(params, s, overlap),
                                      transient=self.timing.logit_bytes(s, work.tokens))
        return total

    def layer_work(self, s: LayerStrategy, microbatch_seqs: int, seq_len: int) -> Work:
        """Work of one replica of a layer when a stage's micro-batch of equal-length sequences splits over dp."""
        return self._work(microbatch_seqs / s.dp, seq_len)

    def ring_hops(self, cp: int, block_tokens):  # noqa: ANN001, ANN201 - floats or numpy arrays
        """K/V hops of ring attention per pass with blocks of ``block_tokens``, mean over layers; None
        without a sliding window (all ``cp - 1``).

        A block ``h`` ranks back is within reach of a window ``w`` while ``(h - 1) * block + 1 < w``, so
        ``min(cp - 1, ceil((w - 1) / block))`` hops (the runtime's ``ring_steps`` minus one).

        >>> from flexmesh.spec import parse_cluster, parse_model
        >>> from dataclasses import replace
        >>> cm = CostModel(replace(parse_model("tiny"), sliding_window=1000), parse_cluster("8xA100-80GB"))
        >>> cm.ring_hops(8, 512.0), cm.ring_hops(8, 100.0), cm.ring_hops(8, 1000.0)
        (2.0, 7.0, 1.0)
        """
        if self.windows == NO_WINDOW:
            return None
        return ring_hops(cp, block_tokens, self.windows)

    def attention_sq(self, start, end):  # noqa: ANN001, ANN201 - floats or numpy arrays
        """Squared-token attention work of queries [start, end) of a sequence under this model's
        sliding windows (:func:`flexmesh.cost.training.work.attention_sq`); ``end**2 - start**2`` without one."""
        return attention_sq(start, end, self.windows)

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
        communication with compute (:meth:`Hardware.exposed`). The same rule serves the plan
        evaluation, the search and the step simulator.

        >>> from flexmesh.spec import parse_cluster, parse_model
        >>> cm = CostModel(parse_model("llama2-7b"), parse_cluster("1x8xA100-80GB"))
        >>> round(float(cm.exposed_sync(1.0, 4.0, layers=4)), 3)  # all hidden; 13% slowdown on 1 s
        0.13
        >>> round(float(cm.exposed_sync(1.0, 0.4, layers=4)), 3)  # 0.3 s hidden, 0.7 s exposed
        0.739
        """
        window = last_backward * (1 - 1 / np.maximum(layers, 1))
        return self.hw.exposed(sync, window)

    def evaluate(self, plan) -> Evaluation:
        """Predict a :class:`flexmesh.search.Plan` of one replica group (flexmesh.cost.training.mixed: several)."""
        return self.evaluate_stages([st.strategies for st in plan.stages], plan.pp, plan.pipeline_schedule,
                                    plan.num_microbatches, plan.virtual_stages, plan.microbatch_size, plan.seq_len,
                                    plan.overlap)

    # ---- variants ---------------------------------------------------------------------------------------
    def with_step_overlap(self, overlap: Overlap) -> CostModel:
        """This cost model (sharing its caches) with its per-step methods priced under ``overlap``,
        a plan's :attr:`~flexmesh.layout.plan.Plan.overlap` (the scheduler and the simulator use it)."""
        other = copy.copy(self)
        other.step_overlap = overlap
        return other

    def with_kernels(self, change: Callable[[Kernels], Kernels]) -> CostModel:
        """The same device with its kernel-time model changed (``Kernels.envelope``, whose collectives are
        made additive too (``CommTable.envelope``), ``Kernels.floor``: for lower bounds); measured timings
        (a model profile) are linear in tokens and squared tokens beyond their fixed cost, and monotone."""
        if not isinstance(self.timing, AnalyticTiming):
            return self
        hw = self.hw.additive() if change is Kernels.envelope else copy.copy(self.hw)
        hw.kernels = change(self.timing.kernels)
        return CostModel(self.model, self.cluster, hardware=hw,
                         timing=AnalyticTiming(self.model, hw, self.timing.ring_balanced, self.timing.stack,
                                               self.experts), experts=self.experts).with_step_overlap(self.step_overlap)

    def with_experts(self, experts: ExpertParallel) -> CostModel:
        """The same model and devices with a mixture of experts run as ``experts`` says (another placement
        or expert parallelism: what baselines such as Megatron-LM's run)."""
        timing = self.timing
        if isinstance(timing, AnalyticTiming):
            timing = AnalyticTiming(self.model, self.hw, timing.ring_balanced, timing.stack, experts)
        return CostModel(self.model, self.cluster, hardware=self.hw, timing=timing,
                         experts=experts).with_step_overlap(self.step_overlap)
