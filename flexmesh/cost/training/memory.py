"""Memory a device needs beyond states and saved activations: transient buffers, the allocator, the context.

Each term counts what a framework allocates, tensor by tensor, with its source:

- ZeRO-3: the gathered weights of the running layer and, with prefetching, of the next one
  (FSDP2 issues the next all-gather one module ahead; ZeRO, 1910.02054), plus one all-gather's flat
  output, alive beside the parameters it is split into (FSDP2's ``foreach_all_gather`` and
  ``foreach_all_gather_copy_out``);
- ZeRO-2/3 reducing every micro-batch: the running layer's unsharded gradients and the reduce-scatter
  input packed from them in the gradients' (reduce) dtype, alive together during the packing (FSDP2's
  ``foreach_reduce_scatter_copy_in``);
- tensor (sequence) parallelism without communication overlap: the all-gathered input of the
  column-parallel GEMMs, the full sequence of the tp group, alive while the GEMM runs (Korthikanti et
  al., 2205.05198, section 4.2.2: sequence parallelism gathers before the GEMM);
- with TP communication overlap: TransformerEngine's userbuffers instead, one per overlapped GEMM of a
  ``te.TransformerLayer`` (``initialize_ub`` lists 11: qkv/proj/fc1/fc2 fprop, dgrad, wgrad), each
  of shape (tokens of a micro-batch, hidden), allocated once per process;
- the largest GEMM's backward working set: the gradient of its output, alive while its dgrad and
  wgrad run (the MLP's first GEMM, gate and up for SwiGLU), plus PyTorch's cuBLAS workspace (on
  Hopper 8 chunks of 4 MiB, PyTorch's CUDA semantics notes, "cuBLAS workspaces");
- full recomputation: the layer's full activations while it is recomputed (2104.04473).

The device budget (:meth:`flexmesh.spec.cluster.DeviceSpec.usable_memory_bytes`, the one place) takes
off the CUDA context, which PyTorch's allocator does not see, and divides by ``1 + fragmentation``:
the caching allocator reserves more than the tensors it hands out. :func:`fit_fragmentation` redoes
that fraction from (estimate, measured peak) pairs; docs/cost-model.md says which sources give them.

>>> round(fit_fragmentation([(10.0, 11.5, 0.5), (20.0, 22.5, 0.5)]), 3)
0.1
>>> fit_fragmentation([])  # nothing measured: no fit
"""

from __future__ import annotations

from collections.abc import Iterable

from flexmesh.layout.overlap import Overlap
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec.model import ModelSpec

# PyTorch's default cuBLAS workspace on Hopper: ":4096:8", 8 chunks of 4096 KiB (CUDA semantics notes).
CUBLAS_WORKSPACE_BYTES = 8 * 4096 * 1024
# TransformerEngine initialize_ub: userbuffers for the 11 overlapped GEMMs of a te.TransformerLayer.
TE_USERBUFFERS = 11


def gathered_weight_bytes(model: ModelSpec, s: LayerStrategy, overlap: Overlap) -> float:
    """ZeRO-3's gathered weights of one layer (this tp rank's slice), twice when the next is prefetched,
    and the flat all-gather output they are copied out of."""
    if s.zero != 3:
        return 0.0
    return (3 if overlap.zero3_prefetch else 2) * model.layer_params / s.tp * model.dtype_bytes


def sharded_dp_buffer_bytes(model: ModelSpec, s: LayerStrategy, overlap: Overlap, grad_bytes: float) -> float:
    """Sharded data parallelism's buffers while a layer runs: ZeRO-3's gathered weights, and under a
    reduce-scatter every micro-batch (ZeRO-2/3) the layer's unsharded gradients (the model's dtype) with
    the reduce-scatter input packed from them (``grad_bytes`` per parameter)."""
    reduce = model.layer_params / s.tp * (model.dtype_bytes + grad_bytes) \
        if s.zero >= 2 and s.shard_degree > 1 and overlap.grad_reduce == "bucketed" else 0.0
    return gathered_weight_bytes(model, s, overlap) + reduce


def tp_buffer_bytes(model: ModelSpec, s: LayerStrategy, tokens: float, overlap: Overlap) -> float:
    """Tensor-parallel communication buffers: the gathered GEMM input, or the userbuffers with overlap."""
    if s.tp == 1:
        return 0.0
    gathered = tokens / s.cp * model.hidden * model.dtype_bytes
    return gathered * (TE_USERBUFFERS if overlap.tp_comm else 1)


def gemm_workspace_bytes(model: ModelSpec, s: LayerStrategy, tokens: float) -> float:
    """The largest GEMM's output gradient on this device while its backward runs, plus the cuBLAS workspace."""
    mlp_out = (2 if model.activation == "swiglu" else 1) * model.ffn_hidden
    widest = max(mlp_out, model.q_dim + 2 * model.kv_dim, model.hidden)
    return tokens / s.cp * widest / s.tp * model.dtype_bytes + CUBLAS_WORKSPACE_BYTES


def layer_transient_bytes(model: ModelSpec, s: LayerStrategy, tokens: float, overlap: Overlap,
                          recompute_bytes: float, grad_bytes: float) -> float:
    """Working memory while one layer runs: the terms above, summed (they are alive together)."""
    return (recompute_bytes + sharded_dp_buffer_bytes(model, s, overlap, grad_bytes)
            + tp_buffer_bytes(model, s, tokens, overlap) + gemm_workspace_bytes(model, s, tokens))


def fit_fragmentation(observations: Iterable[tuple[float, float, float]]) -> float | None:
    """Least-squares ``f`` in ``peak = (1 + f) * estimate + context`` over (estimate, peak, context) bytes.

    None without observations. ``estimate`` is the cost model's allocated bytes, ``peak`` the measured
    device peak (nvidia-smi, or ``torch.cuda.max_memory_reserved`` plus the context).
    """
    obs = list(observations)
    if not obs:
        return None
    num = sum(e * (p - c - e) for e, p, c in obs)
    den = sum(e * e for e, _, _ in obs)
    return num / den
