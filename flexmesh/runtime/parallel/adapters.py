"""Tensor parallelism of LoRA adapters (flexmesh.runtime.model.lora), applied from outside as the
projections' own (flexmesh.runtime.parallel.parallelize.apply_tp).

- A column-parallel projection (wq, wk, wv, w1, w3) is split by output features: its B is split by
  output rows like the projection, so the adapter's product is this rank's output columns. Its input is
  the projection's replicated input (a DTensor) and A is replicated: each rank's gradient of A (and of
  the input) is a partial share.
- A row-parallel projection (wo, w2) is split by input features: its A is split by input columns like
  the projection, the rank-r products of the input shards are all-reduced (backward too: each rank
  holds the gradient of its own tokens), and the addition is cut to this rank's slice of the sequence,
  which the projection's sequence-parallel output holds (B is replicated, its gradient partial).

Partial gradients of replicated factors are summed over the tp ranks after backward
(:func:`tp_sum_replicated`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flexmesh.runtime.model.lora import COLUMN_PARALLEL, adapter_modules


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward and backward: the rank-r products of a row-parallel projection's input
    shards are summed, and so is their gradient, each rank holding that of its own tokens. (Written
    here: torch.distributed.nn.functional.all_reduce does this but is deprecated, and the functional
    collectives that replace it have no autograd.)"""

    @staticmethod
    def forward(ctx, x, group):  # noqa: ANN001, ANN205
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class TensorParallelAdapters:
    """One projection's adapters on a tp rank (flexmesh.runtime.model.lora.AdapterSharding): ``kind``
    "column" or "row" (module doc), over the tp process group ``group``."""

    def __init__(self, kind: str, group: Any) -> None:
        self.kind, self.group = kind, group

    def local_input(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial

        if isinstance(x, DTensor):  # a column-parallel projection's replicated input: each rank's gradient a share
            return x.to_local(grad_placements=[Partial()])
        return x

    def sum_products(self, h: torch.Tensor) -> torch.Tensor:
        # partial products over the input shards: summed, forward and backward
        return _SumOverRanks.apply(h, self.group) if self.kind == "row" else h

    def local_output(self, out: torch.Tensor) -> torch.Tensor:
        if self.kind != "row":
            return out
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        n = out.shape[1] // size
        return out[:, rank * n:(rank + 1) * n]  # this rank's slice of the sequence, as the projection's output


def shard_adapters(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split the adapters as their projections are split over ``tp_mesh`` (module doc): column-parallel
    B by rows, row-parallel A by columns, as DTensors; before FSDP2 wraps the model."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for proj, ad in adapter_modules(model):
        ad.sharding = TensorParallelAdapters("column" if proj in COLUMN_PARALLEL else "row", tp_mesh.get_group())
        split, dim = (ad.lora_B, 0) if ad.sharding.kind == "column" else (ad.lora_A, 1)
        for k in list(split.keys()):
            split[k] = nn.Parameter(distribute_tensor(split[k].data, tp_mesh, [Shard(dim)], src_data_rank=None))


def tp_sum_replicated(models: Sequence[nn.Module]) -> None:
    """Sum, over the tp ranks, the gradients of the adapter factors replicated there (column-parallel A,
    row-parallel B): each rank's holds only its own share (module doc)."""
    for m in models:
        for _, ad in adapter_modules(m):
            sharding = ad.sharding
            if not isinstance(sharding, TensorParallelAdapters):
                continue
            for p in (ad.lora_A if sharding.kind == "column" else ad.lora_B).values():
                if p.grad is not None:
                    grad = p.grad
                    dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=sharding.group)
