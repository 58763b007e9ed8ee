"""Context parallelism, applied to a plain model from outside: Ulysses and ring attention over packed
documents, installed in every attention layer, their process groups switched every step.

The model's attention layers call a core (``Attention.core``, flexmesh.runtime.model.transformer): by
default :func:`flexmesh.runtime.model.attention.attend`, the local entry point over the row a rank
holds. :func:`apply_context_parallel` installs one :class:`ContextParallelAttention` in every layer of
a model (chunk), which wraps that entry point with the collectives of its current group
(:class:`CPContext`); the trainer switches the group each step to the one the step schedule gives the
rank (:meth:`ContextGroups.use`, from a pool of process groups made once). This is torchtitan's split:
the model stays plain PyTorch, parallelism is applied to it, and PyTorch's own ``context_parallel`` is
not used because it needs CUDA and knows no document masks.

Each rank of a group holds a contiguous 1/cp slice of the row while ``cu_seqlens`` stays global.

- Ulysses: an all-to-all turns (all heads, my tokens) into (my heads, all tokens), runs the local entry
  point on the whole row, and turns the result back. Needs the query heads per tp rank divisible by
  cp; when the key/value heads are not, they are repeated to one per query head before the exchange.
  A cut document's carried keys and values are kept per head (each rank keeps its heads' prefix).
- Ring: K/V blocks travel around the ring (batched isend/irecv, overlapped with the block's compute);
  each rank merges the blockwise attention of its queries with every block by log-sum-exp. The
  backward runs the ring again, carrying dK/dV with their blocks until they are back home. With a
  window the ring stops after :func:`ring_steps`. A micro-batch holding a carried document instead
  all-gathers the row's keys and values (backward: a reduce-scatter of their gradients), so every rank
  keeps the whole prefix for its own queries (flexmesh.runtime.model.carry.prefix_attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flexmesh.errors import PlanError, ScheduleError
from flexmesh.layout.mesh import Layout, aligned_blocks, context_kind, global_rank, group_cp_kind
from flexmesh.runtime.model.attention import Documents, as_documents, attend, check_shapes, document_causal_mask
from flexmesh.runtime.model.carry import CarryView, prefix_attention
from flexmesh.runtime.model.transformer import Transformer, blocks
from flexmesh.spec.model import ModelSpec


@dataclass(frozen=True)
class CPContext:
    """A context-parallel group as attention sees it: ``rank`` of ``size`` in ``group``."""

    kind: str  # "ulysses" | "ring"
    group: Any  # a torch.distributed ProcessGroup
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.kind not in ("ulysses", "ring"):
            raise PlanError(f"context-parallel kind must be 'ulysses' or 'ring', got {self.kind!r}")
        if not 0 <= self.rank < self.size:
            raise PlanError(f"context-parallel rank {self.rank} is outside a group of {self.size}")


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


def seq_to_heads(x: torch.Tensor, cp: CPContext) -> torch.Tensor:
    """[B, H, T/cp, D] (all heads, my tokens) -> [B, H/cp, T, D] (my heads, all tokens)."""
    b, h, tl, d = x.shape
    chunks = x.reshape(b, cp.size, h // cp.size, tl, d).permute(1, 0, 2, 3, 4).contiguous()
    got = _all_to_all(chunks, cp)  # got[j]: my heads of rank j's tokens
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp.size, cp.size * tl, d)


def heads_to_seq(x: torch.Tensor, cp: CPContext) -> torch.Tensor:
    """[B, H/cp, T, D] -> [B, H, T/cp, D], the inverse of :func:`seq_to_heads`."""
    b, hc, t, d = x.shape
    tl = t // cp.size
    chunks = x.reshape(b, hc, cp.size, tl, d).permute(2, 0, 1, 3, 4).contiguous()
    got = _all_to_all(chunks, cp)  # got[j]: rank j's heads of my tokens
    return got.permute(1, 0, 2, 3, 4).reshape(b, cp.size * hc, tl, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, cp: CPContext,
                      window: int | None = None, carry: CarryView | None = None, layer: int = 0) -> torch.Tensor:
    h, hkv = q.shape[1], k.shape[1]
    if h % cp.size:
        raise PlanError(f"Ulysses context parallelism of degree {cp.size} needs the {h} query heads per "
                        "tensor-parallel rank to divide evenly; lower cp or tp, or use ring attention")
    if hkv % cp.size:  # too few key/value heads to split: give every query head its own copy
        k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    out = attend(seq_to_heads(q, cp), seq_to_heads(k, cp), seq_to_heads(v, cp), docs, window, carry, layer)
    return heads_to_seq(out, cp)


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


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, cp: CPContext,
                   window: int | None = None) -> torch.Tensor:
    # The ring computes scores, softmax statistics (lse) and the merge in fp32 whatever q's dtype
    # (bf16 included) and returns q's dtype; autocast would put its matmuls back in bf16. It needs
    # the softmax statistics of every block to merge them, so it keeps its own blockwise math.
    with torch.autocast(q.device.type, enabled=False):
        return _RingAttention.apply(q, k, v, docs.cu, cp, window)


class _GatherSeq(torch.autograd.Function):
    """All-gather along the token dim (2) over the context-parallel group; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, cp: CPContext):  # noqa: ANN001, ANN205
        ctx.cp = cp
        b, h, tl, d = x.shape
        parts = torch.empty((cp.size * b, h, tl, d), dtype=x.dtype, device=x.device)  # ranks stacked on dim 0
        dist.all_gather_into_tensor(parts, x.contiguous(), group=cp.group)
        return parts.view(cp.size, b, h, tl, d).permute(1, 2, 0, 3, 4).reshape(b, h, cp.size * tl, d)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        cp: CPContext = ctx.cp
        b, h, t, d = grad.shape
        tl = t // cp.size
        blocks = grad.reshape(b, h, cp.size, tl, d).permute(2, 0, 1, 3, 4).reshape(cp.size * b, h, tl, d)
        out = torch.empty((b, h, tl, d), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, blocks, group=cp.group)  # every rank's queries read my block: sum
        return out, None


# ---- entry point -----------------------------------------------------------------------------------------
def context_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: "torch.Tensor | Documents",
                   cp: CPContext | None, window: int | None = None, carry: CarryView | None = None,
                   layer: int = 0) -> torch.Tensor:
    """:func:`flexmesh.runtime.model.attention.attend` over context-parallel group ``cp`` (None or one
    rank: the local entry point itself). q [B, H, T/cp, D], k, v [B, Hkv, T/cp, D]: this rank's
    contiguous slice of the row; ``cu_seqlens``: the whole row's boundaries. Returns [B, H, T/cp, D]."""
    if cp is None or cp.size == 1:
        return attend(q, k, v, cu_seqlens, window, carry, layer)
    check_shapes(q, k, v)
    if window is not None and window <= 0:
        raise ValueError(f"attention window must be positive or None, got {window}")
    docs = as_documents(cu_seqlens, q.shape[2] * cp.size)
    if cp.kind == "ulysses":
        return ulysses_attention(q, k, v, docs, cp, window, carry, layer)
    if carry is None:
        return ring_attention(q, k, v, docs, cp, window)
    return prefix_attention(q, _GatherSeq.apply(k, cp), _GatherSeq.apply(v, cp), docs, cp.rank * q.shape[2],
                            window, carry, layer)


class ContextParallelAttention:
    """The attention core (flexmesh.runtime.model.attention.AttentionCore) of every layer of a model under
    context parallelism: :func:`context_attend` over ``cp``, the group of the step (None: local)."""

    def __init__(self, cp: CPContext | None = None) -> None:
        self.cp = cp

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: "torch.Tensor | Documents",
                 window: int | None = None, carry: CarryView | None = None, layer: int = 0) -> torch.Tensor:
        return context_attend(q, k, v, cu_seqlens, self.cp, window, carry, layer)


def apply_context_parallel(model: Transformer, attention: ContextParallelAttention | None = None
                           ) -> ContextParallelAttention:
    """Install ``attention`` (default: a new one, over no group until its ``cp`` is set) as the attention
    core of every layer of ``model`` (a Transformer or a pipeline stage of one); returns it."""
    core = attention if attention is not None else ContextParallelAttention()
    for block in blocks(model).values():
        block.attention.core = core
    return core


# ---- context-parallel groups, chosen per step --------------------------------------------------------
class ContextGroups:
    """The pool of context-parallel process groups of one replica group, one per aligned block of data
    ranks, and the attention it switches between them every step.

    For each pipeline stage and tp index of one replica group (its ``ranks``, in the rank order of
    :func:`global_rank`), every :func:`aligned_blocks` run of data ranks gets a process group of the
    global ranks holding them; all ranks create every group's pool in the same order
    (``dist.new_group`` is collective), once, when the trainer starts, and keep their own (``pp_index``
    and ``tp_index`` None: a rank of another group). :meth:`apply` installs the pool's attention in a
    model chunk; each step :meth:`use` points it at this rank's :class:`CPContext` of the step's
    schedule group (None for a group of one rank: no context parallelism).

    A group whose size does not divide the query heads per tp rank runs ring attention even when
    the run's kind (:func:`context_kind`) is Ulysses, which would need that division.
    """

    def __init__(self, layout: Layout, spec: ModelSpec, ranks: tuple[int, ...], pp_index: int | None,
                 tp_index: int | None) -> None:
        self.layout = layout
        self.kind = context_kind(spec, layout)
        self.heads = spec.num_heads // layout.tp
        self.attention = ContextParallelAttention()
        self._groups: dict[tuple[int, int], Any] = {}
        for p in range(layout.pp):
            for t in range(layout.tp):
                for start, size in aligned_blocks(layout.data_ranks):
                    group = dist.new_group([ranks[global_rank(layout, p, d, t)] for d in range(start, start + size)])
                    if (p, t) == (pp_index, tp_index):
                        self._groups[(start, size)] = group

    def check(self, ranks: tuple[int, ...]) -> None:
        """Raise ScheduleError unless ``ranks`` (data ranks) is an aligned power-of-two run."""
        size, start = len(ranks), ranks[0] if ranks else 0
        n = self.layout.data_ranks
        ok = (size >= 1 and size & (size - 1) == 0 and start % size == 0 and start + size <= n
              and list(ranks) == list(range(start, start + size)))
        if not ok:
            if size < 1 or size & (size - 1):
                why = f"{size} ranks is not a power of two"
            elif list(ranks) != list(range(start, start + size)):
                why = "the ranks are not consecutive"
            elif start + size > n:
                why = f"it reaches past the last data rank {n - 1}"
            else:
                why = f"a group of {size} must start at a multiple of {size}, not at {start}"
            raise ScheduleError(
                f"schedule group of data ranks {list(ranks)} cannot run: {why}. The runtime keeps context-parallel "
                f"groups for runs of 1, 2, 4, ... consecutive data ranks (of {n}) starting at a multiple of their "
                "size; place the step's groups with flexmesh.schedule.assemble.aligned_layout")

    def kind_for(self, size: int) -> str:
        """The attention a group of ``size`` ranks runs: the one rule the scheduler prices with too."""
        return str(group_cp_kind(self.kind, self.heads, size))

    def context(self, ranks: tuple[int, ...], data_rank: int) -> CPContext | None:
        """This rank's CPContext in schedule group ``ranks`` (which must hold ``data_rank``); None for one rank."""
        self.check(ranks)
        if len(ranks) == 1:
            return None
        start, size = ranks[0], len(ranks)
        return CPContext(kind=self.kind_for(size), group=self._groups[(start, size)], rank=data_rank - start,
                         size=size)

    def apply(self, model: Transformer) -> None:
        """Make the pool's attention the core of every attention layer of ``model`` (a model chunk)."""
        apply_context_parallel(model, self.attention)

    def use(self, ranks: tuple[int, ...], data_rank: int) -> None:
        """Run this step's attention over this rank's group among the schedule group ``ranks``."""
        self.attention.cp = self.context(ranks, data_rank)
