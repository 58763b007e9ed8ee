"""Attention over packed documents: one entry point, ``attend``, local or context-parallel.

Packed documents share one row of T tokens; ``cu_seqlens`` holds their boundaries and a token
attends causally to earlier tokens of its own document only. Tokens past ``cu_seqlens[-1]`` (if
any) count as one more trailing document.

Worked example of the mask (T = 5, cu_seqlens = [0, 3, 5]: documents a a a b b)::

    document id   0 0 0 1 1            query \\ key  0 1 2 3 4
                                       0            1 . . . .
    allowed(i, j) = same document      1            1 1 . . .
                    and j <= i         2            1 1 1 . .
                                       3            . . . 1 .
                                       4            . . . 1 1

Sliding window ``w`` (Mistral/Qwen2; the ``window`` argument of every function here): query i also
needs ``i - w < j``, so it sees at most the last ``w`` keys of its document, itself included. This
is transformers' ``sliding_window_causal`` mask (``kv_idx > q_idx - sliding_window``) and flash-attn's
``window_size=(w - 1, 0)``. ``window=None`` is plain document-causal attention.

Local kernels (which one runs where, and the row description they share): see
flexmesh.runtime.model.attention_kernels.

Context parallelism (``cp`` given): each rank holds a contiguous 1/cp slice of the row while
``cu_seqlens`` stays global.

- Ulysses: an all-to-all turns (all heads, my tokens) into (my heads, all tokens), runs the local kernel
  document by document, and turns the result back. Needs heads divisible by cp.
- Ring: K/V blocks travel around the ring (batched isend/irecv); each rank merges the blockwise
  attention of its queries with every block by log-sum-exp. The backward runs the ring again,
  carrying dK/dV with their blocks until they are back home. Written by hand because PyTorch's
  ``context_parallel`` needs CUDA and knows no document masks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flexmesh.errors import PlanError
from flexmesh.runtime.model.attention_kernels import (  # noqa: F401 - re-exported: the names callers know
    Documents,
    as_documents,
    document_ids,
    flash_window_size,
    local_attention,
    repeat_kv,
    window_causal,
)


@dataclass(frozen=True)
class CPContext:
    """A context-parallel group as attention sees it: ``rank`` of ``size`` in ``group``."""

    kind: str  # "ulysses" | "ring"
    group: dist.ProcessGroup
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.kind not in ("ulysses", "ring"):
            raise PlanError(f"context-parallel kind must be 'ulysses' or 'ring', got {self.kind!r}")
        if not 0 <= self.rank < self.size:
            raise PlanError(f"context-parallel rank {self.rank} is outside a group of {self.size}")


# ---- masks -----------------------------------------------------------------------------------------
def document_causal_mask(
    cu_seqlens: torch.Tensor, q_start: int, q_len: int, k_start: int, k_len: int, total: int,
    window: int | None = None,
) -> torch.Tensor:
    """Boolean mask [q_len, k_len] of global queries [q_start, +q_len) over keys [k_start, +k_len).

    Positions are global (in the whole row), so a block of the mask is the slice of the whole one;
    within a document the global distance i - j is the in-document distance the window limits.
    """
    doc = document_ids(cu_seqlens, total)
    qi = torch.arange(q_start, q_start + q_len, device=doc.device)
    ki = torch.arange(k_start, k_start + k_len, device=doc.device)
    return (doc[qi][:, None] == doc[ki][None, :]) & window_causal(qi[:, None], ki[None, :], window)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"attend expects q [B, H, T, D] and k, v [B, Hkv, T, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise PlanError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads; "
                        "tensor parallelism must split both head counts by the same degree")


# ---- Ulysses -------------------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """All-to-all along dim 0 with equal chunks: chunk i goes to rank i, slot j comes from rank j.

    It is a permutation that is its own inverse, so its backward is the same all-to-all. Written
    here because the public autograd-aware wrapper in torch.distributed.nn is deprecated.
    """

    @staticmethod
    def forward(ctx, x, group):  # noqa: ANN001, ANN205
        ctx.group = group
        x = x.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, unlike empty_like
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        grad = grad.contiguous()  # autograd may hand in an expanded or permuted gradient
        out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _all_to_all(x: torch.Tensor, cp: CPContext) -> torch.Tensor:
    return _AllToAll.apply(x, cp.group)


def _seq_to_heads(x: torch.Tensor, cp: CPContext) -> torch.Tensor:
    """[B, H, T/cp, D] (all heads, my tokens) -> [B, H/cp, T, D] (my heads, all tokens)."""
    b, h, tl, d = x.shape
    chunks = x.reshape(b, cp.size, h // cp.size, tl, d).permute(1, 0, 2, 3, 4).contiguous()
    got = _all_to_all(chunks, cp)  # got[j]: my heads of rank j's tokens
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp.size, cp.size * tl, d)


def _heads_to_seq(x: torch.Tensor, cp: CPContext) -> torch.Tensor:
    """[B, H/cp, T, D] -> [B, H, T/cp, D], the inverse of :func:`_seq_to_heads`."""
    b, hc, t, d = x.shape
    tl = t // cp.size
    chunks = x.reshape(b, hc, cp.size, tl, d).permute(2, 0, 1, 3, 4).contiguous()
    got = _all_to_all(chunks, cp)  # got[j]: rank j's heads of my tokens
    return got.permute(1, 0, 2, 3, 4).reshape(b, cp.size * hc, tl, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: "torch.Tensor | Documents",
                      cp: CPContext, window: int | None = None) -> torch.Tensor:
    h, hkv = q.shape[1], k.shape[1]
    if h % cp.size:
        raise PlanError(f"Ulysses context parallelism of degree {cp.size} needs the {h} query heads per "
                        "tensor-parallel rank to divide evenly; lower cp or tp, or use ring attention")
    if hkv % cp.size:  # too few key/value heads to split: give every query head its own copy
        k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    out = local_attention(_seq_to_heads(q, cp), _seq_to_heads(k, cp), _seq_to_heads(v, cp), cu_seqlens, window)
    return _heads_to_seq(out, cp)


# ---- ring --------------------------------------------------------------------------------------------
class _RingShift:
    """Send a flat buffer ``hops`` ranks on along the ring and receive the one ``hops`` back, async."""

    def __init__(self, cp: CPContext, hops: int = 1):
        self.cp = cp
        self.next = dist.get_global_rank(cp.group, (cp.rank + hops) % cp.size)
        self.prev = dist.get_global_rank(cp.group, (cp.rank - hops) % cp.size)

    def start(self, tensors: list[torch.Tensor]) -> tuple[list, torch.Tensor, list[torch.Tensor]]:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        recv = torch.empty_like(flat)
        ops = [dist.P2POp(dist.isend, flat, self.next, self.cp.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.cp.group)]
        return dist.batch_isend_irecv(ops), recv, tensors

    @staticmethod
    def finish(handle: tuple[list, torch.Tensor, list[torch.Tensor]]) -> list[torch.Tensor]:
        reqs, recv, like = handle
        for r in reqs:
            r.wait()
        out, at = [], 0
        for t in like:
            out.append(recv[at:at + t.numel()].view_as(t))
            at += t.numel()
        return out


def _scores(qg: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked scores [B, Hkv, G, Tq, Tk] of grouped queries qg [B, Hkv, G, Tq, D] against k [B, Hkv, Tk, D]."""
    s = torch.matmul(qg, k[:, :, None].transpose(-1, -2)) * scale
    return s.masked_fill(~mask, float("-inf"))


def _safe(lse: torch.Tensor) -> torch.Tensor:
    """-inf (a row with no visible key) -> 0, so exp(s - lse) is 0 instead of NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def ring_steps(cp_size: int, block: int, window: int | None) -> int:
    """Ring steps with work for someone: block r - s is within the window of rank r's queries iff
    its nearest key, (s - 1) * block + 1 tokens back, is closer than ``window`` (step 0: own block).

    The same on every rank, so later steps (their K/V shifts too) are dropped by all.

    >>> ring_steps(4, 8, None), ring_steps(4, 8, 9), ring_steps(4, 8, 10), ring_steps(4, 8, 1)
    (4, 2, 3, 1)
    """
    steps = 1
    while steps < cp_size and (window is None or (steps - 1) * block + 1 < window):
        steps += 1
    return steps


class _RingAttention(torch.autograd.Function):
    """Ring attention with a document-causal mask; tensors are grouped [B, Hkv, G, T, D] for queries.

    Block j is the kv slice that started on ring rank j; at step s rank r holds block (r - s) mod cp.
    Contiguous slicing makes blocks j > r invisible (keys after every query), so they are skipped;
    with a window, so are the steps past :func:`ring_steps` (every block there is out of reach).
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, cp: CPContext, window: int | None):  # noqa: ANN001, ANN205
        b, h, tl, d = q.shape
        hkv = k.shape[1]
        scale = 1.0 / math.sqrt(d)
        total = tl * cp.size
        qg = q.float().reshape(b, hkv, h // hkv, tl, d)
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), device=q.device)
        ring = _RingShift(cp)
        kv = [k.contiguous(), v.contiguous()]
        steps = ring_steps(cp.size, tl, window)
        for step in range(steps):
            pending = ring.start(kv) if step < steps - 1 else None  # overlap the shift with compute
            j = (cp.rank - step) % cp.size
            if j <= cp.rank:
                mask = document_causal_mask(cu_seqlens, cp.rank * tl, tl, j * tl, tl, total, window)
                s = _scores(qg, kv[0].float(), mask, scale)
                blk_lse = torch.logsumexp(s, dim=-1)
                p = torch.exp(s - _safe(blk_lse)[..., None])
                blk_out = torch.matmul(p, kv[1].float()[:, :, None])
                new_lse = torch.logaddexp(lse, blk_lse)
                safe_new = _safe(new_lse)[..., None]
                out = out * torch.exp(lse[..., None] - safe_new) + blk_out * torch.exp(blk_lse[..., None] - safe_new)
                lse = new_lse
            if pending is not None:
                kv = _RingShift.finish(pending)
        ctx.save_for_backward(q, k, v, cu_seqlens, out, lse)
        ctx.cp, ctx.window = cp, window
        return out.reshape(b, h, tl, d).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, k, v, cu_seqlens, out, lse = ctx.saved_tensors
        cp: CPContext = ctx.cp
        b, h, tl, d = q.shape
        hkv = k.shape[1]
        scale = 1.0 / math.sqrt(d)
        total = tl * cp.size
        qg = q.float().reshape(b, hkv, h // hkv, tl, d)
        doutg = dout.float().reshape(qg.shape)
        delta = (doutg * out).sum(-1, keepdim=True)  # rowsum(dO * O), the softmax Jacobian term
        dq = torch.zeros_like(qg)
        ring = _RingShift(cp)
        # Blocks travel with their gradient accumulators; the gradients then go home (below).
        kv = [k.contiguous(), v.contiguous(), torch.zeros_like(k, dtype=torch.float32),
              torch.zeros_like(v, dtype=torch.float32)]
        steps = ring_steps(cp.size, tl, ctx.window)
        for step in range(steps):
            j = (cp.rank - step) % cp.size
            if j <= cp.rank:
                kb, vb, dk, dv = kv
                mask = document_causal_mask(cu_seqlens, cp.rank * tl, tl, j * tl, tl, total, ctx.window)
                s = _scores(qg, kb.float(), mask, scale)
                p = torch.exp(s - _safe(lse)[..., None])
                dv = dv + torch.matmul(p.transpose(-1, -2), doutg).sum(2)
                dp = torch.matmul(doutg, vb.float()[:, :, None].transpose(-1, -2))
                ds = p * (dp - delta) * scale
                dq = dq + torch.matmul(ds, kb.float()[:, :, None])
                dk = dk + torch.matmul(ds.transpose(-1, -2), qg).sum(2)
                kv = [kb, vb, dk, dv]
            if step < steps - 1:
                kv = _RingShift.finish(ring.start(kv))
        # The gradients held here belong to the block from steps - 1 ranks back: send them home in one
        # hop (the ring's next rank when steps == cp; nowhere when steps == 1).
        dk, dv = kv[2:]
        back = (1 - steps) % cp.size
        if back:
            dk, dv = _RingShift.finish(_RingShift(cp, back).start([dk, dv]))
        return (dq.reshape(b, h, tl, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: "torch.Tensor | Documents",
                   cp: CPContext, window: int | None = None) -> torch.Tensor:
    # The ring computes scores, softmax statistics (lse) and the merge in fp32 whatever q's dtype
    # (bf16 included) and returns q's dtype; autocast would put its matmuls back in bf16. It needs
    # the softmax statistics of every block to merge them, so it keeps its own blockwise math.
    cu = as_documents(cu_seqlens, q.shape[2] * cp.size).cu
    with torch.autocast(q.device.type, enabled=False):
        return _RingAttention.apply(q, k, v, cu, cp, window)


# ---- entry point -----------------------------------------------------------------------------------------
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: "torch.Tensor | Documents",
           cp: CPContext | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention within each packed document, nothing across documents.

    q [B, H, T_local, D]; k, v [B, Hkv, T_local, D] with H a multiple of Hkv (grouped-query);
    ``cu_seqlens`` [n_docs + 1] are the boundaries in the whole (global) row, as a tensor or as the
    row's :class:`~flexmesh.runtime.model.attention_kernels.Documents` (which every layer shares). Without ``cp``,
    T_local is the whole row. ``window``: query i sees keys j with i - window < j <= i of its
    document (transformers' sliding window); None: every earlier key. Returns [B, H, T_local, D].
    """
    _check_shapes(q, k, v)
    if window is not None and window <= 0:
        raise ValueError(f"attention window must be positive or None, got {window}")
    if cp is None or cp.size == 1:
        return local_attention(q, k, v, cu_seqlens, window)
    if cp.kind == "ulysses":
        return ulysses_attention(q, k, v, cu_seqlens, cp, window)
    return ring_attention(q, k, v, cu_seqlens, cp, window)
