"""A step's schedules priced: micro-batch times and phases, token caps, the once-per-step gradient sync.

The per-step scheduler (flexmesh.schedule) prices many micro-batches at once (numpy arrays of tokens
and squared tokens) and the step simulator (flexmesh.sim) orders their passes; both ask
:class:`~flexmesh.cost.training.model.CostModel`, whose per-step methods are these functions over its
:class:`~flexmesh.cost.training.layer.LayerPricing`. The formulas are the layer's own
(:meth:`LayerPricing.phases`), summed over a stage's layers. Time is exactly linear in ``tokens`` and
``sq_tokens`` except where communication hides under compute, so it is evaluated term by term rather
than through fitted coefficients.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from flexmesh.cost.training.experts import synced_params
from flexmesh.cost.training.layer import LayerPricing
from flexmesh.cost.training.memory import layer_transient_bytes
from flexmesh.cost.training.work import MicrobatchPhases, Work
from flexmesh.layout.enums import CPKind
from flexmesh.layout.overlap import Overlap
from flexmesh.layout.strategy import LayerStrategy


def microbatch_phases(pricing: LayerPricing, s: LayerStrategy, tokens, sq_tokens, layers: int,  # noqa: ANN001
                      head: bool, embed: bool, overlap: Overlap) -> MicrobatchPhases:
    """Forward and backward, compute and exposed communication, of one micro-batch of ``tokens`` through
    ``layers`` layers (and the head, and the embedding) on a tp x cp group under ``overlap``."""
    tokens = np.asarray(tokens, dtype=float)
    sq = np.asarray(sq_tokens, dtype=float)
    fwd, bwd, cf, cb = pricing.phases(s, tokens, sq, overlap)
    head_f, head_b = pricing.timing.head_times(s, tokens) if head else (0.0, 0.0)
    if embed:
        emb_f, emb_b = pricing.timing.embedding_times(s, tokens)
        head_f, head_b = head_f + emb_f, head_b + emb_b
    zero = np.zeros_like(tokens)
    return MicrobatchPhases(fwd=fwd * layers + head_f, bwd=bwd * layers + head_b,
                            comm_fwd=(cf + zero) * layers, comm_bwd=(cb + zero) * layers)


def activation_bytes_per_token(pricing: LayerPricing, s: LayerStrategy, layers: int, in_flight_mbs: float) -> float:
    """Saved-activation bytes per token of a micro-batch on each device of a tp x cp group."""
    return pricing.timing.activation_bytes_per_token(s, bool(s.recompute)) * layers * in_flight_mbs


def max_tokens(pricing: LayerPricing, s: LayerStrategy, layers: int, embed: bool, head: bool, in_flight_mbs: float,
               overlap: Overlap, budget: float) -> int:
    """Largest micro-batch (tokens on the tp x cp group) whose states, activations and transient
    buffers fit in ``budget`` bytes under ``s`` and ``overlap``."""
    one = Work(tokens=1.0, sq_tokens=1.0)
    states = pricing.layer(s, one, overlap).states * layers
    if embed or head:
        states += pricing.ends(s, one, embed, head, overlap).states
    per_token = activation_bytes_per_token(pricing, s, layers, in_flight_mbs)
    if s.recompute:  # one layer's full activations while it is recomputed
        per_token += pricing.timing.activation_bytes_per_token(s, False)
    if head:
        per_token += pricing.timing.logit_bytes(s, 1.0)
    # Transient buffers: a constant part and a part linear in the micro-batch's tokens.
    transient = layer_transient_bytes(pricing.model, s, 0.0, overlap, 0.0, pricing.reduce_bytes)
    per_token += layer_transient_bytes(pricing.model, s, 1.0, overlap, 0.0, pricing.reduce_bytes) - transient
    free = budget - states - transient
    return max(0, int(free / per_token))


def step_grad_sync(pricing: LayerPricing, s: LayerStrategy, data_ranks: int, layers: int, embed: bool,
                   head: bool) -> tuple[float, float]:
    """(gradient sync, optimizer) seconds, once per step, for one stage's parameters over ``data_ranks``.

    For per-step schedules whose ranks run different numbers of micro-batches: gradients are
    accumulated locally and reduced once at the end of the step over every data rank holding the
    same weights (tp-strided). ZeRO-0/1 all-reduce the gradients; ZeRO-2 and ZeRO-3 reduce-scatter
    them and all-gather the updated weights (ZeRO-3's per-layer gathers inside the step are
    prefetched under compute, as in :meth:`LayerPricing.layer`). Nothing is hidden here; callers that
    overlap the sync with a backward pass do so themselves."""
    m = pricing.model
    t = replace(s, cp=1, cp_kind=CPKind.NONE, dp=data_ranks, zero=min(s.zero, 2))
    # routed experts: below; the router and shared expert are whole on every tp rank
    params = [(synced_params(m, s.tp), layers)]
    if embed:
        params.append((m.embedding_params, 1))
    if head:  # a tied head on another stage keeps its own copy (as LayerPricing.ends prices it)
        params.append((m.head_params + (m.vocab * m.hidden if m.tie_embeddings and not embed else 0), 1))
    sync = optim = 0.0
    for p, n in params:
        zf, zb, once, opt = pricing.trained.grad_comm(p, t, 0.0, 0.0)
        sync += n * (zf + zb + once)
        optim += n * opt
    if pricing.experts is not None:
        esync, eopt = pricing.experts.step_sync(data_ranks * s.tp, pricing.reduce_bytes,
                                                pricing.timing.optimizer_s_per_param())
        sync, optim = sync + layers * esync, optim + layers * eopt
    return sync, optim
