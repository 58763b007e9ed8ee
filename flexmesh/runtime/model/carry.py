"""Keys and values carried between micro-batches, so that a cut document trains as the whole one.

A step schedule may cut a document into pieces that run in different micro-batches of one group
(the ``chunked`` policy's slices; flexmesh.layout.step). Queries of a later piece ``[a, b)`` must
see the keys and values of tokens ``[0, a)``, computed by earlier micro-batches, and the loss of
the later piece must send gradient back into them. As in TeraPipe and InfiniPipe:

- forward: every attention layer keeps the keys and values (after RoPE, with their autograd graph)
  of a piece that a later piece continues, in a per-step store keyed by (document, layer); the
  later piece attends to ``[kept prefix ; its own keys]`` with its queries at document positions
  ``a .. b - 1`` (packing already gives them those positions for RoPE);
- backward, without pipelining: the trainer runs the forwards of every micro-batch of a *chain*
  (micro-batches linked by a cut document) and then one backward of their summed loss, so the
  gradient reaching a kept prefix flows on into the earlier micro-batch's graph
  (flexmesh.layout.pipeline_order.chain_plan);
- backward, under a pipeline (``KVCarry(detached=True)``): every micro-batch runs its own backward,
  so the graphs stay apart. The store keeps a *detached* copy of the kept keys and values (a leaf
  that collects the gradient later pieces send it), and the earlier piece's own keys and values pass
  through :class:`_HandBack`, an identity whose backward adds that collected gradient. The pipeline
  runs a unit's backwards in reverse (flexmesh.layout.pipeline_order), so a piece's backward starts
  when every later piece has handed back its share. Two segments of one document in one micro-batch
  share one graph: the later reads the earlier's attached tensors.

Work: queries ``[a, b)`` over keys ``[0, b)``, causal, are ``b^2 - a^2`` squared tokens
(flexmesh.cost.training.work.attention_sq charges exactly that).

Context parallelism wraps this from outside (flexmesh.runtime.parallel.context): under Ulysses each
rank holds all tokens of its heads after the all-to-all, so it keeps and reads its heads' prefix
(:func:`carried_attend` on the heads); under ring attention a micro-batch touching a carried document
all-gathers the row's keys and values over the group instead of passing them round the ring, and
every rank keeps the whole prefix for its own queries (:func:`prefix_attention` with the rank's query
offset). Activation checkpointing recomputes a layer in backward: a view remembers the prefix it read
the first time, so the recomputation reads the same tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flexmesh.errors import ScheduleError
from flexmesh.layout.step import Piece
from flexmesh.runtime.model.attention_kernels import Documents, as_documents, check_shapes, suffix_attention


class KVCarry:
    """The step's store: (seq_id, layer) -> (keys, values) of the document's tokens ``[0, end)``;
    ``detached``: keep leaves that collect later pieces' gradients (module doc: under a pipeline)."""

    def __init__(self, detached: bool = False) -> None:
        self.detached = detached
        self._kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def view(self, segments: Sequence[Piece], keep: frozenset[tuple[int, int]]) -> CarryView:
        """One micro-batch's view: its row's ``segments`` and which of them (seq_id, start) to keep."""
        return CarryView(self, tuple(segments), keep)

    def clear(self) -> None:
        self._kv.clear()

    def __len__(self) -> int:
        return len(self._kv)


class CarryView:
    """What attention reads (a segment's prefix) and writes (a kept segment's keys) in one micro-batch."""

    def __init__(self, store: KVCarry, segments: tuple[Piece, ...], keep: frozenset[tuple[int, int]]):
        self.store, self.segments, self.keep = store, segments, keep
        self._read: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # detached store: what this micro-batch put, attached, per (seq_id, layer) and per (seq_id, start, layer)
        self._own: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._put: dict[tuple[int, int, int], _Kept] = {}

    def prefix(self, piece: Piece, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values of tokens ``[0, piece.start)`` at ``layer``; the same tensors on every call."""
        if piece.start == 0:
            return None
        key = (piece.seq_id, piece.start, layer)
        if key not in self._read:
            kv = self._own.get((piece.seq_id, layer)) or self.store._kv.get((piece.seq_id, layer))
            if kv is None or kv[0].shape[2] != piece.start:
                held = 0 if kv is None else kv[0].shape[2]
                raise ScheduleError(f"document {piece.seq_id}: piece [{piece.start}, {piece.end}) needs the keys of "
                                    f"tokens [0, {piece.start}) but {held} are carried; run its pieces in order")
            self._read[key] = kv
        return self._read[key]

    def put(self, piece: Piece, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep ``k``, ``v`` (tokens ``[0, piece.end)``) when a later piece continues the document;
        returns the keys and values this piece's attention must use (in a detached store, the ones
        whose backward adds the gradient later pieces hand back)."""
        if (piece.seq_id, piece.start) not in self.keep:
            return k, v
        if not self.store.detached:
            self.store._kv[(piece.seq_id, layer)] = (k, v)
            return k, v
        key = (piece.seq_id, piece.start, layer)
        if key not in self._put:  # a recomputation (activation checkpointing) keeps the first leaves
            self._put[key] = _Kept(piece, k, v)
            self.store._kv[(piece.seq_id, layer)] = (self._put[key].k, self._put[key].v)
        if k.requires_grad or v.requires_grad:
            k, v = _HandBack.apply(k, v, self._put[key])
        self._own[(piece.seq_id, layer)] = (k, v)
        return k, v


class _Kept:
    """A kept piece's keys and values as detached leaves, and whether its backward has taken their
    gradient: a later piece whose backward comes after that would be lost, so it raises instead."""

    def __init__(self, piece: Piece, k: torch.Tensor, v: torch.Tensor):
        self.piece, self.taken = piece, False
        self.k = k.detach().requires_grad_(k.requires_grad)
        self.v = v.detach().requires_grad_(v.requires_grad)
        for leaf in (self.k, self.v):
            if leaf.requires_grad:
                leaf.register_hook(self._check)

    def _check(self, grad: torch.Tensor) -> torch.Tensor:
        if self.taken:
            p = self.piece
            raise ScheduleError(f"document {p.seq_id}: piece [{p.start}, {p.end}) ran its backward before a later "
                                "piece's; run the backwards of a cut document's pieces in reverse")
        return grad


class _HandBack(torch.autograd.Function):
    """Identity on a kept piece's keys and values; backward adds the gradient that later pieces left
    on the store's detached leaves (``kept``), then frees it."""

    @staticmethod
    def forward(ctx, k, v, kept: _Kept):  # noqa: ANN001, ANN205
        ctx.kept = kept
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gk, gv):  # noqa: ANN001, ANN205
        kept: _Kept = ctx.kept
        kept.taken = True
        if kept.k.grad is not None:
            gk, kept.k.grad = gk + kept.k.grad, None
        if kept.v.grad is not None:
            gv, kept.v.grad = gv + kept.v.grad, None
        return gk, gv, None


# ---- attention over a carried prefix -----------------------------------------------------------------
def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, q_off: int,
                     window: int | None, view: CarryView, layer: int) -> torch.Tensor:
    """Queries of row tokens ``[q_off, q_off + Tq)`` over the whole row's ``k``, ``v`` plus carried prefixes.

    Segments are processed in row order, so a document's second segment in the same row sees the
    first (kept, then read). The boundaries are read on the host (``docs.bounds``).
    """
    t, tq = k.shape[2], q.shape[2]
    cuts = [0, *sorted({x for x in docs.bounds if 0 < x < t}), t]
    outs = []
    # split, not slices: each slice's backward would write into a zero tensor of the whole row
    sizes = [b - a for a, b in zip(cuts[:-1], cuts[1:])]
    for s, (a, b, ks, vs) in enumerate(zip(cuts[:-1], cuts[1:], k.split(sizes, dim=2), v.split(sizes, dim=2))):
        piece = view.segments[s] if s < len(view.segments) else None  # None: padding
        start = 0
        if piece is not None:
            start = piece.start
            pre = view.prefix(piece, layer)
            if pre is not None:
                ks, vs = torch.cat([pre[0], ks], dim=2), torch.cat([pre[1], vs], dim=2)
            ks, vs = view.put(piece, layer, ks, vs)
        qa, qb = max(a, q_off), min(b, q_off + tq)
        if qa < qb:  # query row token i is token start + (i - a) of its document; key j is token j
            first = start + qa - a
            outs.append(suffix_attention(q[:, :, qa - q_off:qb - q_off], ks[:, :, :first + qb - qa],
                                         vs[:, :, :first + qb - qa], window))
    return torch.cat(outs, dim=2)


def carried_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: "torch.Tensor | Documents",
                   window: int | None, view: CarryView, layer: int) -> torch.Tensor:
    """Attention of a micro-batch holding carried documents, over this rank's whole row (module doc):
    what :func:`flexmesh.runtime.model.attention.attend` runs when given a carry view."""
    check_shapes(q, k, v)
    return prefix_attention(q, k, v, as_documents(cu_seqlens, q.shape[2]), 0, window, view, layer)
