"""Mixture-of-experts layers in the cost model: routed experts' compute, their exchanges, their bytes.

A MoE layer (flexmesh.spec.moe) replaces the dense MLP by a router, ``E`` SwiGLU experts of width
``F`` of which each token runs ``k``, and an optional shared expert. How the experts are parallel is
:class:`ExpertParallel`:

- ``ep = 0`` (flexmesh's runtime, LAER-MoE's FSEP, 2602.11686): every expert is sharded over the
  ``N`` data ranks of a stage; each micro-batch and layer, each rank gathers the ``C`` whole experts
  its placement gives it (an all-to-all of ``C x 3HF`` weights, and the same of their gradients in
  backward) and keeps 1/N of every expert's weights, gradients and optimizer states;
- ``ep = e`` (Megatron-LM's expert parallelism): whole experts over ``e`` data ranks, ``E / e`` each,
  replicated over the ``N / e`` others, whose gradients are reduced once per step.

Either way each routed (token, expert) pair travels to its expert's rank and back by all-to-all
(``k x H`` elements per token each way, forward and backward), and the most loaded rank sets the
layer's time: its routed pairs are ``imbalance`` times the mean ``k`` per token. ``imbalance`` is the
max/mean routed tokens per rank of the placement (:data:`IMBALANCE`, measured; or a routing trace
replayed by :func:`trace_imbalance` for the plan's ranks).

Compute per device and micro-batch of ``T`` tokens, with ``P = T k imbalance`` routed pairs over its
``C`` experts: the router GEMM ``(T, E, H)``; per expert the ``(P / C, 2F, H)`` and ``(P / C, H, F)``
GEMMs (a grouped GEMM); the shared expert's ``(T, 2F_s, H)`` and ``(T, H, F_s)`` and its gate; the
memory-bound work (fused kernels, read + write once forward, twice backward): the permutation of
tokens to experts and back (``2 x 2H`` per pair), SwiGLU on each pair (``3F``), the weighted sum
(``2H`` per pair), the router's softmax and top-k in fp32 (``2 x 4E`` bytes per token).

Saved activations per token (what autograd keeps in the runtime's MoE layer, flexmesh.runtime.model.moe):
the router's fp32 probabilities (``E``), and per routed pair the gathered input (``H``), gate and up
(``2F``), the SwiGLU output (``F``), the down projection's output before weighting (``H``): ``2H + 3F``
elements per pair; the shared expert as a dense SwiGLU (``4 F_s``, gate and up, SwiGLU output, down
input). Gathered experts (FSEP) are kept for backward like activations, ``C x 3HF`` per layer, unless
the layer is recomputed (then only while it runs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from flexmesh.cost.device.hardware import group_shape
from flexmesh.spec.model import ModelSpec

# Max/mean routed tokens per rank by placement, measured: LAER-MoE's artifact (github.com/PKU-DAIR/
# Hetu-Galvatron, branch laer-moe, scripts_ae/token_analysis_backup.csv: tokens per device of every
# layer and recorded iteration, Mixtral-shaped models of 8 experts top 2 and 16 experts top 4 on 32
# A100s), the mean over layers and iterations: static placement (its FSDP+EP) 1.664 and 1.729, LAER's
# load-following placement 1.413 and 1.288. The means of the two models are used at any rank count;
# a recorded trace replayed for the plan's ranks (trace_imbalance) replaces them. EPLB and placement
# from each micro-batch's own load ("current") have no published figure on these models: priced as
# load-following until a trace says otherwise (on the traces recorded here, bench/experts.py, EPLB
# does worse than it and "current" better).
IMBALANCE = {"static": (1.664 + 1.729) / 2, "laer": (1.413 + 1.288) / 2, "eplb": (1.413 + 1.288) / 2,
             "current": (1.413 + 1.288) / 2}


def default_slots(num_experts: int, ranks: int) -> int:
    """Experts one rank may run in a layer under FSEP: its static share plus one spare slot for a
    replica (at most every expert); the runtime's placements (flexmesh.schedule.expert_placement) and
    the cost model both use this.

    >>> default_slots(8, 2), default_slots(8, 16), default_slots(64, 64)
    (5, 2, 2)
    """
    return min(num_experts, -(-num_experts // ranks) + 1)


@dataclass(frozen=True)
class ExpertParallel:
    """How a plan runs a mixture of experts (see the module doc)."""

    placement: str = "laer"  # flexmesh.schedule.expert_placement.PLACEMENTS
    ep: int = 0  # 0: experts sharded over every data rank (FSEP); e: whole experts over e data ranks
    imbalance: float | None = None  # max/mean routed tokens per rank; None: IMBALANCE[placement]
    # (placement, data ranks, max/mean) measured by replaying a routing trace under each placement
    # (flexmesh.schedule.expert_placement.trace_imbalance); used unless ``imbalance`` is given
    measured: tuple[tuple[str, int, float], ...] = ()
    slots: int | None = None  # experts one rank gathers per layer (FSEP); None: its share plus one
    # FSEP's expert exchanges run under the layer's compute (LAER-MoE's communication scheduling: the
    # weights prefetched as FSDP prefetches, the gradients sent while the next layer computes); False:
    # exposed, as flexmesh's runtime runs them
    prefetch: bool = False
    # Tokens go to a replica in their own node where every node has one (LAER-MoE's routing); False:
    # to every replica alike, as flexmesh's runtime routes them
    node_local: bool = False
    # The token all-to-all compressed by cross-polytope LSH (LSH-MoE; flexmesh.runtime.parallel.lsh): (dim, hashes);
    # None: the tokens themselves. ``compression``: rows sent per routed pair, measured (a run's
    # ``expert_a2a_ratio``); None: :meth:`a2a_ratio`'s estimate
    lsh: tuple[int, int] | None = None
    compression: float | None = None

    def __post_init__(self) -> None:
        if self.placement not in IMBALANCE:
            raise ValueError(f"expert placement {self.placement!r} is not one of {', '.join(IMBALANCE)}")
        if self.ep < 0 or (self.imbalance is not None and self.imbalance < 1.0):
            raise ValueError(f"ep must be >= 0 and imbalance >= 1, got {self.ep} and {self.imbalance}")
        if self.prefetch and self.placement == "current":
            raise ValueError("experts placed from a micro-batch's own routing cannot be gathered before it: "
                             "no prefetch with placement 'current'")

    @property
    def expected_imbalance(self) -> float:
        return IMBALANCE[self.placement] if self.imbalance is None else self.imbalance

    def imbalance_at(self, data_ranks: int) -> float:
        """Max/mean routed tokens per rank over ``data_ranks`` ranks (over the EP group under EP):
        ``imbalance`` if given, else the replayed trace's at that count, else :data:`IMBALANCE`'s; 1 on
        one rank (it runs every token).

        >>> e = ExpertParallel(measured=(("laer", 8, 1.2),))
        >>> e.imbalance_at(8), round(e.imbalance_at(16), 3), e.imbalance_at(1)
        (1.2, 1.351, 1.0)
        """
        ranks = min(self.ep, data_ranks) if self.ep else data_ranks  # EP balances over its group alone
        if ranks <= 1:
            return 1.0
        if self.imbalance is not None:
            return self.imbalance
        return {(p, n): x for p, n, x in self.measured}.get((self.placement, ranks), IMBALANCE[self.placement])

    def a2a_ratio(self, pairs_per_expert):  # noqa: ANN001, ANN201 - a float or an array
        """Rows one token all-to-all carries per routed pair: 1 uncompressed; with ``lsh``, the measured
        ``compression`` if given, else the clusters ``n`` pairs bound for one expert fill among ``B = (2 dim)
        ** hashes`` buckets when they fall in them uniformly, ``B (1 - (1 - 1/B) ** n) / n`` (balls into bins:
        tokens that resemble each other share buckets more, so this is the least compression to expect).

        >>> e = ExpertParallel(lsh=(16, 1))
        >>> round(float(e.a2a_ratio(128.0)), 3), ExpertParallel().a2a_ratio(128.0), round(float(e.a2a_ratio(1.0)), 9)
        (0.246, 1.0, 1.0)
        """
        if self.lsh is None:
            return 1.0
        if self.compression is not None:
            return self.compression
        dim, hashes = self.lsh
        b = float((2 * dim) ** hashes)
        n = np.maximum(np.asarray(pairs_per_expert, dtype=float), 1.0)
        ratio = b * -np.expm1(n * np.log1p(-1.0 / b)) / n if b > 1 else 1.0 / n
        return float(ratio) if np.ndim(ratio) == 0 else ratio

    def experts_per_rank(self, num_experts: int, data_ranks: int) -> int:
        """Experts one rank computes per layer: all on one rank; FSEP's slots (:func:`default_slots`
        unless given); or E / ep.

        >>> ExpertParallel().experts_per_rank(8, 32), ExpertParallel(ep=8).experts_per_rank(8, 64)
        (2, 1)
        """
        if data_ranks <= 1:
            return num_experts
        if self.ep:
            return max(1, num_experts // self.ep)
        return min(self.slots, num_experts) if self.slots is not None else default_slots(num_experts, data_ranks)

    def exchange_ranks(self, data_ranks: int, num_experts: int = 1, per_node: int = 0) -> int:
        """Ranks a token travels among: the EP group; under FSEP every data rank, or with ``node_local``
        routing the ranks of its node when every expert can have a replica on every node (``per_node``
        data ranks a node).

        >>> local, spread = ExpertParallel(node_local=True), ExpertParallel()
        >>> local.exchange_ranks(32, 8, per_node=8), local.exchange_ranks(32, 64, 8), spread.exchange_ranks(32, 8, 8)
        (8, 32, 32)
        """
        if self.ep:
            return min(self.ep, data_ranks)
        if self.node_local and per_node and data_ranks > per_node:
            replicas = data_ranks * self.experts_per_rank(num_experts, data_ranks) // num_experts
            if replicas >= data_ranks // per_node:
                return per_node
        return data_ranks


def moe_fraction(model: ModelSpec) -> float:
    """Share of the layers that are MoE layers (the cost model prices the mean layer)."""
    return model.moe_layers / model.num_layers


def expert_gemm_times(kernels, model: ModelSpec, tokens, experts: ExpertParallel, data_ranks: int,  # noqa: ANN001, ANN201
                      routed_only: bool = False):
    """(forward, backward) seconds of one MoE MLP's matmuls on the most loaded rank: router, routed
    experts (a grouped GEMM over its experts), shared expert and gate (``routed_only``: the routed
    experts alone, the part the imbalance grows); ``tokens`` may be an array."""
    moe = model.moe
    assert moe is not None
    h, f = model.hidden, moe.expert_ffn
    c = experts.experts_per_rank(moe.num_experts, data_ranks)
    rows = tokens * moe.top_k * experts.imbalance_at(data_ranks) / c
    if data_ranks > 1:  # with LSH the experts run the centroids that crossed, not every pair
        rows = rows * experts.a2a_ratio(tokens * moe.top_k / moe.num_experts)
    fwd = bwd = 0.0
    for n, red, count, m, routed in ((moe.num_experts, h, 1, tokens, False), (2 * f, h, c, rows, True),
                                     (h, f, c, rows, True), (2 * moe.shared_ffn, h, 1, tokens, False),
                                     (h, moe.shared_ffn, 1, tokens, False),
                                     (1 if moe.shared_gate else 0, h, 1, tokens, False)):
        if routed_only and not routed:
            continue
        a, b = kernels.linear(m, n, red)
        fwd, bwd = fwd + count * a, bwd + count * b
    if experts.lsh is not None and data_ranks > 1 and not routed_only:  # the hash: each pair rotated, no gradient
        dim, hashes = experts.lsh
        fwd = fwd + kernels.linear(tokens * moe.top_k, hashes * dim, h)[0]
    return fwd, bwd


def moe_memory_bytes(model: ModelSpec, experts: ExpertParallel) -> float:
    """Bytes a MoE MLP's memory-bound kernels move per token (forward) on the most loaded rank."""
    moe = model.moe
    assert moe is not None
    pairs = moe.top_k * experts.expected_imbalance
    b = model.dtype_bytes
    per_pair = (2 * 2 * model.hidden + 3 * moe.expert_ffn + 2 * model.hidden) * b
    if experts.lsh is not None:  # centroids summed (read H per pair) and each pair's residual added back (3H)
        per_pair += 4 * model.hidden * b
    shared = 3 * moe.shared_ffn * b
    return pairs * per_pair + shared + 2 * 4 * moe.num_experts


def moe_activation_elems(model: ModelSpec, experts: ExpertParallel) -> float:
    """Elements a MoE MLP keeps for backward per token on the most loaded rank (module doc), besides
    its input (the norm's, counted with the layer's)."""
    moe = model.moe
    assert moe is not None
    router = moe.num_experts * 4 / model.dtype_bytes  # fp32 probabilities
    pairs = moe.top_k * experts.expected_imbalance * (2 * model.hidden + 3 * moe.expert_ffn)
    return router + pairs + 4 * moe.shared_ffn


def expert_params(model: ModelSpec) -> int:
    """Routed experts' weights of one (mean) layer: what expert parallelism shards."""
    moe = model.moe
    return 0 if moe is None else round(moe_fraction(model) * moe.routed_params(model.hidden))


def gathered_expert_bytes(model: ModelSpec, experts: ExpertParallel, data_ranks: int) -> float:
    """Bytes of the whole experts one rank gathers for one (mean) layer under FSEP (none under EP)."""
    moe = model.moe
    if moe is None or experts.ep or data_ranks < 2:
        return 0.0
    c = experts.experts_per_rank(moe.num_experts, data_ranks)
    return moe_fraction(model) * c * 3 * model.hidden * moe.expert_ffn * model.dtype_bytes


def synced_params(model: ModelSpec, tp: int) -> int:
    """Weights of one (mean) layer that data parallelism and ZeRO handle as for a dense model: all but
    the routed experts (attention, norms, router, shared expert, dense MLPs), with what each of the
    ``tp`` ranks keeps whole (:func:`tp_whole_params`) counted on each; a dense model's layer_params."""
    return model.layer_params - expert_params(model) + (tp - 1) * tp_whole_params(model)


def tp_whole_params(model: ModelSpec) -> int:
    """Weights of one (mean) MoE layer that tensor parallelism keeps whole on every tp rank (each rank
    routes its slice of the sequence): the router, the shared expert and its gate."""
    moe = model.moe
    return 0 if moe is None else round(moe_fraction(model) * (moe.router_params(model.hidden)
                                                                 + moe.shared_params(model.hidden)))


def moe_communication(collective_time, cluster, model: ModelSpec, experts: ExpertParallel, data_ranks: int,  # noqa: ANN001
                      dev_tokens, recompute: bool):  # noqa: ANN001, ANN201
    """(tokens forward, tokens backward, weights forward, weights backward) seconds of one (mean)
    layer's expert exchanges on the most loaded rank: the routed tokens' all-to-alls (there and back,
    in each pass; again in backward's recomputed forward) and, under FSEP, the gathered experts'
    all-to-all forward and their gradients' backward (gathered again for a recomputed forward), with
    placement ``current`` after an all-reduce of the tokens per expert. ``data_ranks``: every rank of
    the stage, tp ranks included (consecutive in the cluster); ``collective_time``: the hardware's."""
    moe = model.moe
    if moe is None or data_ranks < 2:
        return 0.0, 0.0, 0.0, 0.0
    frac, b = moe_fraction(model), model.dtype_bytes
    shape = group_shape(experts.exchange_ranks(data_ranks, moe.num_experts, cluster.devices_per_node), 1, cluster)
    pairs = dev_tokens * moe.top_k * experts.imbalance_at(data_ranks)
    pairs = pairs * experts.a2a_ratio(dev_tokens * moe.top_k / moe.num_experts)  # LSH: centroids cross instead
    tokens = frac * 2 * collective_time("all_to_all", pairs * model.hidden * b, shape)
    gathered = gathered_expert_bytes(model, experts, data_ranks)
    weights = collective_time("all_to_all", gathered, group_shape(data_ranks, 1, cluster)) if gathered else 0.0
    if experts.placement == "current" and not experts.ep:  # the micro-batch's tokens per expert, all-reduced first
        weights += frac * collective_time("all_reduce", 8.0 * moe.num_experts, group_shape(data_ranks, 1, cluster))
    passes = 2 if recompute else 1
    return tokens, passes * tokens, weights, passes * weights


def expert_states(model: ModelSpec, experts: ExpertParallel, data_ranks: int,
                  state_bytes: tuple[float, float, float]) -> float:
    """Bytes of one (mean) layer's routed experts' weights, gradients and optimizer states on one rank:
    FSEP keeps 1/N of each; EP keeps E/ep experts' weights and gradients with their optimizer states
    sharded over the N/ep ranks holding the same experts (a distributed optimizer)."""
    params = expert_params(model)
    w, g, o = state_bytes
    if not params:
        return 0.0
    if not experts.ep or data_ranks < 2:
        return params / max(1, data_ranks) * (w + g + o)
    ep = experts.exchange_ranks(data_ranks)
    return params / ep * (w + g + o / max(1, data_ranks // ep))


def expert_sync(collective_time, cluster, model: ModelSpec, experts: ExpertParallel, data_ranks: int,  # noqa: ANN001
                grad_bytes: float, optimizer_s_per_param: float) -> tuple[float, float]:
    """(once-per-step gradient sync, optimizer) seconds of one (mean) layer's routed experts: FSEP
    needs no sync (each gradient arrives in its shard through the exchanges) and steps 1/N of them;
    EP reduce-scatters the E/ep experts' gradients over the N/ep ranks holding them and all-gathers
    the weights (an all-reduce's volume) and steps its share."""
    params = expert_params(model)
    n = max(1, data_ranks)
    if not experts.ep or n < 2:
        return 0.0, params / n * optimizer_s_per_param
    ep = experts.exchange_ranks(n)
    replicas = n // ep
    sync = collective_time("all_reduce", params / ep * grad_bytes, group_shape(replicas, ep, cluster))
    return sync, params / n * optimizer_s_per_param


def expert_imbalanced(times, even, imbalance: float, s, tokens, sq_tokens):  # noqa: ANN001, ANN201
    """``times`` (LayerTimes) of a MoE layer measured on one rank (a model profile: every expert local, so
    every rank's share even) with its routed experts' part scaled to the most loaded rank's
    (``imbalance``): that part is the share the analytic timing ``even`` (built with imbalance 1) gives
    the routed experts' GEMMs in the layer (the router and the shared expert run every token alike)."""
    if imbalance == 1.0:
        return times
    whole = even.layer_times(s, tokens, sq_tokens)
    f, b = expert_gemm_times(even.kernels, even.model, tokens / (s.cp * s.tp), even.experts, s.dp * s.cp * s.tp,
                             routed_only=True)
    frac, grow = moe_fraction(even.model), imbalance - 1.0

    def share(part, total):  # noqa: ANN001, ANN202 - floats or arrays; no tokens: no share
        out = np.divide(part, total, out=np.zeros_like(np.asarray(total, dtype=float)), where=np.asarray(total) > 0)
        return out if np.ndim(out) else float(out)

    return replace(times, fwd=times.fwd * (1.0 + grow * frac * share(f, whole.fwd)),
                   bwd=times.bwd * (1.0 + grow * frac * share(b, whole.bwd)))
