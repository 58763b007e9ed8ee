"""One transformer layer, and the ends (embedding; final norm, LM head and loss), on one device of a
tp x cp group: compute, the communication that does not hide under it, states, gradient sync, memory.

A layer's compute times and the bytes it keeps come from a :class:`~flexmesh.cost.training.timing.LayerTiming`
(FLOPs over throughput by default, :mod:`flexmesh.cost.training.analytic`, which cites its sources; a
model profile's fits with ``flexmesh.profile``). This module adds what depends on the cluster and the
strategy, with these sources:

- Tensor parallelism with sequence parallelism: two all-gathers and two reduce-scatters of the
  layer's activation per pass (Korthikanti et al., 2205.05198); with ``overlap.tp_comm`` pipelined with
  the GEMMs (Megatron-Core's TP overlap). Ulysses: all-to-all of q, k, v and of the output per pass
  (DeepSpeed-Ulysses, 2309.14509); ring attention: ``cp - 1`` K/V hops per pass, each hidden under one
  block of attention (Liu et al., 2310.01889); with a sliding window only the hops to blocks within
  reach (:meth:`LayerPricing.ring_hops`, the runtime's ``ring_steps``).
- What the step trains, its states and gradient sync, is a part the pricing asks
  (:class:`~flexmesh.cost.training.weights.Trained`: every weight under DP and ZeRO, or LoRA adapters on
  a frozen base); so are a mixture of experts' terms (:class:`~flexmesh.cost.training.expert_layers.ExpertLayers`).
- Memory: states, activations, logits and per-layer transient buffers (:mod:`flexmesh.cost.training.memory`).

Every answer is cached: a layer's price depends only on its strategy, its work and the overlap options.
"""

from __future__ import annotations

from functools import lru_cache
from typing import cast

import numpy as np

from flexmesh.cost.device.hardware import Hardware, group_shape
from flexmesh.cost.training.expert_layers import ExpertLayers
from flexmesh.cost.training.experts import synced_params
from flexmesh.cost.training.memory import layer_transient_bytes
from flexmesh.cost.training.timing import LayerTiming
from flexmesh.cost.training.weights import Trained
from flexmesh.cost.training.work import NO_WINDOW, Amount, LayerCost, Work, attention_sq, ring_hops
from flexmesh.layout.overlap import NO_OVERLAP, Overlap, acting
from flexmesh.layout.strategy import LayerStrategy, Recompute
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.model import ModelSpec


class LayerPricing:
    """Prices of one layer and of the ends of ``model`` on ``cluster``'s devices (``hw``), their compute
    from ``timing``, trained as ``trained`` says, with a mixture of experts' terms from ``experts``
    (None: a dense model)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, hw: Hardware, timing: LayerTiming, trained: Trained,
                 experts: ExpertLayers | None):
        self.model, self.cluster, self.hw, self.timing = model, cluster, hw, timing
        self.trained = trained
        self.experts = experts
        self.windows = model.attention_windows if model.sliding_window is not None else NO_WINDOW  # NO_WINDOW: s^2
        self.state_bytes = timing.state_bytes_per_param()
        self.reduce_bytes = trained.reduce_bytes  # the reduction's bytes and buffers
        self._layer = lru_cache(maxsize=None)(self._layer_uncached)
        self._ends = lru_cache(maxsize=None)(self._ends_uncached)
        self._phases = lru_cache(maxsize=None)(self.phases)
        self._work = lru_cache(maxsize=None)(lambda seqs, seq_len: Work.uniform(seqs, seq_len, self.windows))

    # ---- a transformer layer ----------------------------------------------------------------------
    def layer(self, s: LayerStrategy, work: Work, overlap: Overlap = NO_OVERLAP) -> LayerCost:
        """One transformer layer on one device of a tp x cp group processing ``work``."""
        return self._layer(s, work, acting(overlap, s, True))

    def phases(self, s: LayerStrategy, tokens, sq_tokens, overlap: Overlap = NO_OVERLAP):  # noqa: ANN001, ANN201
        """(fwd, bwd, comm_fwd, comm_bwd) seconds of one layer on a tp x cp group; scalars or arrays.

        Compute, and the tensor- and context-parallel communication that does not hide under it. With
        ``overlap.tp_comm`` the TP collectives are pipelined with the GEMMs (Megatron-Core's TP
        overlap): exposed is what does not fit under the layer's matmul time of that pass. The compute
        is what the trained part makes of the timing's (LoRA: no weight gradients of the base).
        """
        fwd, bwd, comm_f, comm_b = self._phases_trained_whole(s, tokens, sq_tokens, overlap)
        fwd, bwd = self.trained.compute(s, tokens, sq_tokens, fwd, bwd)
        return fwd, bwd, comm_f, comm_b

    def _phases_trained_whole(self, s: LayerStrategy, tokens, sq_tokens, overlap: Overlap):  # noqa: ANN001, ANN202
        m, hw, ct = self.model, self.hw, self.hw.collective_time
        times = self.timing.layer_times(s, tokens, sq_tokens)
        if self.experts is not None:
            times = self.experts.times(times, s, tokens, sq_tokens)
        if times.includes_communication:  # timed under real tp x cp groups: their communication is in the times
            return times.fwd, times.bwd, 0.0, 0.0
        fwd, bwd, t_attn = times.fwd, times.bwd, times.attention
        b = m.dtype_bytes
        dev_tokens = tokens / s.cp  # tokens held by each tp rank of the group (sequence split by cp)
        bwd_passes = 2 if s.recompute else 1  # recomputation repeats the forward's collectives
        # Selective recomputation reruns the attention core with its CP collectives (the runtime's
        # Attention.recompute_core checkpoints attend: all-to-alls, ring passes), not the TP ones.
        cp_passes = 2 if s.recompute or s.recompute is Recompute.SELECTIVE else 1
        comm_f: Amount = 0.0
        comm_b: Amount = 0.0
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
        if self.experts is not None:  # the experts' exchanges over the data ranks
            tf, tb, wf, wb = self.experts.communication(s, dev_tokens, fwd, bwd)
            comm_f, comm_b = comm_f + tf + wf, comm_b + tb + wb
        return fwd, bwd, comm_f, comm_b

    def _layer_uncached(self, s: LayerStrategy, work: Work, overlap: Overlap) -> LayerCost:
        m = self.model
        group = s.phase_group(m.is_moe)  # phases are shared by every dp and ZeRO stage of a tp x cp group
        fwd, bwd, comm_f, comm_b = map(float, self._phases(group, float(work.tokens), float(work.sq_tokens), overlap))
        # routed experts: below; the router and shared expert are whole on every tp rank (tp x as many)
        params = synced_params(m, s.tp)
        zf, zb, sync, optim = self.trained.grad_comm(params, s, fwd, bwd, overlap)
        timing = self.timing
        act_full = timing.activation_bytes(s, work.tokens, False) + timing.mask_bytes(s, work.tokens, work.sq_tokens)
        # Hook for partial recomputation: the timing says what a strategy keeps; full recomputation
        # keeps the layer input and holds the full set again while the layer is recomputed.
        act = timing.activation_bytes(s, work.tokens, True) if s.recompute else act_full
        transient = layer_transient_bytes(m, s, work.tokens, overlap, act_full if s.recompute else 0.0,
                                          self.reduce_bytes)
        states = self.trained.states(params, s, overlap)
        if self.experts is not None:  # experts sharded over the stage's ranks, their gathered copies kept for backward
            estates, esync, eopt, gathered = self.experts.layer_terms(s, self.state_bytes, self.reduce_bytes,
                                                                      timing.optimizer_s_per_param())
            states += estates
            sync, optim = sync + esync, optim + eopt
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
            zf, zb, sync, optim = self.trained.grad_comm(m.embedding_params, s, fwd, bwd, overlap)
            total = total + LayerCost(fwd=fwd, bwd=bwd, comm_fwd=zf, comm_bwd=zb, grad_sync=sync, optim=optim,
                                      states=self.trained.states(m.embedding_params, s, overlap), act=act)
        if head:
            params = m.head_params
            if m.tie_embeddings and not embed:  # a tied head on another stage keeps its own copy
                params += m.vocab * m.hidden
            fwd, bwd = cast(tuple[float, float], self.timing.head_times(s, work.tokens))  # scalars in, scalars out
            zf, zb, sync, optim = self.trained.grad_comm(params, s, fwd, bwd, overlap)
            total = total + LayerCost(fwd=fwd, bwd=bwd, comm_fwd=zf, comm_bwd=zb, grad_sync=sync, optim=optim,
                                      states=self.trained.states(params, s, overlap),
                                      transient=self.timing.logit_bytes(s, work.tokens))
        return total

    # ---- work ---------------------------------------------------------------------------------------
    def layer_work(self, s: LayerStrategy, microbatch_seqs: int, seq_len: int) -> Work:
        """Work of one replica of a layer when a stage's micro-batch of equal-length sequences splits over dp."""
        return self._work(microbatch_seqs / s.dp, seq_len)

    def ring_hops(self, cp: int, block_tokens):  # noqa: ANN001, ANN201 - floats or numpy arrays
        """K/V hops of ring attention per pass with blocks of ``block_tokens``, mean over layers
        (:func:`flexmesh.cost.training.work.ring_hops`); None without a sliding window (all ``cp - 1``)."""
        if self.windows == NO_WINDOW:
            return None
        return ring_hops(cp, block_tokens, self.windows)

    def attention_sq(self, start, end):  # noqa: ANN001, ANN201 - floats or numpy arrays
        """Squared-token attention work of queries [start, end) of a sequence under this model's
        sliding windows (:func:`flexmesh.cost.training.work.attention_sq`); ``end**2 - start**2`` without one."""
        return attention_sq(start, end, self.windows)
