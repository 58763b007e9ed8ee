"""Gradients of a heterogeneous plan: reduced per layer over every stage, in every replica, holding it.

Replicas of a :class:`~flexmesh.layout.hetero.HeteroPlan` cut the model at different layers and
split stages over different tensor-parallel degrees, so no single data-parallel group holds "the"
copies of a weight. Each *unit* of the model (the embedding, every layer, the head: final norm and
output projection) is held by one stage per replica; the stages holding a unit are its *holders*.

Every rank's loss is its tokens' summed cross-entropy over the step's global label-token count, so
the gradient of the global loss is the plain sum of the holders' gradients. A tensor-parallel stage
holds shards (DTensors), a stage without tensor parallelism the full tensor, so per set of holders:

1. every rank of a holding stage brings each gradient to its full form (``full_tensor``: an
   all-gather within its tensor-parallel group; a no-op for plain tensors and replicated DTensors);
2. one all-reduce (sum) of the flattened full gradients runs over all ranks of all holding stages,
   where the first rank of each stage contributes its stage's gradient and the others zeros, so
   each stage counts once and the sum is exact;
3. every rank takes its own shard of the sum back (sliced locally, no communication).

One process group per distinct set of holders (:class:`HolderGroups`), made by every rank in one
order (``new_group`` is collective over the world); units with a single holder need no reduction.
All holders end with bit-identical gradients (every member of an all-reduce gets the same sum), so
AdamW makes identical updates in every replica.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from flexmesh.layout.hetero import HeteroPlan
from flexmesh.runtime.distributed import cpu_group

EMBED, HEAD = "embed", "head"
Unit = int | str  # a layer index, EMBED or HEAD


def unit_of(name: str) -> Unit:
    """The unit a canonical parameter name belongs to.

    >>> unit_of("layers.3.attention.wq.weight"), unit_of("tok_embeddings.weight"), unit_of("output.weight")
    (3, 'embed', 'head')
    """
    head, _, rest = name.partition(".")
    if head == "layers":
        return int(rest.partition(".")[0])
    if head == "tok_embeddings":
        return EMBED
    if head in ("norm", "output"):
        return HEAD
    raise ValueError(f"parameter {name!r} belongs to no unit of the model")


def holder_stages(plan: HeteroPlan, unit: Unit) -> tuple[tuple[int, ...], ...]:
    """The device tuples (sorted) of every stage holding ``unit``, in replica order."""
    out = []
    for r in plan.replicas:
        k = 0 if unit == EMBED else r.pp - 1 if unit == HEAD else r.stage_of_layer(int(unit))
        stage = r.stages[k]
        out.append(tuple(sorted(stage.devices)))
    return tuple(out)


def units(plan: HeteroPlan) -> list[Unit]:
    return [EMBED, *range(plan.num_layers), HEAD]


class HolderGroups:
    """One gloo/NCCL process group per distinct set of holders; all ranks construct it alike.

    ``order`` lists the sets (tuples of holder stages) needing a reduction, in the one order every
    rank reduces them; ``groups`` maps a set this rank belongs to its process group.
    """

    def __init__(self, plan: HeteroPlan) -> None:
        rank = dist.get_rank()
        self.unit_set: dict[Unit, tuple[tuple[int, ...], ...]] = {}
        self.order: list[tuple[tuple[int, ...], ...]] = []
        self.groups: dict[tuple[tuple[int, ...], ...], object] = {}
        for u in units(plan):
            holders = holder_stages(plan, u)
            self.unit_set[u] = holders
            if len(holders) < 2 or holders in self.order:
                continue
            self.order.append(holders)
            ranks = sorted(d for stage in holders for d in stage)
            group = dist.new_group(ranks)  # collective: every rank calls it, members or not
            if rank in ranks:
                self.groups[holders] = group

    def reduce(self, named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
        """Sum this rank's gradients over their holders (module doc), in place; every rank calls it."""
        by_set: dict = {}
        for name, p in named_params:
            by_set.setdefault(self.unit_set[unit_of(name)], []).append(p)
        rank = dist.get_rank()
        for holders in self.order:
            if holders not in self.groups:
                continue
            params = by_set.get(holders, [])
            stage = next(s for s in holders if rank in s)
            contributes = stage[0] == rank  # one rank per holding stage adds its stage's gradient
            full = [_full_grad(p) for p in params]  # tp all-gathers, in the same order on every tp rank
            flat = torch.cat([g.reshape(-1) for g in full]) if full else torch.zeros(0)
            if not contributes:
                flat = torch.zeros_like(flat)
            dist.all_reduce(flat, group=self.groups[holders])
            pos = 0
            for p, g in zip(params, full):
                n = g.numel()
                _set_full_grad(p, flat[pos:pos + n].view_as(g))
                pos += n


def _full_grad(p: torch.nn.Parameter) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    g = p.grad if p.grad is not None else torch.zeros_like(p)
    if isinstance(g, DTensor):
        return g.full_tensor()
    return g.detach()


def _set_full_grad(p: torch.nn.Parameter, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        # src_data_rank=None: every rank holds the same full tensor, so each slices its own shard
        p.grad = distribute_tensor(full.clone(), p.device_mesh, p.placements, src_data_rank=None)
    else:
        p.grad = full.clone()


def clip_replicated_grads(params: list[torch.nn.Parameter], max_norm: float, counts: bool) -> float:
    """Global L2 norm of the model's gradient, clipped to ``max_norm`` on every rank; returns the norm.

    After :meth:`HolderGroups.reduce` every replica holds the same whole gradient, so the norm is
    taken over one replica: ranks with ``counts`` add their shards (a replicated DTensor only on its
    mesh's first rank) and one all-reduce over the world gives every rank, replica or unused, the
    same figure and the same clipping coefficient (torch.nn.utils.clip_grad_norm_'s formula).
    """
    from torch.distributed.tensor import DTensor, Replicate

    sq = torch.zeros((), dtype=torch.float64)
    if counts:
        for p in params:
            g = p.grad
            if g is None:
                continue
            if isinstance(g, DTensor):
                if all(isinstance(x, Replicate) for x in g.placements) and g.device_mesh.get_local_rank() != 0:
                    continue
                g = g.to_local()
            sq += g.detach().double().pow(2).sum().cpu()
    dist.all_reduce(sq, group=cpu_group())  # host-side: a gloo group also under NCCL
    total = math.sqrt(float(sq))
    if max_norm > 0 and total > 0:
        coef = min(1.0, max_norm / (total + 1e-6))
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return total
