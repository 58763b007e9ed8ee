"""Gradients of a plan of several replica groups: summed per unit of the model over the groups.

Replica groups of a :class:`~flexmesh.layout.plan.Plan` cut the model at different layers, split
stages over different tensor-parallel degrees and shard them over different data ranks, so no single
data-parallel group holds "the" copies of a weight. Each *unit* of the model (the embedding, every
layer, the head: final norm and output projection) is held by one pipeline stage per group (a block
of the group's ranks: its dp x cp x tp ranks of that pipeline rank); those blocks are the unit's
*holders*.

Every rank's loss is its tokens' summed cross-entropy over the step's global label-token count, and
inside a group FSDP2 (or its replicate) already summed the gradient over the group's data ranks, so
the gradient of the global loss is the sum of the holders' gradients. Per set of holders, one of two
ways (:func:`shard_wise`):

- *shard-wise*, where every holding block shards the unit alike (blocks of one size, groups of the
  same tp degree, data ranks and ZeRO kind: the ``j``-th rank of every block holds the same slice):
  the ``j``-th ranks all-reduce their local shards, one process group per ``j`` -- HSDP's replicate
  axis across groups, each rank moving ``1 / (tp x data ranks)`` of the unit;
- *whole*, otherwise: every rank of a holding block brings each gradient to its full form
  (``full_tensor``: an all-gather over the block), one all-reduce of the flattened full gradients
  runs over all ranks of all holding blocks (the first rank of each block contributes its block's
  gradient, the others zeros, so each group counts once), and every rank takes its own shard of the
  sum back (sliced locally).

The process groups of every distinct set of holders are made by every rank in one order
(``new_group`` is collective over the world); units with a single holder need no reduction. All
holders end with bit-identical gradients (every member of an all-reduce gets the same sum), so AdamW
makes identical updates in every group. flexmesh.cost.training.mixed prices both ways as they run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flexmesh.layout.mesh import group_layout
from flexmesh.layout.plan import Plan, ReplicaGroup

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


def holder_block(group: ReplicaGroup, unit: Unit) -> tuple[int, ...]:
    """The ranks of ``group``'s pipeline rank holding ``unit``, in the block's (dp, cp, tp) order: chunk
    ``i`` of the group's stages sits on pipeline rank ``i % pp`` (the embedding with chunk 0, the head
    with the last)."""
    chunk = (0 if unit == EMBED else len(group.stages) - 1 if unit == HEAD
             else group.stage_of_layer(int(unit)))
    return group.blocks[chunk % group.pp]


def units(plan: Plan) -> list[Unit]:
    return [EMBED, *range(plan.num_layers), HEAD]


def shard_wise(plan: Plan, holders: tuple[tuple[int, ...], ...]) -> bool:
    """Whether every holding block shards a unit alike (module doc): equal block sizes, and groups of
    one tp degree, number of data ranks and ZeRO kind (sharded or replicated)."""
    layouts = [group_layout(g) for g in plan.groups]
    kinds = {(lay.tp, lay.data_ranks, lay.replicated) for lay in layouts}
    return len({len(b) for b in holders}) == 1 and len(kinds) == 1


class CrossGroupGrads:
    """The process groups of every set of holders needing a reduction, made by all ranks alike, in
    one order; ``order`` lists the sets in the one order every rank reduces them."""

    def __init__(self, plan: Plan) -> None:
        rank = dist.get_rank()
        self.unit_set: dict[Unit, tuple[tuple[int, ...], ...]] = {}
        self.order: list[tuple[tuple[int, ...], ...]] = []
        self.groups: dict[tuple[tuple[int, ...], ...], object] = {}  # this rank's group per set it holds
        self.shard_wise: dict[tuple[tuple[int, ...], ...], bool] = {}
        for u in units(plan):
            holders = tuple(holder_block(g, u) for g in plan.groups)
            self.unit_set[u] = holders
            if len(holders) < 2 or holders in self.order:
                continue
            self.order.append(holders)
            self.shard_wise[holders] = shard_wise(plan, holders)
            # shard-wise: the j-th ranks of the blocks hold the same slice; whole: every rank of every block
            members = ([[block[j] for block in holders] for j in range(len(holders[0]))]
                       if self.shard_wise[holders] else [[d for block in holders for d in block]])
            for ranks in members:
                group = dist.new_group(sorted(ranks))  # collective: every rank calls it, members or not
                if rank in ranks:
                    self.groups[holders] = group

    def reduce(self, named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
        """Sum this rank's gradients (canonical names) over their holders (module doc), in place;
        every rank calls it."""
        by_set: dict = {}
        for name, p in named_params:
            by_set.setdefault(self.unit_set[unit_of(name)], []).append(p)
        rank = dist.get_rank()
        for holders in self.order:
            if holders not in self.groups:
                continue
            params = by_set.get(holders, [])
            if self.shard_wise[holders]:
                local = [_local_grad(p) for p in params]
                flat = torch.cat([g.reshape(-1) for g in local]) if local else torch.zeros(0)
                dist.all_reduce(flat, group=self.groups[holders])
                pos = 0
                for g in local:
                    g.copy_(flat[pos:pos + g.numel()].view_as(g))
                    pos += g.numel()
                continue
            block = next(b for b in holders if rank in b)
            full = [_full_grad(p) for p in params]  # all-gathers, in the same order on every rank of the block
            flat = torch.cat([g.reshape(-1) for g in full]) if full else torch.zeros(0)
            if block[0] != rank:  # one rank per holding block adds its block's gradient
                flat = torch.zeros_like(flat)
            dist.all_reduce(flat, group=self.groups[holders])
            pos = 0
            for p, g in zip(params, full):
                n = g.numel()
                _set_full_grad(p, flat[pos:pos + n].view_as(g))
                pos += n


def _local_grad(p: torch.nn.Parameter) -> torch.Tensor:
    """This rank's part of ``p``'s gradient, as a tensor it can overwrite in place."""
    from torch.distributed.tensor import DTensor

    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad


def _full_grad(p: torch.nn.Parameter) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    g = p.grad if p.grad is not None else torch.zeros_like(p)
    if isinstance(g, DTensor):
        return g.full_tensor()
    return g.detach()


def _set_full_grad(p: torch.nn.Parameter, full: torch.Tensor) -> None:
    """``p.grad`` = this rank's part of ``full``: for a DTensor, a replicated DTensor redistributed to
    the parameter's placements (a local slice, no communication)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(p, DTensor):
        mesh = p.device_mesh
        whole = DTensor.from_local(full.clone(), mesh, [Replicate()] * mesh.ndim, run_check=False)
        p.grad = whole.redistribute(mesh, p.placements)
    else:
        p.grad = full.clone()
