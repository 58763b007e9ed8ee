"""LoRA adapters of many tasks on one frozen base model, applied in one forward (docs/adapters.md).

Every adapted projection ``y = W x`` of the base model gains, per task ``t`` that targets it,
``y += s_t * B_t A_t dropout_t(x)`` (LoRA, 2106.09685; ``s_t = alpha_t / r_t``, or ``alpha_t /
sqrt(r_t)`` with rsLoRA). The adapters of one projection live beside it, in the layer's
``adapters`` dict, so the base model's module names, tensor-parallel plan, checkpoints and Hugging
Face names stay as they are::

    layers.3.attention.wq.weight                  the frozen base projection
    layers.3.attention.adapters.wq.lora_A.2       task slot 2's A [r_2, in]   (PEFT's lora_A.weight)
    layers.3.attention.adapters.wq.lora_B.2       task slot 2's B [out, r_2]  (PEFT's lora_B.weight)

A packed micro-batch holds documents of several tasks. Packing lays each task's documents next to
each other (flexmesh.runtime.model.packing.pack_microbatch), so the row is a few runs of one task each,
and every projection runs its adapters as two grouped matmuls over those runs
(``torch._grouped_mm`` with the runs' end offsets): one call for every task's ``x A_t^T``, one for
``(.) B_t^T``. The tasks' A (and B) are zero-padded to the largest rank and stacked, and each run
picks its task's slice; zero padding adds exact zeros to the product and gets zero gradients, so
ranks may differ per task. Padding tokens and tasks that do not target a projection are scaled by 0.
Every task's weights enter the stack on every step, so every adapter has a gradient (zero when the
task had no tokens) on every rank and data-parallel reductions always pair.

Where the grouped kernel is not available for the device and dtype (CUDA below sm90 or not bf16),
each run is its own pair of ``F.linear`` (:func:`segment_matmul`); ``loop=True`` asks for that path
(the per-adapter loop the kernel benchmark compares against).

Tensor parallelism splits the adapters as their projections from outside
(flexmesh.runtime.parallel.adapters): it gives each :class:`Adapters` a :class:`AdapterSharding`, whose
hooks turn inputs and factors into this rank's tensors and sum the rank-r products over the tp ranks.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from flexmesh.runtime.model.grouped import grouped_linear
from flexmesh.runtime.model.params import canonical_name, copy_full_, is_adapter
from flexmesh.spec.model import ModelSpec
from flexmesh.spec.tasks import TARGETS, TaskSet, projection_shape


@dataclass
class AdapterRow:
    """Which task each token of one micro-batch's row belongs to: ``runs`` of (task slot, tokens), in
    row order, covering the row (padding: flexmesh.runtime.model.packing.PADDING_SLOT). ``offsets``: the
    runs' end offsets on the device (int32), built once per micro-batch and read by every adapted projection."""

    runs: tuple[tuple[int, int], ...]
    offsets: torch.Tensor

    @classmethod
    def of(cls, runs: Sequence[tuple[int, int]], device: torch.device) -> AdapterRow:
        ends, total = [], 0
        for _, n in runs:
            total += n
            ends.append(total)
        return cls(tuple(runs), torch.tensor(ends, dtype=torch.int32, device=device))

    def token_slots(self, device: torch.device) -> torch.Tensor:
        """Task slot of every token [T] (long)."""
        return torch.cat([torch.full((n,), s, dtype=torch.long) for s, n in self.runs]).to(device)


def segment_matmul(x: torch.Tensor, w: torch.Tensor, row: AdapterRow, loop: bool = False) -> torch.Tensor:
    """Rows of ``x`` [T, K] in run ``i`` of ``row`` times ``w[i]^T`` (``w`` [runs, N, K]): [T, N]. One
    grouped kernel, or (``loop``, or no grouped kernel here) one ``F.linear`` per run."""
    return grouped_linear(x, w, row.offsets, [n for _, n in row.runs], loop)


# Projections split by output features under tensor parallelism (the others by input features).
COLUMN_PARALLEL = ("wq", "wk", "wv", "w1", "w3")


class AdapterSharding(Protocol):
    """How one projection's adapters run on this rank's shards (flexmesh.runtime.parallel.adapters)."""

    def local_input(self, x: torch.Tensor) -> torch.Tensor:
        """The projection's input as this rank's plain tensor."""
        ...

    def sum_products(self, h: torch.Tensor) -> torch.Tensor:
        """The rank-r products ``x A^T`` of this rank's shard, made whole (forward and backward)."""
        ...

    def local_output(self, out: torch.Tensor) -> torch.Tensor:
        """The addition [B, T, out] cut to what the projection's output holds on this rank."""
        ...


class Adapters(nn.Module):
    """The LoRA adapters of one projection (``fan_in`` -> ``fan_out``), one per task slot that targets it.

    Under tensor parallelism (flexmesh.runtime.parallel.adapters.shard_adapters) the factors are split
    like the projection and ``sharding`` runs the rank's part: see that module.
    """

    def __init__(self, fan_in: int, fan_out: int, tasks: TaskSet, target: str, device: torch.device | None = None):
        super().__init__()
        self.slots = [i for i, t in enumerate(tasks) if target in t.targets]
        self.rank = max(tasks.tasks[i].rank for i in self.slots)
        self.scaling = {i: tasks.tasks[i].scaling for i in self.slots}
        self.dropout = {i: tasks.tasks[i].dropout for i in self.slots}
        self.loop = False  # the per-run reference path (segment_matmul)
        self.sharding: AdapterSharding | None = None  # under tensor parallelism (flexmesh.runtime.parallel.adapters)
        self.lora_A = nn.ParameterDict({str(i): nn.Parameter(torch.zeros(tasks.tasks[i].rank, fan_in, device=device))
                                        for i in self.slots})
        self.lora_B = nn.ParameterDict({str(i): nn.Parameter(torch.zeros(fan_out, tasks.tasks[i].rank, device=device))
                                        for i in self.slots})

    def _stacked(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's A [r_max, in] and B [out, r_max], zero-padded and stacked (one more all-zero
        entry last, for runs this projection does not adapt)."""
        r = self.rank
        a_, b_ = [_local(self.lora_A[str(i)]) for i in self.slots], [_local(self.lora_B[str(i)]) for i in self.slots]
        a = [F.pad(t, (0, 0, 0, r - t.shape[0])) for t in a_]
        b = [F.pad(t, (0, r - t.shape[1])) for t in b_]
        a.append(torch.zeros_like(a[0]))
        b.append(torch.zeros_like(b[0]))
        return torch.stack(a).to(dtype), torch.stack(b).to(dtype)

    @torch.compiler.disable
    def forward(self, x: torch.Tensor, row: AdapterRow) -> torch.Tensor:
        """The adapters' addition to the projection of ``x`` [B, T, in] -> [B, T, out]; outside
        ``torch.compile`` (compiled blocks would recompile for every micro-batch's task runs)."""
        if self.sharding is not None:
            x = self.sharding.local_input(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        a, b = self._stacked(x.dtype)
        index = {s: k for k, s in enumerate(self.slots)}
        pick = torch.tensor([index.get(s, len(self.slots)) for s, _ in row.runs], device=x.device)
        scale = torch.cat([torch.full((n,), self.scaling.get(s, 0.0), dtype=x.dtype) for s, n in row.runs])
        if self.training and any(self.dropout.get(s, 0.0) > 0 for s, _ in row.runs):
            keep = torch.cat([torch.full((n,), 1.0 - self.dropout.get(s, 0.0)) for s, n in row.runs]).to(x.device)
            x2 = x2 * (torch.bernoulli(keep.expand(shape[-1], -1).t()) / keep[:, None]).to(x.dtype)
        h = segment_matmul(x2, a[pick], row, self.loop)
        if self.sharding is not None:
            h = self.sharding.sum_products(h)
        out = segment_matmul(h * scale.to(x.device)[:, None], b[pick], row, self.loop).view(*shape[:-1], -1)
        return self.sharding.local_output(out) if self.sharding is not None else out


def attach_adapters(model: nn.Module, spec: ModelSpec, tasks: TaskSet) -> None:
    """Freeze every parameter of ``model`` (a Transformer or a stage of one) and give each of its
    layers the adapters of ``tasks`` (on the model's device; zeros until :func:`init_adapters`)."""
    tasks.check(spec)
    model.requires_grad_(False)
    for layer in model.get_submodule("layers").children():
        device = next(layer.parameters()).device
        for target in tasks.targets():
            fan_in, fan_out = projection_shape(spec, target)
            part, proj = TARGETS[target].split(".")
            owner = getattr(layer, part)
            if owner.adapters is None:
                owner.adapters = nn.ModuleDict()
            owner.adapters[proj] = Adapters(fan_in, fan_out, tasks, target, device)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a factor (a tensor-parallel DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def adapter_modules(model: nn.Module) -> list[tuple[str, Adapters]]:
    """(projection name, its Adapters) of every adapted projection of ``model``, in layer order (each
    held at ``layers.<N>.<attention|feed_forward>.adapters.<projection>``)."""
    return [(name.rsplit(".", 1)[1], m) for name, m in model.named_modules() if isinstance(m, Adapters)]


def adapter_slot(name: str) -> int:
    """The task slot of adapter parameter ``name`` (``...lora_A.<slot>``)."""
    return int(name.rsplit(".", 1)[1])


def adapter_seed(name: str, task: str, seed: int) -> int:
    """The generator seed of one adapter tensor: the run's seed, the tensor's place and the task's name
    (not its slot), so a task draws the same initial adapter alone or beside others."""
    place = name.rsplit(".", 1)[0]
    return seed * 1_000_003 + zlib.crc32(f"{place}.{task}".encode())


@torch.no_grad()
def init_adapters(model: nn.Module, tasks: TaskSet, seed: int) -> None:
    """LoRA's initialisation, as PEFT draws it: A ~ U(-1/sqrt(in), 1/sqrt(in)) (Kaiming-uniform with
    a = sqrt(5)), B = 0, so every adapter starts as the identity; drawn whole on CPU per tensor and
    copied into this rank's shard (flexmesh.runtime.model.params.copy_full_)."""
    for wrapped, param in model.named_parameters():
        name = canonical_name(wrapped)
        if not is_adapter(name):
            continue
        shape = tuple(param.shape)
        if ".lora_B." in name:
            full = torch.zeros(shape)
        else:
            gen = torch.Generator().manual_seed(adapter_seed(name, tasks.tasks[adapter_slot(name)].name, seed))
            bound = 1.0 / math.sqrt(shape[1])
            full = torch.empty(shape).uniform_(-bound, bound, generator=gen)
        copy_full_(param, full)


def adapter_parameters(modules: Sequence[nn.Module], tasks: TaskSet) -> list[list[nn.Parameter]]:
    """Per task slot, its adapter parameters held by ``modules``, in name order."""
    out: list[list[nn.Parameter]] = [[] for _ in tasks]
    for m in modules:
        for name, p in sorted(m.named_parameters()):
            if is_adapter(name):
                out[adapter_slot(name)].append(p)
    return out
