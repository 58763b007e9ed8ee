"""What one transformer layer asks of a device, whatever runs it (a training step or an inference iteration):
the shapes of its matmuls and the elements its pointwise operators move per token.

Training pricing (``flexmesh.cost.training.analytic``) and inference pricing (``flexmesh.cost.inference``)
both price a layer from these; each adds what its own passes do (backward, recomputation; KV reads).
"""

from __future__ import annotations

from typing import NamedTuple

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
