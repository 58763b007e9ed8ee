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

Kernels: on CPU (and for fp32 on GPU without FlexAttention) causal SDPA document by document (cost
sum(len^2), as a varlen kernel; no mask kept); on GPU flash-attn's varlen kernel when installed and
the dtype is fp16/bf16, else FlexAttention with a
document mask. Only the CPU path is exercised by the test suite (no GPU in CI).

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
import torch.nn.functional as F

from flexmesh.errors import PlanError

try:  # optional GPU kernel
    from flash_attn import flash_attn_varlen_func as _flash_varlen
except ImportError:  # pragma: no cover - depends on the machine
    _flash_varlen = None


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
def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Document index of each of ``total`` tokens; tokens past ``cu_seqlens[-1]`` get one extra id.

    >>> document_ids(torch.tensor([0, 3, 5]), 6).tolist()
    [0, 0, 0, 1, 1, 2]
    """
    idx = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64).contiguous(), idx, right=True)


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


def window_causal(qi: torch.Tensor, ki: torch.Tensor, window: int | None) -> torch.Tensor:
    """Whether query position ``qi`` sees key position ``ki``: ``ki <= qi`` and, with a window, ``qi - ki < window``.

    >>> window_causal(torch.tensor([[4]]), torch.arange(6)[None], 2).int().tolist()
    [[0, 0, 0, 1, 1, 0]]
    """
    seen = ki <= qi
    return seen if window is None else seen & (qi - ki < window)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"attend expects q [B, H, T, D] and k, v [B, Hkv, T, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise PlanError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads; "
                        "tensor parallelism must split both head counts by the same degree")


# ---- local kernels -----------------------------------------------------------------------------------
# Query block of the windowed CPU kernel: a block of b queries reads b + w - 1 keys, so blocks of at
# least a few hundred keep the number of SDPA calls small while the cost stays O(len * (b + w)).
WINDOW_BLOCK = 256


def _sdpa_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal SDPA over one document; longer than ``window``, query block by query block.

    A block of queries [a, b) needs keys [a - w + 1, b) only, so a long document costs about
    len * (block + w) instead of len^2, and the explicit mask is block x (block + w - 1).
    """
    n = q.shape[2]
    if window is None or n <= window:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    step = max(window, WINDOW_BLOCK)
    outs = []
    for a in range(0, n, step):
        b, lo = min(a + step, n), max(0, a - window + 1)
        qi = torch.arange(a, b, device=q.device)[:, None]
        mask = window_causal(qi, torch.arange(lo, b, device=q.device)[None, :], window)
        outs.append(F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, lo:b], v[:, :, lo:b], attn_mask=mask))
    return torch.cat(outs, dim=2)


def _local_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
    """Causal SDPA document by document, so the cost is sum(len^2), as a varlen kernel's.

    One SDPA over the whole packed row with a block-diagonal mask would cost row^2 however short
    its documents are, and keep a row^2 mask per layer for backward. Tokens after ``cu_seqlens[-1]``
    (padding) attend among themselves, as one more document.
    """
    t = q.shape[2]
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # GQA: each key/value head serves `groups` consecutive query heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    bounds = [int(x) for x in cu_seqlens.tolist() if 0 < int(x) < t]
    cuts = [0, *sorted(set(bounds)), t]
    if len(cuts) == 2:
        return _sdpa_document(q, k, v, window)
    # split, not one slice per document: a slice's backward writes its gradient into a zero tensor
    # of the whole row, so n documents would cost n x row in backward; split's backward is one cat.
    sizes = [b - a for a, b in zip(cuts[:-1], cuts[1:])]
    return torch.cat([_sdpa_document(qi, ki, vi, window)
                      for qi, ki, vi in zip(q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2))],
                     dim=2)


def flash_window_size(window: int | None) -> tuple[int, int]:
    """flash-attn's ``window_size`` (keys left, keys right of the query; -1 unbounded) for ``window``.

    >>> flash_window_size(None), flash_window_size(4)
    ((-1, -1), (3, 0))
    """
    return (-1, -1) if window is None else (window - 1, 0)


def _local_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                 window: int | None = None) -> torch.Tensor:
    b, h, t, d = q.shape
    cu = cu_seqlens.to(torch.int32)
    if int(cu[-1]) < t:  # the trailing padding becomes its own document
        cu = torch.cat([cu, cu.new_tensor([t])])
    # Rows of a batch are laid end to end; every row has the same boundaries.
    cu = torch.cat([cu[:-1] + i * t for i in range(b)] + [cu.new_tensor([b * t])])
    max_len = int((cu[1:] - cu[:-1]).max())

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(b * t, x.shape[1], d)

    out = _flash_varlen(flat(q), flat(k), flat(v), cu, cu, max_len, max_len, causal=True,
                        window_size=flash_window_size(window))
    return out.view(b, t, h, d).transpose(1, 2)


_compiled_flex = None


def _local_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
    global _compiled_flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _compiled_flex is None:  # compiled once: the eager FlexAttention materialises the full scores
        _compiled_flex = torch.compile(flex_attention)
    t = q.shape[2]
    doc = document_ids(cu_seqlens, t)

    def mask_mod(b, h, qi, ki):  # noqa: ANN001 - FlexAttention's callback signature
        return (doc[qi] == doc[ki]) & window_causal(qi, ki, window)

    block_mask = create_block_mask(mask_mod, None, None, t, t, device=q.device)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                    window: int | None = None) -> torch.Tensor:
    """Document-causal attention of a whole row held by this rank (see the module doc for kernels)."""
    if q.is_cuda:
        if _flash_varlen is not None and q.dtype in (torch.float16, torch.bfloat16):
            return _local_flash(q, k, v, cu_seqlens, window)
        if _has_flex():
            return _local_flex(q, k, v, cu_seqlens, window)
    return _local_sdpa(q, k, v, cu_seqlens, window)


def _has_flex() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:  # pragma: no cover
        return False
    return True


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


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
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


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                   cp: CPContext, window: int | None = None) -> torch.Tensor:
    # The ring computes scores, softmax statistics (lse) and the merge in fp32 whatever q's dtype
    # (bf16 included) and returns q's dtype; autocast would put its matmuls back in bf16.
    with torch.autocast(q.device.type, enabled=False):
        return _RingAttention.apply(q, k, v, cu_seqlens, cp, window)


# ---- entry point -----------------------------------------------------------------------------------------
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
           cp: CPContext | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention within each packed document, nothing across documents.

    q [B, H, T_local, D]; k, v [B, Hkv, T_local, D] with H a multiple of Hkv (grouped-query);
    ``cu_seqlens`` [n_docs + 1] are the boundaries in the whole (global) row. Without ``cp``,
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
