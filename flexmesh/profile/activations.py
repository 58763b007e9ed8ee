"""Saved-activation bytes of the runtime's layers and ends, measured per (tp, cp) degree and recomputation.

Part of ``flexmesh profile model`` (flexmesh.profile.model's module doc describes the method): each
saved tensor is counted by :class:`~flexmesh.runtime.observe.memory.SavedActivationMeter`, shards are measured
in one process by building one rank's shapes, and bytes are fitted as ``a + b * tokens + m * (tokens /
cp)^2`` over rows of three lengths.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from flexmesh.profile.fit import least_squares
from flexmesh.profile.modules import degrees, packed_row, rank_block
from flexmesh.runtime.model.loss import summed_cross_entropy
from flexmesh.spec.model import ModelSpec


def _saved_bytes(spec: ModelSpec, tp: int, cp: int, recompute: bool | str, tokens: int, dtype, device) -> int:
    """Bytes one rank's layer saves for backward for a row of ``tokens`` (see the module doc);
    ``recompute`` False, True (the whole layer) or "selective" (the attention core)."""
    from flexmesh.runtime.observe.memory import SavedActivationMeter

    block = rank_block(spec, dtype, device, tp)
    block.attention.recompute_core = recompute == "selective"
    local = tokens // cp  # this rank's slice of the row (context parallel)
    sp = local // tp  # the sequence-parallel slice between blocks
    row = packed_row(spec, [local], device)
    leaf = torch.randn(1, sp, spec.hidden, device=device, dtype=dtype, requires_grad=True)

    def gather(t):  # stands for the all-gather of the sequence-parallel slices
        return torch.cat([t] * tp, dim=1) if tp > 1 else t

    def scatter(t):  # stands for the reduce-scatter back to this rank's slice
        return t[:, :sp] if tp > 1 else t

    def layer(x):
        h = x + scatter(block.attention(gather(block.attention_norm(x)), row))
        return h + scatter(block.feed_forward(gather(block.ffn_norm(h))))

    with SavedActivationMeter() as meter:
        x = leaf * 1.0  # an activation, not a leaf, as a layer's input is in the model
        y = checkpoint(layer, x, use_reentrant=False) if recompute is True else layer(x)
        saved = meter.live_bytes
    del y, x
    return saved


def measure_activations(spec: ModelSpec, cfg: dict, dtype, device, advance) -> dict:
    tokens = cfg["act_tokens"]
    layers = []
    mask = 0.0
    for tp, cp in cfg.get("degrees") or degrees(spec, cfg["max_degree"]):  # profile_model's degrees_only
        usable = [t for t in tokens if t % (tp * cp) == 0]
        for recompute in (False, True, "selective"):
            saved = [_saved_bytes(spec, tp, cp, recompute, t, dtype, device) for t in usable]
            t = np.asarray(usable, dtype=float)
            a, b, m = least_squares(np.stack([np.ones_like(t), t, (t / cp) ** 2], axis=1), saved)
            if tp == cp == 1 and not recompute:
                mask = float(m)
            layers.append({"tp": tp, "cp": cp, "recompute": recompute, "bytes_per_token": float(b),
                           "constant_bytes": float(a), "samples_tokens_bytes": [list(x) for x in zip(usable, saved)]})
        advance(f"activations tp{tp} cp{cp}")
    # The slope between two token counts: what does not grow with tokens is not per token.
    lo, hi = (_end_activation_bytes(spec, n, dtype, device) for n in tokens[-2:])
    ends = {k: (hi[k] - lo[k]) / (tokens[-1] - tokens[-2]) for k in hi}
    return {"layers": layers, "attention_mask_bytes_per_sq_row_token": mask, **ends,
            "carried": measure_carried(spec, tokens, dtype, device)}


CARRIED_TERMS = ("per_prefix_token", "per_prefix_query_pair", "per_query_sq", "per_query")


def measure_carried(spec: ModelSpec, tokens: list[int], dtype, device) -> dict:
    """What a layer saves beyond the same tokens whole when they continue a cut document's prefix
    (flexmesh.runtime.model.carry: the prefix's keys and values, and whatever the kernel keeps for queries
    over a longer key range), fitted as ``a * p + b * p * n + c * n^2 + d * n`` for ``n`` tokens
    after a prefix of ``p``, on one device without tp or cp (shards divide it by tp * cp)."""
    samples = []
    for n in tokens[:2]:
        for p in tokens:
            samples.append((p, n, _carried_extra(spec, p, n, dtype, device)))
    x = np.array([[p, p * n, n * n, n] for p, n, _ in samples], dtype=float)
    coef = least_squares(x, [e for _, _, e in samples])
    return {**{k: float(c) for k, c in zip(CARRIED_TERMS, coef)},
            "samples_prefix_tokens_bytes": [list(x) for x in samples]}


def _carried_extra(spec: ModelSpec, prefix: int, tokens: int, dtype, device) -> int:
    """Saved bytes of a layer on ``tokens`` tokens continuing a ``prefix``-token piece of one
    document, less the same tokens as a document of their own."""
    from flexmesh.layout.step import Piece
    from flexmesh.runtime.model.carry import KVCarry
    from flexmesh.runtime.model.transformer import make_row
    from flexmesh.runtime.observe.memory import SavedActivationMeter

    block = rank_block(spec, dtype, device, 1)
    store = KVCarry(detached=True)
    first, second = Piece(0, 0, prefix), Piece(0, prefix, prefix + tokens)

    def row(piece: Piece, keep: frozenset):
        cu = torch.tensor([0, piece.length], dtype=torch.int32, device=device)
        positions = torch.arange(piece.start, piece.end, device=device)[None]
        return make_row(spec, positions, cu, (0, piece.length), carry=store.view((piece,), keep))

    x = torch.randn(1, prefix, spec.hidden, device=device, dtype=dtype, requires_grad=True)
    block.attention(block.attention_norm(x * 1.0), row(first, frozenset({(0, 0)})))  # keeps the prefix
    later = row(second, frozenset())
    y = torch.randn(1, tokens, spec.hidden, device=device, dtype=dtype, requires_grad=True)
    with SavedActivationMeter() as meter:
        h = y * 1.0
        h = h + block.attention(block.attention_norm(h), later)
        h = h + block.feed_forward(block.ffn_norm(h))
        saved = meter.live_bytes
    del h
    return saved - _saved_bytes(spec, 1, 1, False, tokens, dtype, device)


def _end_activation_bytes(spec: ModelSpec, tokens: int, dtype, device) -> dict:
    """Bytes the embedding, and the final norm + head + loss, save for backward for ``tokens`` tokens."""
    from flexmesh.runtime.observe.memory import SavedActivationMeter

    with torch.device(device):
        emb = torch.nn.Embedding(spec.vocab, spec.hidden).to(dtype)
        norm = torch.nn.RMSNorm(spec.hidden, eps=spec.norm_eps).to(dtype)
        head = torch.nn.Linear(spec.hidden, spec.vocab, bias=False).to(dtype)
    ids = torch.randint(0, spec.vocab, (1, tokens), device=device)
    with SavedActivationMeter() as m_emb:
        e = emb(ids)
    leaf = torch.randn(1, tokens, spec.hidden, device=device, dtype=dtype, requires_grad=True)
    with SavedActivationMeter() as m_head:
        logits = head(norm(leaf * 1.0))
        loss = summed_cross_entropy(logits, ids)
    del e, logits, loss
    return {"embedding_bytes_per_token": m_emb.peak_bytes, "head_bytes_per_token": m_head.peak_bytes}
