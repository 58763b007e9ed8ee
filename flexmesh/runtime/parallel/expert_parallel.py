"""Fully sharded expert parallelism (LAER-MoE's FSEP, 2602.11686) on torch.distributed.

Every routed expert's weights are sharded over the ranks of a pipeline stage (its data ranks, and
with tensor parallelism their tp ranks, each computing the experts of its slice of the sequence):
each rank keeps rows ``[j*c, (j+1)*c)`` of every expert's ``gate_up`` and ``down`` (a DTensor
``Shard(1)`` over those ranks, so checkpoints reshard them like any other parameter). The step's
placement (flexmesh.schedule.expert_placement) names the experts each rank runs; in every MoE layer's
forward:

1. each rank gathers the whole experts it runs: one all-to-all per weight tensor, every rank sending
   its rows of the experts each peer runs (an expert on several ranks is sent to each);
   (placement ``current``: first one all-reduce of the micro-batch's tokens per expert, from which every
   rank computes the same placement, flexmesh.schedule.expert_placement.balanced_placement);
2. each routed (token, expert) pair goes to one of that expert's ranks (every rank splits its pairs
   for an expert into equal contiguous shares over the expert's ranks, rotated by its own index),
   by an all-to-all of the tokens after one of the counts;
3. each rank runs its experts over the tokens it received as one grouped matmul, and a last
   all-to-all sends the results back, where the routing weights scale them and they are summed.

With ``lsh`` (``train --expert-lsh``; flexmesh.runtime.parallel.lsh) the tokens bound for one expert on one rank
are clustered by cross-polytope hashing and only their centroids cross both token all-to-alls (LSH-MoE): every token
then takes its centroid's output plus its own residual. That changes what is computed (an approximation the paper
trains with); without it nothing here does.

All three are ``all_to_all_single_autograd`` (torch.distributed._functional_collectives): backward
runs the same exchanges reversed, so each expert's gradient arrives summed over every rank that ran
it, in the shard that owns its rows; the weights need no other reduction (FSDP2 ignores them). A
change of placement between steps changes who computes what, never what is computed, and moves no
optimizer state.

Collectives must pair across ranks in forward and backward, so every rank runs the same operations
whatever its sizes: it always gathers ``slots`` experts (placements giving it fewer pad with zero
weights that receive no tokens), and an expert with no tokens is an empty group of the grouped matmul.
The exchanges use a process group of their own (:func:`expert_groups`), apart from FSDP2's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from flexmesh.errors import PlanError
from flexmesh.layout.mesh import global_rank, group_layout
from flexmesh.layout.plan import Plan
from flexmesh.runtime.model.moe import Experts, compute_dtype, expert_mlp, moe_feed_forwards, recomputing
from flexmesh.runtime.parallel.lsh import CrossPolytope
from flexmesh.schedule.expert_placement import ExpertPlacement, balanced_placement, static_placement


def shard_rows(dim: int, ranks: int) -> list[int]:
    """Rows of a dimension of ``dim`` each of ``ranks`` ranks holds under ``Shard`` (torch.chunk's rule).

    >>> shard_rows(10, 4), shard_rows(3, 4)
    ([3, 3, 3, 1], [1, 1, 1, 0])
    """
    chunk = -(-dim // ranks)
    return [max(0, min(chunk, dim - j * chunk)) for j in range(ranks)]


def expert_groups(plan: Plan) -> dict[tuple[int, int], dist.ProcessGroup]:
    """A process group of every (replica group, pipeline stage)'s ranks (data rank major, tp index
    minor: the order of the flattened (data, tp) mesh the experts are sharded over), for the experts'
    exchanges; every rank makes every group in one order (``new_group`` is collective) and gets them
    all back (a rank uses its own)."""
    out: dict[tuple[int, int], dist.ProcessGroup] = {}
    for i, g in enumerate(plan.groups):
        lay = group_layout(g)
        if lay.data_ranks * lay.tp < 2:
            continue
        for p in range(lay.pp):
            out[(i, p)] = dist.new_group([g.ranks[global_rank(lay, p, d, t)] for d in range(lay.data_ranks)
                                          for t in range(lay.tp)])
    return out


def tp_sum_shared(models) -> None:  # noqa: ANN001 - modules
    """Sum over the tp ranks the gradients of what a MoE layer keeps whole on each of them (router,
    shared expert and its gate): each rank's covers only its slice of the sequence."""
    for m in models:
        for ff in moe_feed_forwards(m).values():
            if ff.sequence_shard is not None:
                group = ff.sequence_shard[2]
                for name, p in ff.named_parameters():
                    if p.grad is not None and not name.startswith("experts."):
                        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                        dist.all_reduce(g, group=group)


class ShardedExperts:
    """The cross-rank dispatch of one MoE layer (flexmesh.runtime.model.moe.Dispatch): see the module doc.

    ``group``: the stage's ranks (this rank is ``rank`` of ``size``); ``placement``: the step's,
    set by the trainer before each step. ``received`` counts the pairs this rank computed since the
    trainer last cleared it (on the device).
    """

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, num_experts: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.num_experts = num_experts
        self.received: torch.Tensor | None = None
        # rows this rank sent to the experts and the routed pairs they stand for (fewer rows than pairs with
        # ``lsh``), since the trainer last cleared it (on the device)
        self.sent: torch.Tensor | None = None
        self.lsh: CrossPolytope | None = None  # the all-to-all's compression (LSH-MoE), None: the tokens themselves
        # Placed in the layer from each micro-batch's own routing (placement "current"), with this many
        # slots per rank (None: flexmesh.cost.training.experts.default_slots); else the step's placement as set.
        self.current = False
        self.slots: int | None = None
        self.set_placement(static_placement(num_experts, size))

    def set_placement(self, placement: ExpertPlacement) -> None:
        if placement.ranks != self.size or placement.num_experts != self.num_experts:
            raise PlanError(f"an expert placement for {placement.ranks} ranks and {placement.num_experts} experts "
                            f"cannot run on {self.size} ranks of {self.num_experts} experts")
        self.placement = placement
        reps = placement.replicas()
        width = max(len(r) for r in reps)
        self._nrep = torch.tensor([len(r) for r in reps])
        self._reps = torch.tensor([r + [r[0]] * (width - len(r)) for r in reps])
        slot_of = torch.full((self.size, self.num_experts), -1, dtype=torch.long)
        for r, hosts in enumerate(placement.hosts):
            for s, e in enumerate(hosts):
                slot_of[r, e] = s
        self._slot_of = slot_of
        self._send_experts = torch.tensor([e for hosts in placement.hosts for e in hosts], dtype=torch.long)

    # ---- the exchanges --------------------------------------------------------------------------
    def _a2a(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        return wait_tensor(all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, self.group))

    def _gather(self, local: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The whole experts this rank runs, [slots, rows in all, cols], from every rank's ``local`` rows
        [E, rows[j], cols]; slots past this rank's experts are zeros."""
        hosts = self.placement.hosts
        cols = local.shape[-1]
        send = local.index_select(0, self._send_experts.to(local.device)).reshape(-1)
        in_splits = [len(h) * rows[self.rank] * cols for h in hosts]
        mine = len(hosts[self.rank])
        out_splits = [mine * rows[j] * cols for j in range(self.size)]
        got = self._a2a(send, out_splits, in_splits).split(out_splits)
        whole = torch.cat([g.view(mine, rows[j], cols) for j, g in enumerate(got)], dim=1)
        pad = self.placement.slots - mine
        if pad:
            whole = torch.cat([whole, whole.new_zeros(pad, *whole.shape[1:])])
        return whole

    @torch.compiler.disable
    def __call__(self, experts: Experts, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        n, k = chosen.shape
        if self.current:  # every rank the same counts, so the same placement (the greedy is deterministic)
            counts = torch.bincount(chosen.reshape(-1), minlength=self.num_experts)
            dist.all_reduce(counts, group=self.group)
            self.set_placement(balanced_placement(counts.tolist(), self.size, self.slots))
        dtype = compute_dtype(x)
        gate_up, down = experts.local()
        f2, h = experts.gate_up.shape[1], experts.gate_up.shape[2]
        f = experts.down.shape[2]
        gate_up_w = self._gather(gate_up.to(dtype), shard_rows(f2, self.size))  # [slots, 2F, H]
        down_w = self._gather(down.to(dtype), shard_rows(h, self.size))  # [slots, H, F]
        assert gate_up_w.shape[1:] == (f2, h) and down_w.shape[1:] == (h, f)
        # where each pair goes: a replica of its expert (equal contiguous shares, rotated by this rank)
        device = x.device
        slots = self.placement.slots
        flat = chosen.reshape(-1)
        by_expert = torch.argsort(flat, stable=True)
        expert = flat[by_expert]
        counts = torch.bincount(flat, minlength=self.num_experts)
        starts = counts.cumsum(0) - counts
        nth = torch.arange(flat.numel(), device=device) - starts[expert]
        nrep, reps, slot_of = self._nrep.to(device), self._reps.to(device), self._slot_of.to(device)
        share = (nth * nrep[expert]) // counts[expert].clamp(min=1)
        dest = reps[expert, (share + self.rank) % nrep[expert]]
        key = dest * slots + slot_of[dest, expert]
        by_key = torch.argsort(key, stable=True)
        order = by_expert[by_key]
        rows = x.to(dtype)[order // k]
        if self.lsh is not None:  # each (rank, slot)'s rows clustered: their centroids cross instead
            group = key[by_key]
            payload, members = self.lsh.compress(rows, group)
            send_counts = self.lsh.clusters_per_group(group, members, self.size * slots)
        else:
            payload, send_counts = rows, torch.bincount(key, minlength=self.size * slots)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sent = send_counts.view(self.size, slots).sum(1).tolist()
        recv = recv_counts.view(self.size, slots)
        got = recv.sum(1).tolist()
        xs = self._a2a(payload, got, sent)
        # group the received rows by slot (they arrive by source, then slot)
        slot_ids = torch.repeat_interleave(torch.arange(slots, device=device).repeat(self.size), recv.reshape(-1))
        by_slot = torch.argsort(slot_ids, stable=True)
        offsets = recv.sum(0).cumsum(0).to(torch.int32)
        ys = expert_mlp(xs[by_slot], gate_up_w, down_w, offsets)
        back = torch.empty_like(by_slot)
        back[by_slot] = torch.arange(by_slot.numel(), device=device)
        y = self._a2a(ys[back], sent, got)
        if self.lsh is not None:
            y = self.lsh.decompress(y, rows, payload, members)
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        if not recomputing():
            received = recv.sum().reshape(1)
            self.received = received if self.received is None else self.received + received
            sent_rows = torch.stack([send_counts.sum(), send_counts.new_tensor(rows.shape[0])])
            self.sent = sent_rows if self.sent is None else self.sent + sent_rows
        return x.new_zeros(n, x.shape[-1], dtype=y.dtype).index_add(0, order // k, y)


def apply_expert_parallel(model: nn.Module, mesh, group: dist.ProcessGroup) -> list[nn.Parameter]:  # noqa: ANN001
    """Shard every MoE layer's experts over ``mesh`` (1-D: the stage's ranks, data ranks x tp ranks
    flattened, in ``group``'s order) and give the layer a :class:`ShardedExperts` over ``group``;
    returns the sharded parameters (FSDP2 must ignore them). Materialised weights are sliced locally
    (no communication); meta ones stay meta."""
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = []
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    for ff in moe_feed_forwards(model).values():
        for name in ("gate_up", "down"):
            p = getattr(ff.experts, name)
            d = nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(1)], src_data_rank=None))
            setattr(ff.experts, name, d)
            sharded.append(d)
        ff.dispatch = ShardedExperts(group, rank, size, ff.experts.num_experts)
    return sharded
