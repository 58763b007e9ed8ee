"""The cost model: time and memory of a layer, a stage, a micro-batch and a whole step.

This is the single source of truth for "how long" and "how much memory". The search
(flexmesh.plan), the per-step scheduler (flexmesh.schedule) and the simulator (flexmesh.sim) all ask
it; none keeps a private formula.

Work is described by sufficient statistics, not a token count: a micro-batch with sequence lengths
``s_k`` costs ``sum(s_k)`` in the linear layers and ``sum(s_k**2)`` in causal attention.

Sources of the formulas (constants come from the device preset or a profile, see flexmesh.spec):

- FLOPs: matmul FLOPs = 2 x weights per token; causal attention = 2 x q_dim per layer per squared
  token; backward = 2 x forward; full recomputation adds one forward (Megatron-LM, 2104.04473).
- Bytes per parameter with bf16 weights, fp32 gradients and Adam: 2 + 4 + 12, ZeRO-1 shards the 12,
  ZeRO-2 also the 4, ZeRO-3 all 18 (Megatron-LM's distributed-optimizer notes; ZeRO, 1910.02054).
- Saved activations per token per layer, with flash-style attention (no s^2 term) and sequence
  parallelism dividing everything by tp (Korthikanti et al., 2205.05198, adapted to SwiGLU/GQA;
  counted tensor by tensor in :func:`activation_elems_per_token`). Full recomputation keeps only the
  layer input and needs one layer's activations while recomputing.
- Logits: bf16 logits + fp32 softmax saved by the vocab-parallel cross entropy: 6 bytes per logit.
- Gradient sync overlaps the last micro-batch's backward; overlapped compute slows down by the
  factor Galvatron measured on A100 (1.13, 2211.13878).
- With a model profile (``flexmesh profile model``, :mod:`flexmesh.profile`) layer, embedding and head
  times come from its fitted coefficients instead of FLOPs (the token-dependent part divided by
  tp x cp), activation bytes per token from its measured table by tp/cp degree and recomputation,
  bytes per parameter and the optimizer's seconds per parameter from its measurements, and the
  dtype (the one the runtime trains in) from the profile. See :class:`CostModel`.
- Pipeline step time: sum of stage times + (m - 1) x the slowest stage for 1F1B and GPipe; the
  interleaved schedule divides the fill and drain by the number of chunks (2104.04473).
- In-flight micro-batches on pipeline rank r: 1F1B pp - r, GPipe all m, interleaved Megatron's
  warm-up count (pp - r - 1) * 2 + (v - 1) * pp + 1 chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np

from flexmesh.cost.hardware import Hardware, group_shape
from flexmesh.errors import ProfileError
from flexmesh.units import GIB
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.model import ModelSpec

GRAD_BYTES = 4  # fp32 gradient accumulation and reduction (Megatron-LM's default for bf16 training)
OPTIM_BYTES = 12  # fp32 master weights + Adam m and v
LOGIT_BYTES = 6
# Adam step traffic per parameter: read fp32 weight, grad, m, v (16 B); write weight, m, v and the
# bf16 copy (14 B). Time = bytes / HBM bandwidth from the datasheet.
OPTIM_TRAFFIC_BYTES = 30


def activation_elems_per_token(model: ModelSpec) -> int:
    """Elements one layer saves for backward per token (before dividing by tp and cp).

    Attention block: norm input, qkv input, q, k, v, attention output (saved by the kernel and by
    the output projection). MLP block: norm input, fc input, and for SwiGLU the gate and up outputs,
    the activation output and the down-projection input (GeLU: fc1 output and activation output).

    >>> from flexmesh.spec import MODEL_PRESETS
    >>> activation_elems_per_token(MODEL_PRESETS["llama2-7b"])  # 6h + 2kv + 4ffn
    76800
    """
    h = model.hidden
    attn = 2 * h + 2 * model.q_dim + 2 * model.kv_dim
    mlp = 2 * h + (4 if model.activation == "swiglu" else 2) * model.ffn_hidden
    return attn + mlp


@dataclass(frozen=True)
class Work:
    """What one replica (a tp x cp group) processes in one micro-batch."""

    tokens: float
    sq_tokens: float
    seqs: float = 1.0

    @classmethod
    def uniform(cls, seqs: float, seq_len: int) -> "Work":
        return cls(tokens=seqs * seq_len, sq_tokens=seqs * float(seq_len) ** 2, seqs=seqs)

    @classmethod
    def from_lengths(cls, lengths) -> "Work":
        a = np.asarray(lengths, dtype=float)
        return cls(tokens=float(a.sum()), sq_tokens=float((a * a).sum()), seqs=float(len(a)))


@dataclass(frozen=True)
class LayerCost:
    """One layer (or the embedding/head part of a stage) on one device for one micro-batch."""

    fwd: float = 0.0  # forward compute, s
    bwd: float = 0.0  # backward compute including recomputation, s
    comm_fwd: float = 0.0  # communication not hidden under forward compute, s
    comm_bwd: float = 0.0  # communication not hidden under backward compute, s
    grad_sync: float = 0.0  # once-per-step gradient/parameter collective, overlappable, s
    optim: float = 0.0  # optimizer step, s
    states: float = 0.0  # weights + grads + optimizer states, bytes
    act: float = 0.0  # activations kept per in-flight micro-batch, bytes
    transient: float = 0.0  # working memory needed while this layer runs, bytes

    @property
    def time(self) -> float:
        return self.fwd + self.bwd + self.comm_fwd + self.comm_bwd

    def __add__(self, o: "LayerCost") -> "LayerCost":
        return LayerCost(
            self.fwd + o.fwd, self.bwd + o.bwd, self.comm_fwd + o.comm_fwd, self.comm_bwd + o.comm_bwd,
            self.grad_sync + o.grad_sync, self.optim + o.optim, self.states + o.states, self.act + o.act,
            max(self.transient, o.transient),
        )


@dataclass(frozen=True)
class MicrobatchPhases:
    """:meth:`CostModel.microbatch_time` split by phase (seconds; numpy arrays when given arrays).

    ``fwd`` and ``bwd`` are compute (``bwd`` includes recomputation); ``comm_fwd`` and ``comm_bwd``
    are the communication that does not hide under it. The four add up to ``microbatch_time``.
    """

    fwd: object
    bwd: object
    comm_fwd: object
    comm_bwd: object

    @property
    def total(self):
        return self.fwd + self.bwd + self.comm_fwd + self.comm_bwd


@dataclass
class Evaluation:
    """A plan's predicted step: time breakdown and per-pipeline-rank memory (bytes)."""

    step_time: float
    tokens_per_s: float
    mfu: float
    compute: float  # busiest rank's compute in the step, s
    exposed_comm: float
    bubble: float
    grad_sync: float  # exposed gradient sync + optimizer, s
    stage_times: list[float]  # per pp rank, one micro-batch (fwd + bwd), s
    memory: list[dict[str, float]]  # per pp rank: states, activations, transient, logits, total (bytes)
    fits: bool
    budget: float  # usable bytes per device
    extra: dict = field(default_factory=dict)

    @property
    def peak_memory(self) -> float:
        return max(m["total"] for m in self.memory)

    def to_dict(self) -> dict:
        return {
            "step_time_s": self.step_time,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "breakdown_s": {
                "compute": self.compute, "exposed_comm": self.exposed_comm, "bubble": self.bubble,
                "grad_sync_and_optimizer": self.grad_sync,
            },
            "stage_time_s": self.stage_times,
            "peak_memory_gib": [m["total"] / GIB for m in self.memory],
            "memory_gib": [{k: v / GIB for k, v in m.items()} for m in self.memory],
            "memory_budget_gib": self.budget / GIB,
            "fits": self.fits,
        }


def in_flight(schedule: str, pp: int, rank: int, m: int, v: int = 1) -> float:
    """Micro-batches (in units of a whole stage's activations) held at the peak on pipeline rank ``rank``."""
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(pp - rank, m))
    if schedule == "interleaved":
        chunks = min(m * v, (pp - rank - 1) * 2 + (v - 1) * pp + 1)
        return chunks / v
    raise ValueError(f"unknown schedule {schedule!r}")


def pipeline_time(schedule: str, rank_times, m: int, v: int = 1) -> float:
    """Step time of ``m`` equal micro-batches through ranks taking ``rank_times`` each (fwd + bwd).

    >>> pipeline_time("1f1b", [1.0, 1.0, 1.0, 1.0], m=8)  # 8 + 3 bubbles
    11.0
    >>> pipeline_time("interleaved", [1.0, 1.0, 1.0, 1.0], m=8, v=2)
    9.5
    """
    return float(pipeline_times(schedule, rank_times, m, v))


def pipeline_times(schedule: str, rank_times, m: int, v: int = 1) -> np.ndarray:
    """:func:`pipeline_time` for many candidates at once: ``rank_times`` has shape (candidates, ranks).

    >>> pipeline_times("1f1b", [[1.0, 1.0], [1.0, 2.0]], m=4).tolist()
    [5.0, 9.0]
    """
    t = np.asarray(rank_times, dtype=float)
    if schedule in ("1f1b", "gpipe"):
        return t.sum(axis=-1) + (m - 1) * t.max(axis=-1)
    if schedule == "interleaved":
        mx = t.max(axis=-1)
        return m * mx + (t.sum(axis=-1) - mx) / v
    raise ValueError(f"unknown schedule {schedule!r}")


class CostModel:
    """Time and memory for a model on a cluster; from presets, or from profiles when given.

    ``hardware``: a :class:`Hardware` (``Hardware.from_profile(cluster, hardware_profile)`` for a
    measured machine; default: the cluster's device preset). ``model_profile``: a
    :class:`flexmesh.profile.ModelProfile` of this model (checked); with it

    - a layer's forward and backward seconds are the profile's fits ``c0 + (c1 * tokens +
      c2 * sum(len^2) + c3 * tokens^2) / (tp * cp)`` (backward under recomputation has its own fit);
      the embedding's and the head's likewise, linear in tokens. Where the profile timed the layer
      under real process groups of the strategy's (tp, cp kind, cp) -- or the ends under its tp --
      those fits are used instead, and the TP / CP communication they include is not added again;
    - activation bytes per token come from the profile's table for the strategy's (tp, cp,
      recompute); a degree pair it did not measure falls back to the tp = cp = 1 value divided by
      tp * cp. The dense attention mask the CPU kernel saves (``attention_mask_bytes_per_sq_row_token``
      x tokens^2 per layer, local and Ulysses attention; ring attention saves none) is added to a
      layer's activations but not to :meth:`activation_bytes_per_token` (which is per token);
    - weights, gradients and optimizer states take the profile's bytes per parameter, the optimizer
      step its seconds per parameter, and every byte count the profile's dtype.
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, hardware: Hardware | None = None,
                 model_profile=None):
        if model_profile is not None:
            model_profile.check_model(model)
            model = replace(model, dtype=model_profile.dtype)  # the dtype the profile measured (the runtime's)
        self.model = model
        self.cluster = cluster
        self.hw = hardware or Hardware(cluster, model.dtype)
        self.profile = model_profile
        self.act_elems = activation_elems_per_token(model)
        if model_profile is not None:
            st = model_profile.states
            self.weight_bytes = float(st["weight_bytes_per_param"])
            self.grad_bytes = float(st["grad_bytes_per_param"])
            self.optim_bytes = float(st["optimizer_bytes_per_param"])
        else:
            self.weight_bytes, self.grad_bytes, self.optim_bytes = model.dtype_bytes, GRAD_BYTES, OPTIM_BYTES
        self._layer = lru_cache(maxsize=None)(self._layer_uncached)
        self._ends = lru_cache(maxsize=None)(self._ends_uncached)

    @property
    def source(self) -> str:
        """``preset:<device>``, ``profile:<hardware profile>``, or with a model profile
        ``profile:<hardware profile>+<model profile>`` (``preset:<device>+profile:<model profile>``)."""
        if self.profile is None:
            return self.hw.source
        sep = "+" if self.hw.source.startswith("profile:") else "+profile:"
        return f"{self.hw.source}{sep}{self.profile.name}"

    # ---- measured activation bytes (model profile) ------------------------------------------------
    def _profiled_act_per_token(self, tp: int, cp: int, recompute: bool) -> float:
        """Bytes one layer saves per token of the micro-batch on each device of a tp x cp group."""
        entry = self.profile.activation_entry(tp, cp, recompute)
        if entry is not None:
            return float(entry["bytes_per_token"])
        base = self.profile.activation_entry(1, 1, recompute)
        if base is None:
            raise ProfileError(f"model profile {self.profile.name} has no tp=1 cp=1 activation measurement "
                               f"(recompute={recompute}); re-run `flexmesh profile model`")
        return float(base["bytes_per_token"]) / (tp * cp)

    def _profiled_mask_bytes(self, s: LayerStrategy, tokens):
        if s.cp > 1 and s.cp_kind == "ring":  # the ring kernel keeps no mask
            return 0.0
        return float(self.profile.activations["attention_mask_bytes_per_sq_row_token"]) * tokens * tokens

    @property
    def memory_budget(self) -> float:
        return self.hw.memory_bytes

    # ---- building blocks ---------------------------------------------------------------------------
    def _compute(self, lin_flops, attn_flops):
        return lin_flops / self.hw.matmul_flops + attn_flops / self.hw.attn_flops

    def _states(self, params: float, s: LayerStrategy) -> float:
        """Bytes of weights, gradients and optimizer states for ``params`` parameters on one device."""
        p = params / s.tp
        w, g, o = self.weight_bytes, self.grad_bytes, self.optim_bytes
        d = s.shard_degree
        if s.zero >= 1:
            o /= d
        if s.zero >= 2:
            g /= d
        if s.zero >= 3:
            w /= d
        return p * (w + g + o)

    def _grad_comm(self, params: float, s: LayerStrategy, work_fwd: float, work_bwd: float):
        """(exposed fwd, exposed bwd, per-step sync, optimizer time) for ZeRO / DP of ``params``."""
        d = s.shard_degree
        p = params / s.tp
        if self.profile is not None:
            per_param = float(self.profile.states["optimizer_step_s_per_param"])
        else:
            per_param = OPTIM_TRAFFIC_BYTES / self.hw.hbm_bytes_per_s
        optim = p / (d if s.zero >= 1 else 1) * per_param
        if d == 1:
            return 0.0, 0.0, 0.0, optim
        shape = group_shape(d, s.tp, self.cluster)
        ct = self.hw.collective_time
        grads = p * self.grad_bytes
        weights = p * self.weight_bytes
        if s.zero <= 1:  # all-reduce, or reduce-scatter + all-gather of the same volume
            return 0.0, 0.0, ct("all_reduce", grads, shape), optim
        exposed = self.hw.exposed
        if s.zero == 2:  # reduce-scatter every micro-batch, all-gather updated weights once
            rs = ct("reduce_scatter", grads, shape)
            return 0.0, float(exposed(rs, work_bwd)), ct("all_gather", weights, shape), optim
        # ZeRO-3: gather weights for forward and for backward, reduce-scatter grads, every micro-batch;
        # each is prefetched under the layer's own compute.
        ag = ct("all_gather", weights, shape)
        rs = ct("reduce_scatter", grads, shape)
        return float(exposed(ag, work_fwd)), float(exposed(ag + rs, work_bwd)), 0.0, optim

    # ---- a transformer layer ----------------------------------------------------------------------
    def layer(self, s: LayerStrategy, work: Work) -> LayerCost:
        """One transformer layer on one device of a tp x cp group processing ``work``."""
        return self._layer(s, work)

    def _layer_phases(self, s: LayerStrategy, tokens, sq_tokens):
        """(fwd, bwd, comm_fwd, comm_bwd) seconds of one layer on a tp x cp group; scalars or arrays.

        Compute, and the tensor- and context-parallel communication that does not hide under it.
        """
        m, hw, ct = self.model, self.hw, self.hw.collective_time
        split = s.tp * s.cp
        measured = self.profile.parallel_layer(s.tp, s.cp_kind, s.cp) if self.profile is not None and split > 1 else None
        if measured is not None:  # timed under real tp x cp groups: their communication is in the times
            bwd = measured["backward_recompute" if s.recompute else "backward"].time(tokens, sq_tokens)
            return measured["forward"].time(tokens, sq_tokens), bwd, 0.0, 0.0
        if self.profile is not None:
            fit = self.profile.layer
            t_attn = fit["forward"].attention(tokens, sq_tokens, split)
            fwd = fit["forward"].time(tokens, sq_tokens, split)
            bwd = fit["backward_recompute" if s.recompute else "backward"].time(tokens, sq_tokens, split)
        else:
            t_attn = m.layer_attn_flops_per_sq_token * sq_tokens / split / hw.attn_flops
            fwd = m.layer_linear_flops_per_token * tokens / split / hw.matmul_flops + t_attn
            bwd = fwd * (3 if s.recompute else 2)
        b = m.dtype_bytes
        dev_tokens = tokens / s.cp  # tokens held by each tp rank of the group (sequence split by cp)
        bwd_passes = 2 if s.recompute else 1  # recomputation repeats the forward's collectives
        comm_f = comm_b = 0.0
        if s.tp > 1:
            # Sequence parallelism: all-gather before and reduce-scatter after each of the two blocks.
            shape = group_shape(s.tp, 1, self.cluster)
            act = dev_tokens * m.hidden * b
            per_pass = 2 * ct("all_gather", act, shape) + 2 * ct("reduce_scatter", act, shape)
            comm_f, comm_b = comm_f + per_pass, comm_b + bwd_passes * per_pass
        if s.cp > 1:
            shape = group_shape(s.cp, s.tp, self.cluster)
            if s.cp_kind == "ulysses":
                # q, k, v scattered by head and gathered by sequence, then the output back.
                qkv = dev_tokens * (m.q_dim + 2 * m.kv_dim) / s.tp * b
                out = dev_tokens * m.q_dim / s.tp * b
                per_pass = ct("all_to_all", qkv, shape) + ct("all_to_all", out, shape)
                comm_f, comm_b = comm_f + per_pass, comm_b + bwd_passes * per_pass
            else:
                # Ring: cp - 1 hops of the local K/V block, each hidden under one block of attention;
                # backward moves K/V and dK/dV (twice the bytes) under twice the attention work.
                hop = ct("send_recv", dev_tokens * 2 * m.kv_dim / s.tp * b, shape)
                exposed_f = (s.cp - 1) * hw.exposed(hop, t_attn / s.cp)
                comm_f, comm_b = comm_f + exposed_f, comm_b + exposed_f * (3 if s.recompute else 2)
        return fwd, bwd, comm_f, comm_b

    def _layer_uncached(self, s: LayerStrategy, work: Work) -> LayerCost:
        m = self.model
        fwd, bwd, comm_f, comm_b = (float(x) for x in self._layer_phases(s, work.tokens, work.sq_tokens))
        b = m.dtype_bytes
        dev_tokens = work.tokens / s.cp
        zf, zb, sync, optim = self._grad_comm(m.layer_params, s, fwd, bwd)
        if self.profile is not None:
            act_full = (self._profiled_act_per_token(s.tp, s.cp, False) * work.tokens
                        + self._profiled_mask_bytes(s, work.tokens))
            act = self._profiled_act_per_token(s.tp, s.cp, True) * work.tokens if s.recompute else act_full
        else:
            act_full = dev_tokens / s.tp * self.act_elems * b
            act = dev_tokens / s.tp * m.hidden * b if s.recompute else act_full
        transient = act_full if s.recompute else 0.0
        if s.zero == 3:  # the gathered weights of this layer and the prefetched next one
            transient += 2 * m.layer_params / s.tp * b
        return LayerCost(fwd=fwd, bwd=bwd, comm_fwd=comm_f + zf, comm_bwd=comm_b + zb, grad_sync=sync,
                         optim=optim, states=self._states(m.layer_params, s), act=act, transient=transient)

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
    def ends(self, s: LayerStrategy, work: Work, embed: bool, head: bool) -> LayerCost:
        """Embedding (first stage) and final norm + LM head + loss (last stage), vocab-parallel over tp."""
        return self._ends(s, work, embed, head)

    def _ends_uncached(self, s: LayerStrategy, work: Work, embed: bool, head: bool) -> LayerCost:
        m = self.model
        total = LayerCost()
        dev_tokens = work.tokens / s.cp
        prof = self.profile
        if embed:
            fwd = bwd = 0.0
            act = dev_tokens / s.tp * m.hidden * m.dtype_bytes
            if prof is not None:
                fwd = float(self._end_time("embedding_forward", s, work.tokens))
                bwd = float(self._end_time("embedding_backward", s, work.tokens))
                act = dev_tokens * float(prof.activations["embedding_bytes_per_token"])
            zf, zb, sync, optim = self._grad_comm(m.embedding_params, s, fwd, bwd)
            total = total + LayerCost(fwd=fwd, bwd=bwd, comm_fwd=zf, comm_bwd=zb, grad_sync=sync, optim=optim,
                                      states=self._states(m.embedding_params, s), act=act)
        if head:
            params = m.head_params
            if m.tie_embeddings and not embed:  # a tied head on another stage keeps its own copy
                params += m.vocab * m.hidden
            fwd, bwd = self._head_times(s, work.tokens)
            zf, zb, sync, optim = self._grad_comm(params, s, fwd, bwd)
            total = total + LayerCost(fwd=fwd, bwd=bwd, comm_fwd=zf, comm_bwd=zb, grad_sync=sync,
                                      optim=optim, states=self._states(params, s), transient=self._logit_bytes(s, work.tokens))
        return total

    def _head_times(self, s: LayerStrategy, tokens):
        """(forward, backward) seconds of the final norm + LM head + loss for ``tokens`` on a tp x cp group."""
        if self.profile is not None:
            return self._end_time("head_forward", s, tokens), self._end_time("head_backward", s, tokens)
        fwd = self.model.head_flops_per_token * tokens / (s.tp * s.cp) / self.hw.matmul_flops
        return fwd, 2 * fwd

    def _end_time(self, key: str, s: LayerStrategy, tokens):
        """Model profile seconds of ``key`` (``embedding_forward``, ..., ``head_backward``) for ``tokens``
        on a tp x cp group: timed under a real tp group where profiled, else the one-process fit split."""
        measured = self.profile.parallel_ends(s.tp) if s.tp > 1 else None
        if measured is not None:  # each cp rank runs the ends on its own tokens
            return measured[key].time(np.asarray(tokens, dtype=float) / s.cp, 0.0)
        part, direction = key.split("_")
        return getattr(self.profile, part)[direction].time(tokens, 0.0, s.tp * s.cp)

    def _logit_bytes(self, s: LayerStrategy, tokens):
        """Bytes the head and loss keep for backward on each device (the runtime's tp head gathers the
        logits on every tp rank, so a model profile's measurement divides by cp only)."""
        if self.profile is not None:
            return tokens / s.cp * float(self.profile.activations["head_bytes_per_token"])
        return tokens / s.cp * self.model.vocab / s.tp * LOGIT_BYTES

    def layer_work(self, s: LayerStrategy, microbatch_seqs: int, seq_len: int) -> Work:
        """Work of one replica of a layer when a stage's micro-batch of equal-length sequences splits over dp."""
        return Work.uniform(microbatch_seqs / s.dp, seq_len)

    # ---- a whole plan ---------------------------------------------------------------------------------
    def stage_cost(self, strategies, microbatch_seqs: int, seq_len: int, embed: bool, head: bool) -> LayerCost:
        """Sum over a stage's layers (plus embedding/head), per device, for one micro-batch."""
        total = LayerCost()
        prev = None
        for s in strategies:
            work = self.layer_work(s, microbatch_seqs, seq_len)
            if prev is not None and not prev[0].same_mesh(s):
                total = total + LayerCost(comm_fwd=self.transition(prev[0], s, prev[1]))
            total = total + self.layer(s, work)
            prev = (s, work)
        if (embed or head) and strategies:
            first, last = strategies[0], strategies[-1]
            if embed:
                total = total + self.ends(first, self.layer_work(first, microbatch_seqs, seq_len), True, False)
            if head:
                total = total + self.ends(last, self.layer_work(last, microbatch_seqs, seq_len), False, True)
        return total

    def pipeline_p2p(self, s: LayerStrategy, microbatch_seqs: int, seq_len: int, pp: int) -> float:
        """Send + receive of one micro-batch's boundary activations, forward and backward (exposed)."""
        if pp == 1:
            return 0.0
        work = self.layer_work(s, microbatch_seqs, seq_len)
        nbytes = work.tokens / s.cp / s.tp * self.model.hidden * self.model.dtype_bytes
        stride = self.cluster.world_size // pp
        shape = group_shape(2, stride, self.cluster)
        return 2 * self.hw.collective_time("send_recv", nbytes, shape)

    def evaluate_stages(self, stage_strategies, pp: int, schedule: str, m: int, v: int,
                        microbatch_seqs: int, seq_len: int) -> Evaluation:
        """Predict a step from per-chunk layer strategies (``pp * v`` chunks, Megatron's rank order)."""
        chunks = list(stage_strategies)
        n = len(chunks)
        costs = [self.stage_cost(st, microbatch_seqs, seq_len, i == 0, i == n - 1) for i, st in enumerate(chunks)]
        rank_cost = [LayerCost() for _ in range(pp)]
        rank_layers = [0] * pp
        for i, c in enumerate(costs):
            rank_cost[i % pp] = rank_cost[i % pp] + c
            rank_layers[i % pp] += len(chunks[i])
        p2p = [self.pipeline_p2p(chunks[i][0], microbatch_seqs, seq_len, pp) * v if chunks[i] else 0.0
               for i in range(pp)]
        rank_times = [rc.time + p for rc, p in zip(rank_cost, p2p)]
        t_pipe = pipeline_time(schedule, rank_times, m, v)
        # Gradient sync and optimizer after the pipeline drains; sync overlaps the last backward.
        tails = [self.exposed_sync(rc.grad_sync, rc.bwd, layers) + rc.optim
                 for rc, layers in zip(rank_cost, rank_layers)]
        step = t_pipe + max(tails)
        busiest = int(np.argmax(rank_times))
        compute = m * (rank_cost[busiest].fwd + rank_cost[busiest].bwd)
        exposed = m * (rank_cost[busiest].comm_fwd + rank_cost[busiest].comm_bwd + p2p[busiest])
        bubble = t_pipe - m * rank_times[busiest]
        last = chunks[-1][-1]
        logits = self.ends(last, self.layer_work(last, microbatch_seqs, seq_len), False, True).transient
        memory = []
        for r in range(pp):
            rc = rank_cost[r]
            flight = in_flight(schedule, pp, r, m, v)
            layer_transient = max((self.layer(s, self.layer_work(s, microbatch_seqs, seq_len)).transient
                                   for i in range(r, n, pp) for s in chunks[i]), default=0.0)
            mem = {"states": rc.states, "activations": rc.act * flight, "transient": layer_transient,
                   "logits": logits if r == (n - 1) % pp else 0.0}
            mem["total"] = sum(mem.values())
            memory.append(mem)
        tokens = microbatch_seqs * m * seq_len
        mfu = self.model.model_flops(tokens, microbatch_seqs * m * float(seq_len) ** 2) / (
            step * self.cluster.world_size * self.hw.peak_flops)
        budget = self.memory_budget
        return Evaluation(step_time=step, tokens_per_s=tokens / step, mfu=mfu, compute=compute,
                          exposed_comm=exposed, bubble=bubble, grad_sync=max(tails), stage_times=rank_times,
                          memory=memory, fits=all(x["total"] <= budget for x in memory), budget=budget)

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
        """Predict a :class:`flexmesh.plan.Plan`."""
        chunks = [st.strategies for st in plan.stages]
        return self.evaluate_stages(chunks, plan.pp, plan.pipeline_schedule, plan.num_microbatches, plan.virtual_stages,
                                    plan.microbatch_size, plan.seq_len)

    # ---- for the per-step scheduler -----------------------------------------------------------------
    def microbatch_time(self, s: LayerStrategy, tokens, sq_tokens, layers: int | None = None,
                        embed: bool = True, head: bool = True):
        """Forward + backward seconds of one micro-batch on a tp x cp group; numpy arrays accepted.

        Time is exactly linear in ``tokens`` and ``sq_tokens`` except where communication hides under
        compute, so it is evaluated term by term rather than through fitted coefficients. ZeRO
        collectives are per step and left to :meth:`step_grad_sync`.
        """
        return self.microbatch_phases(s, tokens, sq_tokens, layers, head, embed=embed).total

    def activation_bytes_per_token(self, s: LayerStrategy, layers: int | None = None,
                                   in_flight_mbs: float = 1.0) -> float:
        """Saved-activation bytes per token of a micro-batch on each device of a tp x cp group."""
        layers = self.model.num_layers if layers is None else layers
        if self.profile is not None:
            per = self._profiled_act_per_token(s.tp, s.cp, s.recompute)
        else:
            per = (self.model.hidden if s.recompute else self.act_elems) * self.model.dtype_bytes / (s.tp * s.cp)
        return per * layers * in_flight_mbs

    def max_tokens(self, s: LayerStrategy, layers: int | None = None, embed: bool = True, head: bool = True,
                   in_flight_mbs: float = 1.0) -> int:
        """Largest micro-batch (tokens on the tp x cp group) that fits in device memory under ``s``."""
        layers = self.model.num_layers if layers is None else layers
        one = Work(tokens=1.0, sq_tokens=1.0)
        states = self.layer(s, one).states * layers
        if embed or head:
            states += self.ends(s, one, embed, head).states
        per_token = self.activation_bytes_per_token(s, layers, in_flight_mbs)
        if s.recompute:  # one layer's full activations while it is recomputed
            per_token += (self._profiled_act_per_token(s.tp, s.cp, False) if self.profile is not None
                          else self.act_elems * self.model.dtype_bytes / (s.tp * s.cp))
        if head:
            per_token += self._logit_bytes(s, 1.0)
        transient = 2 * self.model.layer_params / s.tp * self.model.dtype_bytes if s.zero == 3 else 0.0
        free = self.memory_budget - states - transient
        return max(0, int(free / per_token))

    # ---- for the simulator ------------------------------------------------------------------------
    def microbatch_phases(self, s: LayerStrategy, tokens, sq_tokens, layers: int | None = None,
                          head: bool = True, embed: bool = False) -> "MicrobatchPhases":
        """:meth:`microbatch_time` split into forward and backward, compute and exposed communication,
        so that a pipeline simulation can order the passes. The embedding costs time only with a
        model profile (the preset counts no FLOPs for a lookup).
        """
        layers = self.model.num_layers if layers is None else layers
        tokens = np.asarray(tokens, dtype=float)
        sq = np.asarray(sq_tokens, dtype=float)
        fwd, bwd, cf, cb = self._layer_phases(s, tokens, sq)
        head_f, head_b = self._head_times(s, tokens) if head else (0.0, 0.0)
        if embed and self.profile is not None:
            head_f = head_f + self._end_time("embedding_forward", s, tokens)
            head_b = head_b + self._end_time("embedding_backward", s, tokens)
        zero = np.zeros_like(tokens)
        return MicrobatchPhases(fwd=fwd * layers + head_f, bwd=bwd * layers + head_b,
                                comm_fwd=(cf + zero) * layers, comm_bwd=(cb + zero) * layers)

    def step_grad_sync(self, s: LayerStrategy, data_ranks: int, layers: int | None = None,
                       embed: bool = True, head: bool = True) -> tuple[float, float]:
        """(gradient sync, optimizer) seconds, once per step, for one stage's parameters over ``data_ranks``.

        For per-step schedules whose ranks run different numbers of micro-batches: gradients are
        accumulated locally and reduced once at the end of the step over every data rank holding the
        same weights (tp-strided). ZeRO-0/1 all-reduce the gradients; ZeRO-2 and ZeRO-3 reduce-scatter
        them and all-gather the updated weights (ZeRO-3's per-layer gathers inside the step are
        prefetched under compute, as in :meth:`layer`). Nothing is hidden here; callers that overlap
        the sync with a backward pass do so themselves.
        """
        layers = self.model.num_layers if layers is None else layers
        m = self.model
        t = replace(s, cp=1, cp_kind="none", dp=data_ranks, zero=min(s.zero, 2))
        params = [(m.layer_params, layers)]
        if embed:
            params.append((m.embedding_params, 1))
        if head:  # a tied head on another stage keeps its own copy (as in :meth:`ends`)
            params.append((m.head_params + (m.vocab * m.hidden if m.tie_embeddings and not embed else 0), 1))
        sync = optim = 0.0
        for p, n in params:
            zf, zb, once, opt = self._grad_comm(p, t, 0.0, 0.0)
            sync += n * (zf + zb + once)
            optim += n * opt
        return sync, optim
