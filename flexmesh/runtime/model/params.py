"""Parameter names under wrappers, and filling a parameter (whole, or this rank's DTensor shard) from its
full tensor: what the model, its adapters and the weight files share."""

from __future__ import annotations

import os

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from flexmesh.errors import CheckpointError

# Wrappers that insert a name component without changing what the parameter is.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")

def node_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def host_threads(at_most: int = 8) -> int:
    """Host threads one rank may use for bulk work (drawing initial weights, writing and hashing
    checkpoints): its share of this node's cores among its local ranks, at most ``at_most``, and no more
    than ``OMP_NUM_THREADS`` where that is set (a process pinned to one thread stays on one)."""
    cores = node_cores()
    pinned = os.environ.get("OMP_NUM_THREADS", "")
    at_most = min(at_most, int(pinned)) if pinned.isdigit() and int(pinned) > 0 else at_most
    return max(1, min(at_most, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA adapter's (flexmesh.runtime.model.lora), not the base model's."""
    return ".adapters." in name


def canonical_name(name: str) -> str:
    """A parameter's name with wrapper components removed.

    >>> canonical_name("layers.0._checkpoint_wrapped_module.attention.wq.weight")
    'layers.0.attention.wq.weight'
    """
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


@torch.no_grad()
def copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full (unsharded) tensor ``full`` into ``param``, keeping only this rank's shard.

    For a DTensor parameter every rank holds the same ``full`` (drawn from the same seed or read
    from the same file), so ``distribute_tensor`` may slice it locally with no communication
    (``src_data_rank=None``).
    """
    if tuple(full.shape) != tuple(param.shape):
        raise CheckpointError(f"tensor of shape {tuple(full.shape)} cannot fill a parameter of shape "
                              f"{tuple(param.shape)}; the weights do not belong to this model config")
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        src = full.to(device=param.to_local().device, dtype=param.dtype)
        shard = distribute_tensor(src, mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full.to(device=param.device, dtype=param.dtype))
