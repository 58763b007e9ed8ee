"""Mixture-of-experts layers: a router, routed SwiGLU experts as grouped matmuls, an optional shared expert.

What it computes is transformers' (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; flexmesh.spec.moe)::

    p = softmax(router(x)) in fp32;  top_k experts by p (+ the balancing bias, which picks but never weighs);
    w = p of those, renormalised when norm_topk;  y = sum_k w_k expert_k(x) [+ sigmoid(gate(x)) shared(x)]

Module layout (names the checkpoints, the Hugging Face mapping and the parallel plans address)::

    feed_forward              MoEFeedForward
        router                nn.Linear(hidden, experts)             HF mlp.gate
        experts.gate_up       [experts, 2 * expert_ffn, hidden]      HF mlp.experts.gate_up_proj (gate rows first)
        experts.down          [experts, hidden, expert_ffn]          HF mlp.experts.down_proj
        shared.w1|w2|w3       the shared expert's SwiGLU             HF mlp.shared_expert.gate|down|up_proj
        shared_gate           nn.Linear(hidden, 1)                   HF mlp.shared_expert_gate

Each routed (token, expert) pair is sorted by expert and every expert's rows run in one grouped
matmul (flexmesh.runtime.model.grouped). Padding tokens after a micro-batch's documents are not routed:
they reach no expert, count in no load and their output is zero (nothing reads it: attention stays
inside documents and their labels are ignored).

Where the experts are sharded over data ranks (flexmesh.runtime.parallel.expert_parallel), ``dispatch`` is
set and runs the routed part across ranks with the same math; ``None``: every expert is local.
Either way the routed part runs outside ``torch.compile`` (compiled blocks, ``--compile``, fuse the
router, norms and the rest around it).

Load statistics: every forward adds its routed pairs per expert to ``load`` (a non-persistent
buffer, on the device, no host synchronisation); the trainer reads and clears it once per step
(routing traces, the next step's expert placement, the balancing bias).

Load-balancing loss (``aux_weights``, set by the trainer each step; zero: none): Switch
Transformer's ``alpha E sum_i f_i P_i`` (2101.03961), ``P_i`` the step's mean router probability of
expert ``i``, taken over the step's tokens here as ``sum_t p_ti w_i`` with ``w_i = alpha E f_i / N``,
and ``f_i`` the fraction of routed pairs expert ``i`` received in the *previous* step (all ranks, every
micro-batch): a constant of the step, the same on every rank, so the loss and its gradient are sums
over tokens and equal under every layout and step schedule (the current step's ``f_i`` would only be
known after the last micro-batch's forward). It enters backward through the layer's output
(:class:`AuxLoss`), so pipelines and gradient accumulation need nothing of their own.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from flexmesh.runtime.model.grouped import grouped_linear
from flexmesh.runtime.model.params import canonical_name
from flexmesh.spec.model import ModelSpec


class Dispatch(Protocol):
    """Runs the routed experts of one layer across ranks (flexmesh.runtime.parallel.expert_parallel)."""

    def __call__(self, experts: "Experts", x: torch.Tensor, weights: torch.Tensor,
                 chosen: torch.Tensor) -> torch.Tensor: ...


def recomputing() -> bool:
    """Whether this forward runs inside backward (activation checkpointing recomputing it)."""
    return torch._C._current_graph_task_id() != -1


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matrix products run in here: autocast's where it is on (grouped matmuls are not in its
    lists, so the experts cast themselves), else ``x``'s."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, offsets: torch.Tensor,
               sizes: list[int] | None = None) -> torch.Tensor:
    """SwiGLU of consecutive row groups of ``x`` [T, hidden], group ``i`` through expert ``i`` of
    ``gate_up`` [G, 2F, hidden] and ``down`` [G, hidden, F]; ``offsets``: the groups' end rows (int32)."""
    dtype = compute_dtype(x)
    x = x.to(dtype)
    h = grouped_linear(x, gate_up.to(dtype), offsets, sizes)
    gate, up = h.chunk(2, dim=-1)
    return grouped_linear(F.silu(gate) * up, down.to(dtype), offsets, sizes)


class AuxLoss(torch.autograd.Function):
    """Returns ``y`` unchanged; in backward also gives ``aux`` (a scalar loss term computed from ``y``'s
    inputs) a gradient of 1, so that the term is minimised along with the loss ``y`` flows into."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


class Experts(nn.Module):
    """The routed experts' weights, stacked (transformers 5's fused layout)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        assert spec.moe is not None
        e, f, h = spec.moe.num_experts, spec.moe.expert_ffn, spec.hidden
        self.num_experts = e
        self.gate_up = nn.Parameter(torch.empty(e, 2 * f, h))
        self.down = nn.Parameter(torch.empty(e, h, f))

    def local(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of ``gate_up`` and ``down`` as plain tensors (the whole on one rank; a
        DTensor shard's local rows under expert parallelism), gradients flowing back to the parameters."""
        gate_up, down = self.gate_up, self.down
        if isinstance(gate_up, DTensor) and isinstance(down, DTensor):
            return gate_up.to_local(), down.to_local()
        return gate_up, down

    @torch.compiler.disable  # data-dependent group sizes; the grouped kernel has no fp32 compiled form
    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Every routed pair on this rank, all experts local: ``x`` [n, hidden], ``weights`` and
        ``chosen`` [n, top_k] -> [n, hidden]."""
        n, k = chosen.shape
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        offsets = counts.cumsum(0).to(torch.int32)
        tokens = order // k
        gate_up, down = self.local()
        y = expert_mlp(x[tokens], gate_up, down, offsets)
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        return x.new_zeros(n, x.shape[-1], dtype=y.dtype).index_add(0, tokens, y)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) without biases: the shared expert."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEFeedForward(nn.Module):
    """The MoE MLP of one layer (see the module doc)."""

    # buffers (registered in __init__; declared for type checkers, which see Module attributes as Tensor | Module)
    balance_bias: torch.Tensor
    load: torch.Tensor
    aux_weights: torch.Tensor
    aux_value: torch.Tensor
    routed_share: torch.Tensor

    def __init__(self, spec: ModelSpec):
        super().__init__()
        moe = spec.moe
        assert moe is not None
        self.top_k, self.norm_topk = moe.top_k, moe.norm_topk
        self.router = nn.Linear(spec.hidden, moe.num_experts, bias=False)
        self.experts = Experts(spec)
        self.shared = SwiGLU(spec.hidden, moe.shared_ffn) if moe.shared_ffn else None
        self.shared_gate = nn.Linear(spec.hidden, 1, bias=False) if moe.shared_gate else None
        self.dispatch: Dispatch | None = None
        self.adapters = None  # LoRA adapters are not attached to experts (flexmesh.runtime.model.lora refuses)
        # Aux-loss-free balancing (DeepSeek-V3, 2412.19437): added to the probabilities to pick the
        # experts only; the trainer moves it between steps. Zero: transformers' routing.
        self.register_buffer("balance_bias", torch.zeros(moe.num_experts), persistent=True)
        self.register_buffer("load", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False)
        # The load-balancing loss's per-expert weights for this step (module doc), and its value summed
        # over this rank's micro-batches (for the metrics); zero weights: no loss.
        self.register_buffer("aux_weights", torch.zeros(moe.num_experts), persistent=False)
        self.register_buffer("aux_value", torch.zeros((), dtype=torch.float64), persistent=False)
        # The last step's share of routed pairs per expert, all ranks (zeros before the first step), kept
        # in checkpoints so that a resumed run places and balances its next step as an unbroken one would.
        self.register_buffer("routed_share", torch.zeros(moe.num_experts, dtype=torch.float64), persistent=True)
        self.aux_on = False  # whether aux_weights are set (read here without looking at the device)
        # Under tensor parallelism (flexmesh.runtime.parallel.parallelize.apply_tp): (tp index, tp size, tp group);
        # this rank's tokens are its slice of the row's sequence. None: the whole row.
        self.sequence_shard: tuple | None = None

    def reset_buffers(self) -> None:
        """Every buffer to its value at construction (all zero): a model materialised from meta with
        ``to_empty`` holds whatever the allocator handed out, and a Hugging Face checkpoint has none of
        these (a garbage balancing bias would pick other experts; garbage shares would place them)."""
        for buf in (self.balance_bias, self.load, self.aux_weights, self.aux_value, self.routed_share):
            buf.zero_()
        self.aux_on = False

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights [n, top_k] fp32, chosen experts [n, top_k], probabilities [n, experts] fp32) of tokens
        ``x`` [n, hidden]."""
        probs = F.softmax(self.router(x).float(), dim=-1)
        bias = self.balance_bias.to(probs.device, probs.dtype)
        chosen = torch.topk(probs + bias if self.training else probs, self.top_k, dim=-1).indices
        weights = probs.gather(-1, chosen)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen, probs

    def forward(self, x: torch.Tensor, real: int | None = None) -> torch.Tensor:
        """``x`` [B, T, hidden] -> [B, T, hidden]; only the first ``real`` tokens of the flattened
        rows are routed (None: all; the rest are padding, see the module doc)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        n = flat.shape[0] if real is None else real
        if real is not None and self.sequence_shard is not None:  # this tp rank's slice of the row
            n = min(flat.shape[0], max(0, real - self.sequence_shard[0] * flat.shape[0]))
        tokens = flat[:n]
        weights, chosen, probs = self.route(tokens)
        first = not recomputing()  # a forward recomputed inside backward counts nothing twice
        if first:
            with torch.no_grad():
                self.load += torch.bincount(chosen.reshape(-1), minlength=self.load.numel()).to(self.load.device)
        if self.dispatch is None:
            y = self.experts(tokens, weights, chosen)
        else:
            y = self.dispatch(self.experts, tokens, weights, chosen)
        if self.shared is not None:
            shared = self.shared(tokens)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(tokens)) * shared
            y = y + shared
        if self.aux_on and self.training and torch.is_grad_enabled():
            aux = (probs * self.aux_weights.to(probs.device)).sum()
            if first:
                self.aux_value += aux.detach().double().to(self.aux_value.device)
            y = AuxLoss.apply(y, aux)
        if n < flat.shape[0]:
            y = torch.cat([y, y.new_zeros(flat.shape[0] - n, shape[-1])])
        return y.reshape(*shape[:-1], y.shape[-1])


def moe_feed_forwards(model: nn.Module) -> dict[int, MoEFeedForward]:
    """The MoE layers of ``model`` (a Transformer, or a pipeline stage of one) by global layer number,
    activation checkpointing's wrapper looked through."""
    return {int(canonical_name(name).split(".")[1]): m for name, m in model.named_modules()
            if isinstance(m, MoEFeedForward)}  # named layers.<N>.feed_forward
