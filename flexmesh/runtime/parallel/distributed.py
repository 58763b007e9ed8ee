"""Process-group plumbing shared by the trainer and the adaptive source.

Joining the group torchrun describes, a gloo group for small host-side messages, a global gradient
norm that works across DTensor meshes, and the peak memory a step reports.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from flexmesh.runtime.parallel.device import DeviceChoice, rank_device

_DEVICE: list[DeviceChoice] = []  # this process's device, chosen once when it joins
# Joining and building the model: ranks may still be importing torch or reading weights on a loaded machine.
START_UP_TIMEOUT_S = 300.0
_COLLECTIVE_TIMEOUT_S: list[float] = [600.0]  # init_distributed's timeout_s, applied by bound_collectives


def init_distributed(timeout_s: float = 600.0, device: str = "auto", start_up_s: float | None = None) -> DeviceChoice:
    """Join the process group torchrun describes on this rank's device (``--device``, chosen by
    :func:`flexmesh.runtime.parallel.device.choose_device`: NCCL on a GPU of its own, gloo on the CPU) and
    return that device; no-op (the device chosen then) when joined.

    ``timeout_s`` bounds every collective: a peer that died makes the others fail after it instead
    of hanging forever. It is also made the default of the groups made later (device meshes,
    context-parallel groups, the gloo group), which would otherwise wait torch's 30 minutes.

    ``start_up_s`` (when longer than ``timeout_s``) bounds joining and the groups made until
    :func:`bound_collectives` instead: ranks still importing torch on a loaded machine must not count as
    stopped under a collective timeout of a few seconds.
    """
    if dist.is_initialized():
        return compute_device_choice()
    choice = rank_device(device)
    _COLLECTIVE_TIMEOUT_S[:] = [timeout_s]
    start_up = timedelta(seconds=max(timeout_s, start_up_s or 0.0))
    _default_timeout(start_up)
    if choice.type == "cuda":
        torch.cuda.set_device(choice.index)
        # fp32 matmuls on TF32 tensor cores, as torchtitan and Megatron-LM run them (docs/precision.md)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dist.init_process_group(choice.backend, timeout=start_up)
    _DEVICE[:] = [choice]
    return choice


def bound_collectives() -> None:
    """From here on every collective, of the groups made so far and of those made later, waits at most
    the collective timeout given to :func:`init_distributed` (its start-up bound ends)."""
    timeout = timedelta(seconds=_COLLECTIVE_TIMEOUT_S[0])
    for group in list(distributed_c10d._world.pg_map):  # the groups this rank is in, the world's included
        distributed_c10d._set_pg_timeout(timeout, group)
    _default_timeout(timeout)


def _default_timeout(timeout: timedelta) -> None:
    """The timeout of groups made from here on: new_group() without one reads these module defaults
    (torch 2.13: _get_default_timeout)."""
    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


def compute_device_choice() -> DeviceChoice:
    """The device :func:`init_distributed` chose; for a group joined another way, what its backend implies."""
    if _DEVICE:
        return _DEVICE[0]
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return DeviceChoice("cuda", torch.cuda.current_device())
    return DeviceChoice("cpu")


def compute_device() -> torch.device:
    """This rank's compute device (:func:`compute_device_choice`) as a torch device."""
    return compute_device_choice().torch_device()


_CPU_GROUPS: dict = {}


def cpu_group() -> dist.ProcessGroup | None:
    """A gloo process group over all ranks for small host-side messages (metrics, schedules).

    None (the default group) when the default backend is gloo already; under NCCL one gloo group is
    made on first use, so every rank must make its first call at the same point of the program.
    """
    if dist.get_backend() == "gloo":
        return None
    key = id(dist.group.WORLD)
    if key not in _CPU_GROUPS:
        _CPU_GROUPS[key] = dist.new_group(backend="gloo")
    return _CPU_GROUPS[key]


def peak_memory_gib(device: torch.device) -> float | None:
    """This process's peak memory in GiB: the allocator's peak on a GPU, the resident set on a CPU.

    None when the platform cannot tell (no ``resource`` module).
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    except (ImportError, OSError):
        return None


def grad_norm(params: list[torch.nn.Parameter], pp_group: dist.ProcessGroup | None = None) -> float:
    """Global L2 norm of the gradients (DTensors of any mesh, plain tensors) of one replica group.

    ``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms, which fails when DTensors live on
    different meshes (FSDP-only weights next to FSDP x TP ones), so norms are taken per (mesh,
    placement) group with ``get_total_norm`` and made global with ``full_tensor``; pipeline stages
    hold disjoint weights, so their squared norms are summed over the pp group.
    """
    device = params[0].device if params else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for grads in _by_placement(params).values():
        from torch.distributed.tensor import DTensor

        n = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        sq = sq + n.float().to(device) ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, group=pp_group)
    return float(sq.sqrt())


def replica_grad_norm(params: list[torch.nn.Parameter], pp_group: dist.ProcessGroup | None, several: bool,
                      leader: bool, group: dist.ProcessGroup | None) -> float:
    """:func:`grad_norm` of one replica group; with ``several`` replica groups every group holds the
    whole gradient, so group 0's ranks (``leader``) take the norm and every rank gets that one figure
    (a MAX over ``group``, a host-side group: gloo under NCCL too; None: the default group)."""
    if not several:
        return grad_norm(params, pp_group)
    mine = grad_norm(params, pp_group) if leader else 0.0
    t = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t[0])


def _by_placement(params: list[torch.nn.Parameter]) -> dict:
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        if p.grad is not None:
            g = p.grad
            key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
            groups.setdefault(key, []).append(g)
    return groups


def clip_grads(params: list[torch.nn.Parameter], max_norm: float, total: float) -> None:
    """Scale every gradient by ``max_norm / (total + 1e-6)`` when that is below 1
    (``torch.nn.utils.clip_grad_norm_``'s formula) given the global norm ``total``.

    Example: norms 3 and 4 give a global norm of 5; with ``max_norm=1`` every gradient is scaled by
    1 / (5 + 1e-6)."""
    if max_norm > 0 and total > 0:
        coef = min(1.0, max_norm / (total + 1e-6))
        if coef < 1.0:
            for grads in _by_placement(params).values():
                for g in grads:
                    g.mul_(coef)
