"""Apply a Plan's layout to a plain model: TP + sequence parallel, activation checkpointing, FSDP2.

The order is torchtitan's: context parallelism first (no weight surgery: every attention layer is
given the context-parallel attention of its replica group's pool, whose group the trainer switches
every step to the one the step's schedule gives the rank; flexmesh.runtime.parallel.context), then
tensor parallelism (it turns weights into DTensors on the ``tp`` axis), then per-layer activation
checkpointing (it wraps blocks, after TP so the wrapped block's collectives are recomputed too), then
``torch.compile`` of each block (``--compile``), then FSDP2 per block and finally the root (FSDP must
see the finished modules).

Each replica group of a plan runs on a device mesh of its own (:func:`build_group_meshes`). Supported
per-layer mixes inside a group (checked by :func:`flexmesh.layout.mesh.group_layout`):

- one mesh for the whole group: every layer has the same ``tp``, ``cp``, ``cp_kind`` and ``dp``;
- ``recompute`` (none, selective or full) may vary per layer;
- ZeRO may vary per layer among stages 1, 2 and 3 (FSDP2 shards over the ``dp x cp`` ranks;
  stage 3 re-shards weights after forward, stages 1 and 2 keep them gathered until backward).
  FSDP2 has no separate ZeRO-1 (sharded optimizer with replicated gradients), so ZeRO-1 runs as
  ZeRO-2: same numerics, less gradient memory.
- ZeRO 0 (plain replicated data parallelism) must hold for every layer or for none.

Anything else (a per-layer change of tp or context degree, ZeRO 0 mixed with 1-3) is rejected with
a message naming the layers, because it would need resharding activations between layers.

Precision (docs/precision.md): parameters are always fp32 (the master weights the optimizer
updates). In bf16, where FSDP2 wraps the model (``fully_shard`` or ``replicate`` over more than one
data rank) its :class:`~torch.distributed.fsdp.MixedPrecisionPolicy` gathers bf16 copies for forward
and backward and reduces gradients in fp32; where no data-parallel wrapper exists (one data rank:
one process, tp only, pipeline only) the trainer runs forward under ``torch.autocast`` instead
(:func:`autocast_bf16`), torchtitan's split.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import cache, partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flexmesh.errors import PlanError
from flexmesh.layout.mesh import MESH_AXES, Layout, group_layout
from flexmesh.layout.plan import Plan
from flexmesh.layout.strategy import Recompute
from flexmesh.runtime.model.moe import MoEFeedForward
from flexmesh.runtime.model.transformer import Row, Transformer, TransformerBlock, block_forward, blocks
from flexmesh.runtime.parallel.adapters import shard_adapters
from flexmesh.runtime.parallel.context import ContextGroups
from flexmesh.runtime.parallel.precision import check_dtype
from flexmesh.spec.model import ModelSpec


def check_model_fits_layout(spec: ModelSpec, layout: Layout) -> None:
    """Reject shapes tensor parallelism cannot split, saying what to change."""
    tp = layout.tp
    if tp > 1 and spec.qk_norm and spec.qk_norm_scope == "projection":
        raise PlanError(f"model {spec.name!r} normalises q and k over all heads, which tensor parallelism splits; "
                        "use tp 1")
    if tp == 1:
        return
    bad = [f"{name} {n}" for name, n in (("num_heads", spec.num_heads), ("num_kv_heads", spec.num_kv_heads),
                                          ("ffn_hidden", spec.ffn_hidden)) if n % tp]
    if bad:
        raise PlanError(f"tp {tp} does not divide the model's {', '.join(bad)}; choose a tp that divides them")
    if spec.tie_embeddings:
        raise PlanError(
            f"model {spec.name!r} ties its output to the embedding, which the runtime does not split with "
            "tensor parallelism; use tp 1 or untie the embeddings"
        )


DATA_AXIS = "dp_cp"  # the runtime mesh's data axis: dp x cp ranks, which share weights (FSDP2 shards over it)
RUNTIME_AXES = (MESH_AXES[0], DATA_AXIS, MESH_AXES[-1])  # ("pp", "dp_cp", "tp"), the rank order's


def build_group_meshes(plan: Plan, device_type: str = "cpu") -> list[DeviceMesh]:
    """Every replica group's device mesh (:data:`RUNTIME_AXES`: pipeline rank, data rank, tp index;
    flexmesh.layout.mesh's rank order inside the group), in plan order.

    Every rank makes every group's mesh, in the same order: a mesh's process groups are made by
    ``new_group``, which is collective over the world; a rank keeps using its own group's. The data
    axis is a dimension of its own, not dp and cp flattened later, so no rank ever needs to make a
    process group of another group's mesh after the start.
    """
    meshes = []
    for g in plan.groups:
        lay = group_layout(g)
        ranks = torch.tensor([r for block in g.blocks for r in block]).reshape(lay.pp, lay.data_ranks, lay.tp)
        meshes.append(DeviceMesh(device_type, ranks, mesh_dim_names=RUNTIME_AXES))
    return meshes


# ---- tensor + sequence parallel ------------------------------------------------------------------
def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Megatron-style column/row split of every block, with sequence parallel norms.

    Between blocks the residual stream is a plain tensor holding this rank's 1/tp slice of the
    sequence (dim 1); attention and the MLP all-gather it on entry and reduce-scatter on exit.
    Biases follow their linears: column-parallel ones are split with the outputs, the row-parallel
    ones of wo and w2 stay replicated and DTensor adds them once to the reduced sum.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    root: dict = {}
    if model.tok_embeddings is not None:
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        root["norm"] = SequenceParallel()
    if model.output is not None:
        root["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if root:
        parallelize_module(model, tp_mesh, root)
    for block in blocks(model).values():
        if block.attention.q_norm is not None:
            # Qwen3's per-head q/k norms see this rank's heads only: as replicated DTensors over a
            # head-sharded input (dim 2) their weight gradients are summed over the tp ranks.
            parallelize_module(block, tp_mesh, {
                "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            })
        rest = (None,) if block.feed_forward.adapters is not None else ()
        attention = {
            "attention_norm": SequenceParallel(),
            # attention(x, row): only x is sharded; the row (positions, documents) is the same on every tp rank
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        }
        if isinstance(block.feed_forward, MoEFeedForward):
            # experts run on the tp rank's own slice of the sequence (they spread over every rank of the
            # stage: flexmesh.runtime.parallel.expert_parallel); the router and shared expert stay whole
            parallelize_module(block, tp_mesh, {**attention, "ffn_norm": SequenceParallel(use_local_output=True)})
            block.feed_forward.sequence_shard = (tp_mesh.get_local_rank(), tp_mesh.size(), tp_mesh.get_group())
            continue
        parallelize_module(block, tp_mesh, {
            **attention,
            "ffn_norm": SequenceParallel(),
            # feed_forward(x) or, carrying LoRA adapters, feed_forward(x, row)
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1), *rest),
                                               desired_input_layouts=(Replicate(), *rest)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


# ---- activation checkpointing --------------------------------------------------------------------
def recompute_mode(value: Recompute | bool) -> Recompute:
    """A layout's per-layer recomputation as a :class:`Recompute` (a bool means full or none).

    >>> recompute_mode(True), recompute_mode("selective")
    (<Recompute.FULL: 'full'>, <Recompute.SELECTIVE: 'selective'>)
    """
    if isinstance(value, bool):
        return Recompute.FULL if value else Recompute.NONE
    return Recompute(value)


def apply_ac(model: Transformer, recompute: tuple[Recompute | bool, ...]) -> None:
    """Recompute what the plan says per block (``recompute`` is indexed by global layer number).

    ``full``: the whole block is wrapped in activation checkpointing. ``selective``: only the
    attention core (softmax(QK^T)V, and with context parallelism its collectives) is checkpointed
    inside the block (``Attention.recompute_core``), as Megatron-LM's selective granularity.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name in list(model.layers.keys()):
        mode = recompute_mode(recompute[int(name)])
        if mode is Recompute.FULL:
            # preserve_rng_state off: the blocks draw no random numbers (no dropout)
            model.layers[name] = checkpoint_wrapper(model.layers[name], preserve_rng_state=False)
        elif mode is Recompute.SELECTIVE:
            blocks(model)[name].attention.recompute_core = True


# ---- compilation -----------------------------------------------------------------------------------
def apply_compile(model: Transformer) -> None:
    """``torch.compile`` each block's forward, in place (torchtitan compiles per block too): :func:`compile_block`."""
    for inner in blocks(model).values():
        compile_block(inner)


def compile_block(block: TransformerBlock) -> TransformerBlock:
    """``block`` with its forward compiled, in place; returns ``block``.

    What is compiled is the block's computation from its parts
    (flexmesh.runtime.model.transformer.block_forward), not the module call: the FSDP2 and checkpointing
    wrappers around it keep running eagerly, parameter names do not change (checkpoints of compiled
    and eager runs are the same), and the attention core stays out of the graphs
    (flexmesh.runtime.model.transformer.attention_core). Every block shares one compiled code, whatever
    wraps it (full, selective or no recomputation, FSDP2 or none): each layer's differences (its index,
    window, context-parallel group, recomputation of the core) are read inside the attention core only.
    The row length is a dynamic size from the first micro-batch on, so no later length recompiles; a
    row of one token (an empty micro-batch, or a one-token slice of one under sequence or context
    parallelism) runs eagerly, where the compiler would specialise a code on the length 1.
    """
    block.forward = partial(_compiled_block_forward, block)  # type: ignore[method-assign]  # in place (doc)
    return block


@cache
def _compiled_body() -> Callable[..., torch.Tensor]:
    return torch.compile(block_forward)  # made on first use: torch.compile imports the compiler (seconds)


def _compiled_block_forward(block: TransformerBlock, x: torch.Tensor, row: Row) -> torch.Tensor:
    parts = (block.attention_norm, block.attention, block.ffn_norm, block.feed_forward)
    if x.shape[1] < 2:
        return block_forward(*parts, x, row)
    # FSDP2's pre-forward hook hands the block a view of its input, a new tensor object that does not
    # carry the model's mark (flexmesh.runtime.model.transformer.Transformer.forward), and activation
    # checkpointing's recomputation hands it a tensor that is no view: the compiler guards on both,
    # so the block always gets a view, marked dynamic
    x = x.view_as(x)
    torch._dynamo.maybe_mark_dynamic(x, 1)
    return _compiled_body()(*parts, x, row)


# ---- data parallel (FSDP2) -----------------------------------------------------------------------
def apply_data_parallel(model: Transformer, layout: Layout, dmesh: DeviceMesh, root: nn.Module | None = None,
                        dtype: str = "fp32", ignored: set[nn.Parameter] | None = None) -> None:
    """FSDP2 per block then the root; ZeRO 0 replicates with FSDP2's replicate over the same mesh.

    Gradients are summed, not averaged, over the dp x cp ranks: each rank's loss is already divided
    by the global label-token count of the step, so the sum is the single-process gradient. In
    ``bf16`` both run with :func:`mixed_precision` (bf16 compute, fp32 gradient reductions).
    ``ignored``: parameters sharded otherwise (experts: flexmesh.runtime.parallel.expert_parallel), left alone.
    """
    mp = mixed_precision(dtype)
    ignored = ignored or set()
    if layout.replicated:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for block in model.layers.values():
            replicate(block, mesh=dmesh, mp_policy=mp, ignored_params=ignored)
        replicate(root if root is not None else model, mesh=dmesh, mp_policy=mp, ignored_params=ignored)
    else:
        from torch.distributed.fsdp import fully_shard

        for name, block in model.layers.items():
            # ZeRO-3 frees gathered weights after forward; ZeRO-1/2 keep them for backward
            fully_shard(block, mesh=dmesh, reshard_after_forward=layout.zero[int(name)] == 3, mp_policy=mp,
                        ignored_params=ignored)
        fully_shard(root if root is not None else model, mesh=dmesh, reshard_after_forward=False, mp_policy=mp,
                    ignored_params=ignored)
    from torch.distributed.fsdp import FSDPModule

    for m in (root if root is not None else model).modules():
        if isinstance(m, FSDPModule):  # fully_shard's and replicate's modules alike
            m.set_gradient_divide_factor(1.0)
            # plain SUM collectives: gloo has no pre-multiplied sum, and NCCL copies SUM zero-copy
            m.set_force_sum_reduction_for_comms(True)


def parallelize(model: Transformer, layout: Layout, mesh: DeviceMesh, root: nn.Module | None = None,
                dtype: str = "fp32", compile: bool = False, experts_group=None,  # noqa: ANN001
                context: ContextGroups | None = None) -> nn.Module:
    """CP -> TP(+SP) -> activation checkpointing -> compile -> expert parallelism -> FSDP2, in place.

    ``model`` is a :class:`flexmesh.runtime.model.transformer.Transformer` (or a pipeline stage of one) whose
    parameters are materialised, identical on every rank, or on the meta device; ``mesh`` is its
    replica group's (:func:`build_group_meshes`). ``root`` is the module whose forward the training
    loop calls (a wrapper holding ``model``; default ``model``): FSDP's root goes there. ``dtype`` is
    the compute dtype (module doc: Precision); parameters stay fp32 either way. ``compile``:
    :func:`apply_compile`. ``context``: the replica group's pool of context-parallel groups, whose
    attention every layer then calls (its group is switched per step by the trainer); None with one data rank.
    ``experts_group``: the process group of this stage's ranks (flexmesh.runtime.parallel.expert_parallel
    .expert_groups), over which a model with experts shards them when the stage has several.
    """
    check_model_fits_layout(model.spec, layout)
    if context is not None:
        context.apply(model)
    if layout.tp > 1:
        apply_tp(model, mesh["tp"])
        shard_adapters(model, mesh["tp"])  # LoRA adapters, where the model carries some
    if any(recompute_mode(r) is not Recompute.NONE for r in layout.recompute):
        apply_ac(model, layout.recompute)
    if compile:
        apply_compile(model)
    ignored: set[nn.Parameter] = set()
    if model.spec.is_moe and layout.data_ranks * layout.tp > 1:
        from flexmesh.runtime.parallel.expert_parallel import apply_expert_parallel

        if experts_group is None:
            raise PlanError("a model with experts on several ranks needs their process group (expert_groups)")
        # experts over every rank of the stage: the data ranks, and the tp ranks' sequence slices
        ranks = mesh[DATA_AXIS] if layout.tp == 1 else mesh[DATA_AXIS, "tp"]._flatten()
        ignored = set(apply_expert_parallel(model, ranks, experts_group))
    if layout.data_ranks > 1:
        apply_data_parallel(model, layout, mesh[DATA_AXIS], root=root, dtype=dtype, ignored=ignored)
    return model


# ---- precision -------------------------------------------------------------------------------------
def mixed_precision(dtype: str):
    """FSDP2's policy for compute dtype ``dtype``: in bf16, bf16 parameters in forward and backward
    (gathered in bf16) and fp32 gradient reductions; in fp32, FSDP2's default (no casts).

    The root's output (the logits) stays bf16; the loss upcasts it (flexmesh.runtime.train.trainer).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    check_dtype(dtype)
    if dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def uses_fsdp_precision(layout: Layout) -> bool:
    """Whether FSDP2 (or its replicate) wraps the model, so that its policy casts for compute."""
    return layout.data_ranks > 1


def autocast_bf16(layout: Layout, dtype: str, device: str) -> AbstractContextManager:
    """The context forward runs in: ``torch.autocast`` to bf16 for a bf16 run without FSDP2's
    mixed precision (:func:`uses_fsdp_precision`), else nothing.

    Autocast runs matrix products (linear, matmul, SDPA) in bf16 from the fp32 parameters and keeps
    elementwise work and reductions (norms, softmax statistics of ring attention, the loss) in fp32.
    """
    check_dtype(dtype)
    if dtype == "bf16" and not uses_fsdp_precision(layout):
        return torch.autocast(device_type=device, dtype=torch.bfloat16)
    return nullcontext()


def activation_dtypes(layout: Layout, dtype: str) -> tuple[torch.dtype, torch.dtype]:
    """(hidden states, logits) dtypes a pipeline stage sends: what the forward above produces.

    FSDP2's bf16 policy makes every activation bf16. Under autocast the residual stream stays fp32
    (the fp32 embedding plus bf16 block outputs promotes to fp32) and the output projection's
    logits are bf16.
    """
    check_dtype(dtype)
    if dtype == "fp32":
        return torch.float32, torch.float32
    if uses_fsdp_precision(layout):
        return torch.bfloat16, torch.bfloat16
    return torch.float32, torch.bfloat16
