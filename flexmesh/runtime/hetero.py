"""Run a heterogeneous plan (flexmesh.layout.hetero.HeteroPlan): replicas that differ.

Each replica is one pipeline with its own devices, stage boundaries, tensor-parallel degree and
micro-batch count. On every rank :class:`HeteroTrainer` builds the stage it runs (the model cut at
the stage's layers, tensor parallel over the stage's devices with DTensor, recomputation as the
stage says), runs its replica's micro-batches through torch.distributed.pipelining (GPipe or 1F1B)
or directly for a one-stage replica, then reduces gradients per layer over the replicas holding
it (flexmesh.runtime.hetero_grads), clips by the global norm and steps AdamW.

Data (:func:`hetero_schedule`): replica ``i`` takes the next ``batch`` documents of the step's global
batch in replica order, contiguous, in ``num_microbatches`` micro-batches of equal document count,
each packed into one row. This is a StepSchedule with one group per replica (data rank ``i`` is
replica ``i``), so the single-process reference (flexmesh.runtime.reference) runs the same step.
The loss contract is the uniform trainer's: every rank sums its tokens' cross-entropy over the
step's global label-token count, so summed gradients are the one-process gradients.

Process groups, made by every rank in this order (``new_group`` is collective): per replica, one
tensor-parallel group per stage with tp > 1, then one pipeline group per tensor-parallel index
(stage k's ``sorted(devices)[j]`` for every k); then the holder groups of hetero_grads.

Limits: one tp degree per replica (its stages' activations are split the same way on both sides of
a pipeline send; a replica mixing degrees is refused); no context parallelism, ZeRO or interleaving
(a replica holds full copies of its layers); documents are never cut across micro-batches.
Devices in ``unused`` run no model but join every collective of the world (metrics, checkpoints).

Checkpoints (flexmesh.runtime.checkpoint through :meth:`HeteroTrainer.checkpoint_state`): replicas
hold identical weights and AdamW states, so only replica 0 writes model and optimizer, under the
model's own parameter names (DTensor shards where it runs tensor parallel); every replica reads
what it holds from them, whatever its cuts and tp degree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from flexmesh.errors import PlanError, ScheduleError
from flexmesh.layout.enums import CPKind
from flexmesh.layout.hetero import HeteroPlan, Replica
from flexmesh.layout.mesh import Layout
from flexmesh.layout.step import Group, Piece, StepSchedule
from flexmesh.runtime.config import StepMetrics, TrainConfig, lr_schedule_factor
from flexmesh.runtime.distributed import compute_device, cpu_group
from flexmesh.runtime.hetero_grads import HolderGroups, clip_replicated_grads
from flexmesh.runtime.memory import SavedActivationMeter
from flexmesh.runtime.packing import PackedBatch, global_label_tokens, pack_microbatch, pad_to
from flexmesh.runtime.parallelize import activation_dtypes, autocast_bf16, check_dtype, check_model_fits_layout
from flexmesh.runtime.pipeline import StageModule, build_pipeline_schedule, make_stages, split_stage
from flexmesh.runtime.trainer import _dummy_batch, _GlobalLoss, gathered_step, update
from flexmesh.spec.model import ModelSpec

POLICY = "hetero"  # the policy name a heterogeneous step schedule reports


def replica_layout(replica: Replica, num_layers: int) -> Layout:
    """The Layout one replica runs: its pipeline and tp degree, no data or context parallelism."""
    tps = {s.tp for s in replica.stages}
    if len(tps) != 1:
        raise PlanError(f"replica {replica.compact!r} mixes tp degrees {sorted(tps)} over its stages; the runtime "
                        "runs one tp degree per replica (replicas may differ): give its stages the same tp")
    recompute = tuple(s.recompute for s in replica.stages for _ in range(s.num_layers))
    return Layout(pp=replica.pp, dp=1, cp=1, cp_kind=CPKind.NONE, tp=tps.pop(), zero=(0,) * num_layers,
                  recompute=recompute)


def check_runnable(plan: HeteroPlan, spec: ModelSpec) -> None:
    """Raise PlanError unless every replica of ``plan`` can run ``spec`` here."""
    if plan.num_layers != spec.num_layers:
        raise PlanError(f"plan covers {plan.num_layers} layers but model {spec.name!r} has {spec.num_layers}; "
                        "plan for this model")
    for r in plan.replicas:
        check_model_fits_layout(spec, replica_layout(r, spec.num_layers))


def hetero_schedule(plan: HeteroPlan) -> Callable[[list[int]], StepSchedule]:
    """``lengths -> StepSchedule``: replica i's contiguous share, in its micro-batches (module doc).

    >>> from flexmesh.layout.hetero import ReplicaStage
    >>> p = HeteroPlan("tiny", "cpu", 2, 64, 3, (Replica((ReplicaStage(0, 2, (0,)),), 2, 2),
    ...                                           Replica((ReplicaStage(0, 2, (1,)),), 1, 1)))
    >>> s = hetero_schedule(p)([5, 6, 7])
    >>> [[[x.seq_id for x in mb] for mb in g.microbatches] for g in s.groups]
    [[[0], [1]], [[2]]]
    """
    def make(lengths: list[int]) -> StepSchedule:
        if len(lengths) != plan.global_batch:
            raise ScheduleError(f"the step has {len(lengths)} documents but the plan's replicas take "
                                f"{plan.global_batch}; run with the plan's global batch")
        groups, pos = [], 0
        for i, r in enumerate(plan.replicas):
            size = r.microbatch_size
            mbs = tuple(tuple(Piece(pos + m * size + j, 0, int(lengths[pos + m * size + j])) for j in range(size))
                        for m in range(r.num_microbatches))
            groups.append(Group(ranks=(i,), microbatches=mbs))
            pos += r.batch
        return StepSchedule(lengths=tuple(int(n) for n in lengths), groups=tuple(groups), policy=POLICY)

    make.policy = POLICY  # type: ignore[attr-defined]  # read by AdaptiveSource
    return make


@dataclass(frozen=True)
class Place:
    """Where a rank runs: replica, stage, and index in the stage's sorted devices (its tp coordinate)."""

    replica: int
    stage: int
    tp_index: int


def place_of(plan: HeteroPlan, rank: int) -> Place | None:
    for i, r in enumerate(plan.replicas):
        for k, s in enumerate(r.stages):
            if rank in s.devices:
                return Place(i, k, sorted(s.devices).index(rank))
    return None  # an unused device


class HeteroTrainer:
    """The Trainer of a HeteroPlan (same use: ``step(docs, schedule)``; :func:`flexmesh.runtime.loop.fit`
    runs it). Needs the process group joined with the plan's world size."""

    def __init__(self, plan: HeteroPlan, spec: ModelSpec, config: TrainConfig, weights: str | None = None):
        if not dist.is_initialized():
            raise PlanError("the trainer needs a process group: launch with torchrun (or `flexmesh train --nproc N`)")
        if dist.get_world_size() != plan.world_size:
            raise PlanError(f"plan is for {plan.world_size} ranks but {dist.get_world_size()} were launched; launch "
                            f"with --nproc {plan.world_size} or re-plan")
        check_runnable(plan, spec)
        check_dtype(config.dtype)
        self.plan, self.spec, self.config = plan, spec, config
        self.device = compute_device()
        self.place = place_of(plan, dist.get_rank())
        self.replica = plan.replicas[self.place.replica] if self.place else None
        self.layout = replica_layout(self.replica, spec.num_layers) if self.replica else None
        self.tp_group = self.pp_group = None
        self.pp_ranks: list[int] = []
        self._make_groups()
        self.holders = HolderGroups(plan)
        self._cpu_group = cpu_group()
        torch.manual_seed(config.seed)
        np.random.seed(config.seed)
        self.root: StageModule | None = self._build(weights) if self.place else None
        self.model = self.root.model if self.root is not None else None
        # An unused device steps an optimizer over nothing it trains (a placeholder keeps AdamW and the
        # LR scheduler, whose states checkpoints and metrics read, the same objects everywhere).
        self.params = list(self.model.parameters()) if self.model is not None else [torch.nn.Parameter(torch.zeros(1))]
        # foreach off on every rank: one AdamW code path, so replicas update bit-identically
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=config.betas, eps=config.eps,
                                           weight_decay=config.weight_decay, foreach=False)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_schedule_factor(s, config.warmup_steps, config.max_steps, config.min_lr_ratio))
        self.loss_fn = _GlobalLoss()
        self._schedules: dict = {}
        self.step_index = 0

    # ---- setup -----------------------------------------------------------------------------------
    def _make_groups(self) -> None:
        """Every rank makes every replica's groups, in one order (module doc)."""
        me = self.place
        for i, r in enumerate(self.plan.replicas):
            for k, s in enumerate(r.stages):
                if s.tp > 1:
                    group = dist.new_group(sorted(s.devices))
                    if me is not None and (me.replica, me.stage) == (i, k):
                        self.tp_group = group
            if r.pp > 1:
                for j in range(r.stages[0].tp):
                    ranks = [sorted(s.devices)[j] for s in r.stages]
                    group = dist.new_group(ranks)
                    if me is not None and (me.replica, me.tp_index) == (i, j):
                        self.pp_group, self.pp_ranks = group, ranks

    def _build(self, weights: str | None) -> StageModule:
        from flexmesh.runtime.model import build_model
        from flexmesh.runtime.parallelize import parallelize

        assert self.place is not None and self.replica is not None and self.layout is not None
        k, stage = self.place.stage, self.replica.stages[self.place.stage]
        model = build_model(self.spec, device="meta" if weights else "cpu")
        if not weights:
            model.init_weights(self.config.seed)  # the full model's values, identical on every rank
        split_stage(model, stage.start, stage.end, first=k == 0, last=k == self.replica.pp - 1)
        root = StageModule(model, compute=partial(autocast_bf16, self.layout, self.config.dtype, self.device.type))
        mesh = None
        if stage.tp > 1:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(self.tp_group, self.device.type, mesh_dim_names=("tp",))
        parallelize(model, self.layout, mesh, root=root, dtype=self.config.dtype)
        if weights:
            from flexmesh.runtime.weights import load_hf_safetensors

            root.to_empty(device=self.device)
            load_hf_safetensors(model, weights)
        else:
            root.to(self.device)
        return root

    # ---- data ------------------------------------------------------------------------------------
    def local_batches(self, docs: Sequence[np.ndarray], schedule: StepSchedule) -> list[PackedBatch]:
        """This replica's micro-batches: packed, padded to a multiple of tp (pipelines: one length)."""
        assert self.place is not None and self.layout is not None
        groups = [g for g in schedule.groups if g.ranks == (self.place.replica,)]
        if len(groups) != 1 or len(schedule.groups) != len(self.plan.replicas):
            raise ScheduleError(f"a heterogeneous step needs one group per replica ({len(self.plan.replicas)}); "
                                "make it with flexmesh.runtime.hetero.hetero_schedule")
        packed = [pack_microbatch(docs, mb) for mb in groups[0].microbatches]
        tp, pp = self.layout.tp, self.layout.pp
        if pp == 1:
            return [pad_to(b, -(-b.num_tokens // tp) * tp).to(self.device) for b in packed]
        length = -(-max(b.num_tokens for b in packed) // tp) * tp
        count = max(len(packed), pp)  # 1F1B runs at least one micro-batch per stage: pad with empty ones
        return [(pad_to(packed[i], length) if i < len(packed) else _dummy_batch(length)).to(self.device)
                for i in range(count)]

    # ---- one step --------------------------------------------------------------------------------
    def step(self, docs: Sequence[np.ndarray], schedule: StepSchedule) -> StepMetrics:
        t0 = time.perf_counter()
        label_tokens = global_label_tokens(docs, schedule)
        if label_tokens == 0:
            raise ScheduleError("the step has no label tokens (every document is a single token); "
                                "feed longer documents")
        self.loss_fn.normaliser = label_tokens
        self.optimizer.zero_grad(set_to_none=True)
        local_loss, busy, peak, batches = 0.0, 0.0, 0, []
        if self.root is not None:
            batches = self.local_batches(docs, schedule)
            with SavedActivationMeter() as meter:
                local_loss = self._pipeline_step(batches) if self.layout.pp > 1 else self._direct_step(batches)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            busy, peak = time.perf_counter() - t0, meter.peak_bytes
        named = [(n, p) for n, p in self.model.named_parameters()] if self.model is not None else []
        from flexmesh.runtime.weights import canonical_name

        self.holders.reduce([(canonical_name(n), p) for n, p in named])
        grad_norm = clip_replicated_grads(self.params, self.config.grad_clip,
                                          counts=self.place is not None and self.place.replica == 0)
        lr, elapsed = update(self.optimizer, self.lr_scheduler, self.device, t0)
        # Each replica's loss is a partial sum of the global mean, held by its last stage's first rank.
        owner = self.place is not None and self.place.stage == self.replica.pp - 1 and self.place.tp_index == 0
        _, common = gathered_step([local_loss if owner else 0.0, busy, float(peak), elapsed], self._cpu_group,
                                  schedule, self.device)
        self.step_index += 1
        return StepMetrics(step=self.step_index, grad_norm=grad_norm, lr=lr, label_tokens=label_tokens,
                           padded_tokens=sum(b.num_tokens for b in batches), microbatches=len(batches),
                           dtype=self.config.dtype, **common)

    def _direct_step(self, batches: list[PackedBatch]) -> float:
        assert self.root is not None
        total = 0.0
        for b in batches:
            loss = self.loss_fn(self.root(b.tokens, b), b.labels)
            loss.backward()
            total += float(loss.detach())
        return total

    def _pipeline_step(self, batches: list[PackedBatch]) -> float:
        assert self.root is not None and self.place is not None and self.layout is not None
        m, length = len(batches), batches[0].num_tokens
        k, pp = self.place.stage, self.layout.pp
        if (m, length) not in self._schedules:
            hidden, logits = activation_dtypes(self.layout, self.config.dtype)
            stages = make_stages([self.root], [k], pp, self.device, self.pp_group, tokens=length,
                                 tp=self.layout.tp, hidden=self.spec.hidden, vocab=self.spec.vocab, dtype=hidden,
                                 logits_dtype=logits)
            # new_group sorts its ranks: stage s sits at the group rank of its device in that order
            order = sorted(self.pp_ranks)
            for st in stages:
                st.stage_index_to_group_rank = {s: order.index(r) for s, r in enumerate(self.pp_ranks)}
            self._schedules[(m, length)] = build_pipeline_schedule(stages, str(self.plan.pipeline_schedule), m,
                                                                   self.loss_fn)
        sched = self._schedules[(m, length)]
        self.root.feed(batches)
        first, last = k == 0, k == pp - 1
        losses: list = []
        args = (torch.cat([b.tokens for b in batches]),) if first else ()
        sched.step(*args, target=torch.cat([b.labels for b in batches]) if last else None,
                   losses=losses if last else None, return_outputs=False)
        if self.root.consumed() != m:
            raise RuntimeError(f"pipeline stage ran {self.root.consumed()} forwards for {m} micro-batches")
        return float(sum(float(x.detach()) for x in losses)) if last else 0.0

    # ---- state for checkpoints -------------------------------------------------------------------
    def inner_models(self) -> list[torch.nn.Module]:
        return [self.model] if self.model is not None else []

    def state_module(self) -> torch.nn.Module:
        return self.model if self.model is not None else torch.nn.Module()

    def checkpoint_state(self, saving: bool, options) -> tuple[dict, dict]:
        """(model, optimizer) state dicts to write (``saving``: replica 0 only) or to read into."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.model is None or (saving and self.place is not None and self.place.replica != 0):
            return {}, {}
        return get_state_dict(self.model, self.optimizer, options=options)

    def load_checkpoint_state(self, model_sd: dict, optim_sd: dict, options) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if self.model is not None:
            set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                           options=options)
