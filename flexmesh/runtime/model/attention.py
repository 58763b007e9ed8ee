"""Attention over packed documents: the model's entry point, ``attend``, over the row this rank holds.

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
flexmesh.runtime.model.attention_kernels. A micro-batch holding a piece of a cut document attends over
the keys and values carried from earlier micro-batches too (flexmesh.runtime.model.carry).

No process group is known here. Every attention layer calls a core of the :class:`AttentionCore`
signature (``Attention.core``, flexmesh.runtime.model.transformer), :func:`attend` unless parallelism
installs another: context parallelism (Ulysses, ring) wraps this entry point from outside, as
torchtitan applies it (flexmesh.runtime.parallel.context).
"""

from __future__ import annotations

from typing import Protocol

import torch

from flexmesh.runtime.model.attention_kernels import (  # noqa: F401 - re-exported: the names callers know
    Documents,
    as_documents,
    check_shapes,
    document_ids,
    flash_window_size,
    local_attention,
    repeat_kv,
    window_causal,
)
from flexmesh.runtime.model.carry import CarryView, carried_attend


class AttentionCore(Protocol):
    """What an attention layer calls for softmax(QK^T)V: q [B, H, T, D], k, v [B, Hkv, T, D] of this rank's
    tokens, the row's documents, the layer's window, the micro-batch's carried keys and values (None
    without a cut document) and the layer's index (the carry's key). :func:`attend` is one."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: "torch.Tensor | Documents",
                 window: int | None = None, carry: CarryView | None = None, layer: int = 0) -> torch.Tensor: ...


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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: "torch.Tensor | Documents",
           window: int | None = None, carry: CarryView | None = None, layer: int = 0) -> torch.Tensor:
    """Causal attention within each packed document, nothing across documents, over the whole row.

    q [B, H, T, D]; k, v [B, Hkv, T, D] with H a multiple of Hkv (grouped-query); ``cu_seqlens``
    [n_docs + 1] are the row's boundaries, as a tensor or as the row's
    :class:`~flexmesh.runtime.model.attention_kernels.Documents` (which every layer shares). ``window``:
    query i sees keys j with i - window < j <= i of its document (transformers' sliding window); None:
    every earlier key. ``carry``: the micro-batch's view of carried keys and values, read and extended at
    ``layer`` (flexmesh.runtime.model.carry). Returns [B, H, T, D].
    """
    check_shapes(q, k, v)
    if window is not None and window <= 0:
        raise ValueError(f"attention window must be positive or None, got {window}")
    if carry is not None:
        return carried_attend(q, k, v, cu_seqlens, window, carry, layer)
    return local_attention(q, k, v, cu_seqlens, window)
