"""A model's experts through a run: each step's placement, load statistics, balancing, routing traces; a
part the trainer calls (flexmesh.runtime.train.parts).

Before a step the trainer gives every MoE layer the placement its policy chose
(flexmesh.schedule.expert_placement.Placer) for the ranks of its stage; after the step one
all-reduce over every rank carries each layer's routed (token, expert) pairs per expert and the
pairs each rank computed. From those global counts, the same on every rank:

- the placer plans the next step (so every rank of a stage gathers the same experts);
- aux-loss-free balancing (DeepSeek-V3, 2412.19437; ``balance_rate`` > 0) moves each expert's bias
  by ``rate * sign(mean load - its load)``, the same update on every rank and under every layout;
- the load-balancing loss (``aux_loss`` > 0, flexmesh.runtime.model.moe) weighs the next step's router
  probabilities by the fraction of pairs each expert received;
- the step's routing (tokens per expert, tokens per rank, the imbalance it caused and the imbalance
  static placement would have caused) becomes one routing.jsonl row per MoE layer (docs/metrics.md).

Placements change who computes, never what: losses and gradients do not depend on them (within
float summation order), which tests/test_moe_runtime.py checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from flexmesh.layout.mesh import Place, global_rank, group_layout
from flexmesh.layout.plan import Plan
from flexmesh.layout.step import StepSchedule
from flexmesh.runtime.model.moe import MoEFeedForward, moe_feed_forwards
from flexmesh.runtime.parallel.distributed import cpu_group
from flexmesh.runtime.parallel.expert_parallel import ShardedExperts, expert_groups, tp_sum_shared
from flexmesh.runtime.parallel.lsh import CrossPolytope
from flexmesh.runtime.state.weights import LoadReport
from flexmesh.runtime.train.config import TrainConfig
from flexmesh.runtime.train.parts import TrainingPart
from flexmesh.schedule.expert_placement import Placer, static_placement
from flexmesh.spec.model import ModelSpec

LSH_SEED = 1_000_003  # layer i's hash rotations are drawn from this plus i (the same on every rank and run)


class ExpertTraining(TrainingPart):
    """Made by the Trainer (collectively: it makes the experts' process groups) when the model has experts
    (:meth:`of`)."""

    def __init__(self, plan: Plan, spec: ModelSpec, place: Place | None, policy: str, slots: int | None,
                 balance_rate: float, aux_loss: float = 0.0, lsh: tuple[int, int] | None = None) -> None:
        assert spec.moe is not None
        self.spec, self.plan = spec, plan
        self.num_experts = spec.moe.num_experts
        self.groups = expert_groups(plan)
        self.group = self.groups.get((place.group, place.pp)) if place is not None else None
        self.moe_layers = tuple(i for i in range(spec.num_layers) if spec.is_moe_layer(i))
        lay = group_layout(plan.groups[place.group]) if place is not None else None
        ranks = lay.data_ranks * lay.tp if lay is not None else 1  # every rank of a stage runs experts
        self.cpu_group = cpu_group()
        self.ranks = ranks
        self.placer = Placer(policy, self.moe_layers, self.num_experts, ranks, slots)
        self.slots = slots
        self.balance_rate = balance_rate
        self.aux_loss = aux_loss
        self.a2a_ratio: float | None = None  # the last step's (after_step)
        self.lsh = lsh  # (dim, hashes) of the all-to-all's cross-polytope hashing (LSH-MoE); None: uncompressed
        self._started = False  # whether a step ran (else the placer starts from the checkpoint's shares)
        self.holders = self._holders()
        # the experts' layout in the Hugging Face weights the run started from (flexmesh.runtime.state.expert_weights),
        # which `flexmesh export` writes back; None: trained from scratch (exported fused)
        self.checkpoint_layout: str | None = None

    @classmethod
    def of(cls, plan: Plan, spec: ModelSpec, place: Place | None, config: TrainConfig) -> ExpertTraining | None:
        if not spec.is_moe:
            return None
        return cls(plan, spec, place, config.expert_placement, config.expert_slots, config.balance_rate,
                   config.aux_loss, config.expert_lsh)

    # ---- the part's hooks (flexmesh.runtime.train.parts) ----------------------------------------------
    def parallel_options(self) -> dict[str, Any]:
        return {"experts_group": self.group}  # the stage's ranks, over which its experts are sharded

    def ready(self, chunk: nn.Module, loaded: LoadReport | None) -> None:
        if loaded is not None:  # the layout `flexmesh export` writes back
            self.checkpoint_layout = loaded.expert_layout

    def begin_step(self, docs: Sequence[np.ndarray], schedule: StepSchedule, models: Sequence[nn.Module]) -> None:
        self.before_step(models, sum(schedule.lengths))

    def after_backward(self, models: Sequence[nn.Module]) -> None:
        """What tensor parallelism leaves partial: the router's and shared expert's gradients."""
        tp_sum_shared(models)

    def end_step(self, models: Sequence[nn.Module], owner: bool) -> dict[str, Any]:
        imbalance, routing, aux = self.after_step(models, self.cpu_group)
        return {"expert_imbalance": imbalance, "routing": routing, "aux_loss": aux,
                "expert_a2a_ratio": self.a2a_ratio}

    def manifest(self) -> dict[str, Any]:
        return {"expert_layout": self.checkpoint_layout} if self.checkpoint_layout is not None else {}

    # ---- placements, loads, balancing ---------------------------------------------------------------
    def _holders(self) -> dict[int, list[list[int]]]:
        """Per MoE layer, per replica group: the global ranks computing its experts (its stage's ranks)."""
        out: dict[int, list[list[int]]] = {layer: [] for layer in self.moe_layers}
        for g in self.plan.groups:
            lay = group_layout(g)
            for p, stage in enumerate(g.stages):
                for layer in range(stage.start, stage.end):
                    if layer in out:
                        out[layer].append([g.ranks[global_rank(lay, p % lay.pp, d, t)] for d in range(lay.data_ranks)
                                           for t in range(lay.tp)])
        return out

    def _all_shares(self, mine: dict[int, torch.Tensor]) -> dict[int, Sequence[float]]:
        """Every MoE layer's checkpointed shares (a rank holds its stage's; one all-reduce gives all),
        {} when the run starts fresh."""
        table = torch.zeros(self.spec.num_layers, self.num_experts, dtype=torch.float64)
        for layer, share in mine.items():
            table[layer] = share
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=self.cpu_group)
        if float(table.sum()) == 0.0:
            return {}
        return {layer: table[layer].tolist() for layer in self.moe_layers}

    @staticmethod
    def layers(models: Sequence[torch.nn.Module]) -> dict[int, MoEFeedForward]:
        """This rank's MoE layers by global layer number."""
        return {layer: ff for m in models for layer, ff in moe_feed_forwards(m).items()}

    def before_step(self, models: Sequence[torch.nn.Module], tokens: int) -> None:
        """Placements of the step's layers, and the load-balancing loss's weights for its ``tokens`` (the
        global batch's routed tokens: every rank the same weights, whatever it holds)."""
        e = self.num_experts
        mine = self.layers(models)
        shares = {layer: ff.routed_share.cpu() for layer, ff in mine.items()}
        if not self._started:  # a resumed run: the checkpoint's last shares (every rank: all MoE layers)
            self._started = True
            known = self._all_shares(shares)
            if known:
                self.placer.observe(known)
        placements = self.placer.place()
        for layer, ff in mine.items():
            if self.aux_loss > 0:
                share = shares[layer]
                f = share.tolist() if float(share.sum()) > 0 else [1.0 / e] * e  # before any step: even, no gradient
                w = torch.tensor(f, dtype=torch.float32) * (self.aux_loss * e / max(1, tokens))
                ff.aux_weights.copy_(w.to(ff.aux_weights.device))
                ff.aux_on = True
            if isinstance(ff.dispatch, ShardedExperts):
                ff.dispatch.set_placement(placements[layer])
                ff.dispatch.current, ff.dispatch.slots = self.placer.policy == "current", self.slots
                if self.lsh is not None and ff.dispatch.lsh is None:  # one fixed hash per layer, every rank alike
                    ff.dispatch.lsh = CrossPolytope(self.spec.hidden, *self.lsh, seed=LSH_SEED + layer)

    def after_step(self, models: Sequence[torch.nn.Module],
                   group: dist.ProcessGroup | None) -> tuple[float, tuple[dict, ...], float | None]:
        """Gather the step's loads (collective over every rank), plan the next placement, move the
        balancing biases; (the worst layer's imbalance, the routing rows, the load-balancing loss or
        None without one)."""
        e, world, me = self.num_experts, dist.get_world_size(), dist.get_rank()
        # per layer: routed pairs per expert, pairs each rank computed, and the token all-to-all's rows sent and
        # the routed pairs they stand for (a2a_ratio)
        table = torch.zeros(self.spec.num_layers, e + world + 2, dtype=torch.int64)
        mine = self.layers(models)
        for layer, ff in mine.items():
            load = ff.load.detach().cpu()
            table[layer, :e] = load
            got = ff.dispatch.received if isinstance(ff.dispatch, ShardedExperts) else None
            table[layer, e + me] = int(got.sum()) if got is not None else int(load.sum())
            if isinstance(ff.dispatch, ShardedExperts) and ff.dispatch.sent is not None:
                table[layer, e + world:] = ff.dispatch.sent.detach().cpu()
                ff.dispatch.sent = None
            ff.load.zero_()
            if isinstance(ff.dispatch, ShardedExperts):
                ff.dispatch.received = None
        dist.all_reduce(table, group=group)
        loads: dict[int, Sequence[float]] = {layer: table[layer, :e].tolist() for layer in self.moe_layers}
        rows_sent, pairs = table[:, e + world:].sum(0).tolist()
        # rows the step's token all-to-alls carried over the routed pairs they stand for, every rank and MoE layer
        # together; None where no experts are sharded over ranks
        self.a2a_ratio = rows_sent / pairs if pairs > 0 else None
        aux = None
        if self.aux_loss > 0:  # each rank's part of the loss term, summed (the same on every rank)
            part = torch.tensor([float(sum(ff.aux_value.item() for ff in mine.values()))], dtype=torch.float64)
            for ff in mine.values():
                ff.aux_value.zero_()
            dist.all_reduce(part, group=group)
            aux = float(part[0])
        for layer, ff in mine.items():
            total = max(1, sum(loads[layer]))
            ff.routed_share.copy_(torch.tensor([x / total for x in loads[layer]], dtype=torch.float64))
        placements = self.placer.place()
        rows, worst = [], 1.0
        for layer in self.moe_layers:
            counts, per_rank = loads[layer], table[layer, e:e + world].tolist()
            imbalance = max((_ratio([per_rank[r] for r in ranks]) for ranks in self.holders[layer]), default=1.0)
            worst = max(worst, imbalance)
            placed = placements[layer] if self.placer.policy != "current" else None  # placed per micro-batch
            rows.append({"layer": layer, "expert_tokens": counts, "rank_tokens": per_rank, "imbalance": imbalance,
                         "static_imbalance": static_placement(e, self.ranks).imbalance(counts),
                         "placement": placed.to_dict() if placed is not None else "current"})
        self.placer.observe(loads)
        if self.balance_rate > 0:
            for layer, ff in mine.items():
                load = torch.tensor(loads[layer], dtype=torch.float32)
                step = self.balance_rate * torch.sign(load.mean() - load)
                ff.balance_bias.add_(step.to(ff.balance_bias.device))
        return worst, tuple(rows), aux


def _ratio(values: list[int]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0
