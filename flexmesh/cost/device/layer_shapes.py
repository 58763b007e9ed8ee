"""What one transformer layer asks of a device, whatever runs it (a training step or an inference iteration):
the shapes of its matmuls and the elements its pointwise operators move per token.

Training pricing (``flexmesh.cost.training.analytic``) and inference pricing (``flexmesh.cost.inference``)
both price a layer from these; each adds what its own passes do (backward, recomputation; KV reads).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from flexmesh.spec.model import ModelSpec


def linear_shapes(model: ModelSpec, tp: int) -> tuple[tuple[float, float], ...]:
    """(columns, reduction) of each matmul of one layer on one of ``tp`` devices: QKV, attention
    output, MLP up (and gate, one GEMM for SwiGLU), MLP down. Rows are the tokens.

    >>> from flexmesh.spec import MODEL_PRESETS
    >>> linear_shapes(MODEL_PRESETS["llama2-7b"], 2)
    ((6144.0, 4096), (4096, 2048.0), (11008.0, 4096), (4096, 5504.0))
    """
    h = model.hidden
    up = (2 if model.activation == "swiglu" else 1) * model.ffn_hidden
    return (((model.q_dim + 2 * model.kv_dim) / tp, h), (h, model.q_dim / tp), (up / tp, h),
            (h, model.ffn_hidden / tp))


class PointwiseElems(NamedTuple):
    """Elements one layer's forward moves per token in its pointwise operators, read and write counted:
    the two norms (``norms``, over the hidden size: every tensor-parallel rank runs them whole), rotary on q
    and k (``rotary``) and the MLP activation (``activation``), the last two split by tensor parallelism."""

    norms: int
    rotary: int
    activation: int


def pointwise_elems(model: ModelSpec) -> PointwiseElems:
    """Two norms (read + write h each), rotary on q and k (read + write), activation (SwiGLU: read gate and up,
    write ffn; GeLU: read and write ffn).

    >>> from flexmesh.spec import MODEL_PRESETS
    >>> pointwise_elems(MODEL_PRESETS["llama2-7b"])  # 4h, 2(q + kv), 3 ffn
    PointwiseElems(norms=16384, rotary=16384, activation=33024)
    """
    rotary = 2 * (model.q_dim + model.kv_dim) if model.position == "rope" else 0
    return PointwiseElems(4 * model.hidden, rotary, (3 if model.activation == "swiglu" else 2) * model.ffn_hidden)


def pointwise_elems_per_token(model: ModelSpec) -> tuple[int, int]:
    """(two norms and rotary, the MLP activation): elements those operators of one layer's forward move
    per token (before dividing by tp x cp), the part of
    :func:`flexmesh.cost.training.analytic.memory_bytes_per_token` a stack that recomputes its pointwise
    operators moves again in backward (the residual adds need no recomputing).

    >>> from flexmesh.spec import MODEL_PRESETS
    >>> pointwise_elems_per_token(MODEL_PRESETS["llama2-7b"])  # (4h + 2(q + kv), 3 ffn)
    (32768, 33024)
    """
    p = pointwise_elems(model)
    return p.norms + p.rotary, p.activation


NO_WINDOW: tuple[int | None, ...] = (None,)


def attention_sq(start, end, windows: Sequence[int | None] = NO_WINDOW):  # noqa: ANN001, ANN201 - floats or arrays
    """Causal attention work of queries ``[start, end)`` of one sequence, in squared tokens.

    Squared tokens count ``2 x (query-key pairs) - queries``. Without a window query ``i`` sees
    ``i + 1`` keys, so queries ``[a, b)`` give exactly ``b^2 - a^2`` (``s^2`` for a whole sequence, the
    statistic the attention FLOPs of 2 x q_dim per squared token are written for, 2104.04473). With a
    window ``w`` query ``i`` sees ``min(i + 1, w)`` keys (transformers' sliding window; FLOPs of a
    windowed kernel: each token attends to at most w tokens, Mistral 7B, 2310.06825, section 2): with
    ``m = clip(w, a, b)`` that is ``m^2 - a^2 + (2w - 1)(b - m)``.

    ``windows`` holds one window per layer (None: plain causal); the result is their mean, the work of
    an average layer (exact when all layers share one window). With no window anywhere the result is
    ``end * end - start * start``, bit for bit the statistic used before windows existed.
    Floats or numpy arrays (elementwise).

    >>> attention_sq(0, 10), attention_sq(0, 10, (4,)), attention_sq(6, 10, (4,)), attention_sq(0, 3, (4,))
    (100, 58.0, 28.0, 9.0)
    >>> attention_sq(0, 10, (4, None))  # half the layers slide
    79.0
    """
    if all(w is None for w in windows):  # the common case, asked millions of times: no Counter built
        return end * end - start * start
    counts = Counter(windows)
    parts = []
    for w, n in counts.items():
        if w is None:
            parts.append((n, end * end - start * start))
        else:
            m = np.clip(w, start, end)
            parts.append((n, m * m - start * start + (2 * w - 1) * (end - m)))
    # one window on every layer: its statistic as is, not a mean that could round differently
    total = parts[0][1] if len(parts) == 1 else sum(n * p for n, p in parts) / len(windows)
    return total if np.ndim(total) else float(total)
