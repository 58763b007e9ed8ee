"""The trainer: run a Plan's layout on StepSchedules, one step at a time, and measure.

The runtime decides nothing: the Plan fixes the layout, each StepSchedule fixes which documents each
data rank packs into which micro-batch and which ranks form each context-parallel group. The trainer
packs, pads, runs forward/backward (directly, or through a pipeline schedule), clips, steps AdamW
and a warmup + cosine learning rate, and reports.

Loss normalisation (the correctness contract). Every rank sums the token cross-entropies of its own
label tokens and divides by the step's GLOBAL label-token count (all ranks, all micro-batches).
FSDP2 is told to sum gradients over the dp x cp ranks instead of averaging, pipelining not to divide
by the number of micro-batches, so the gradients equal those of one process running the whole
batch whatever the number of micro-batches per rank. The reported loss is the sum over data ranks
of those partial losses: the global mean.

Data ranks (flexmesh.layout.step): data rank ``dp_index * cp + cp_index``. Each step a schedule
group of ``g`` consecutive data ranks (an aligned power-of-two run) shards its micro-batches ``g``
ways, each rank taking a contiguous 1/g slice, over a process group from the pool made at start
(flexmesh.runtime.parallel.context.ContextGroups); FSDP2 shards weights over all data ranks, so weights
never depend on the step's groups.

Precision (``config.dtype``, docs/precision.md): parameters, gradients and AdamW states are fp32
in both dtypes. In bf16 the forward computes in bfloat16, through FSDP2's mixed-precision policy
where FSDP2 wraps the model and under ``torch.autocast`` where it does not
(flexmesh.runtime.parallel.parallelize.autocast_bf16); gradient reductions and the loss are fp32 (the
logits are upcast before the cross-entropy).

Micro-batch counts (flexmesh.runtime.train.accumulate). With pp == 1 and no ZeRO-3 layer each rank
runs only its own group's micro-batches, then one empty micro-batch carries the step's single
gradient reduction; ZeRO-3 and pipelines pair collectives per micro-batch, so there every rank runs
the step's largest count, groups with fewer padded with empty micro-batches.

Replica groups (flexmesh.layout.plan): every group runs the above on a device mesh of its own
(flexmesh.runtime.parallel.parallelize.build_group_meshes), on its part of the step's schedule (data ranks
are numbered group by group). After the groups' own reductions, each unit of the model's gradient is
summed over the groups holding it (flexmesh.runtime.parallel.cross_group) and the global norm taken on group
0 is given to all, so every group holds the same gradient and makes the same update (AdamW's
single-tensor path on every rank of a plan of several groups). A plan of one group over every rank is
the uniform layout. Devices a plan leaves unused join every collective and train nothing.

Cut documents (flexmesh.runtime.model.carry): micro-batches linked by a document cut into pieces form a
chain (a *unit*), the earlier pieces' keys and values carried to the later ones, so a cut document
trains as the whole one. Without pipelining a chain's forwards all run before one backward of their
summed loss; under a pipeline the step runs a schedule whose units run forwards in order and
backwards in reverse (flexmesh.layout.pipeline_order), built from the units of every group of the
replica group so that data ranks pair their collectives. Every step's schedule is checked first
(StepSchedule.check_cuts).

Features are parts (flexmesh.runtime.train.parts), not branches: LoRA tasks
(flexmesh.runtime.train.task_training: adapters on a frozen base, each task's own loss, optimizer group
and clipping) and experts (flexmesh.runtime.train.expert_training: placements, balancing, routing
records) are called through the same hooks when building the model and around each step.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from functools import partial
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from flexmesh.data.mixture import Mixture
from flexmesh.errors import PlanError, ScheduleError
from flexmesh.layout.mesh import (
    Layout,
    Place,
    data_rank_of_ranks,
    data_rank_offsets,
    group_layout,
    layout_in_lockstep,
    padded_microbatch_count,
    rank_place,
    schedule_parts,
)
from flexmesh.layout.pipeline_order import chain_ends, chain_plan, units_from_ends
from flexmesh.layout.plan import Plan
from flexmesh.layout.step import Group, Piece, StepSchedule
from flexmesh.runtime.model.carry import KVCarry
from flexmesh.runtime.model.loss import GlobalLoss
from flexmesh.runtime.model.packing import (
    IGNORE_INDEX,
    PackedBatch,
    doc_label_tokens,
    empty_batch,
    global_label_tokens,
    pack_microbatch,
    pad_to,
    shard_for_cp,
    token_docs,
)
from flexmesh.runtime.model.transformer import Transformer, build_model
from flexmesh.runtime.observe.memory import SavedActivationMeter
from flexmesh.runtime.parallel.context import ContextGroups
from flexmesh.runtime.parallel.cross_group import CrossGroupGrads
from flexmesh.runtime.parallel.distributed import clip_grads, compute_device, cpu_group, replica_grad_norm
from flexmesh.runtime.parallel.parallelize import autocast_bf16, build_group_meshes, parallelize
from flexmesh.runtime.parallel.pipeline import (
    MicroBatchLoss,
    StageModule,
    chunks_of_rank,
    run_pipeline_step,
    split_stage,
)
from flexmesh.runtime.parallel.precision import check_dtype
from flexmesh.runtime.state.weights import load_hf_safetensors
from flexmesh.runtime.train.accumulate import run_microbatches
from flexmesh.runtime.train.config import StepMetrics, TrainConfig, for_device, lr_schedule_factor
from flexmesh.runtime.train.expert_training import ExpertTraining
from flexmesh.runtime.train.groups import Chunks, check_emulation, check_runnable
from flexmesh.runtime.train.mixture_training import MixtureTraining
from flexmesh.runtime.train.parts import TrainingPart, first_answer
from flexmesh.runtime.train.reweight_training import SampleReweighting
from flexmesh.runtime.train.step_clock import Marks, gathered_step, update
from flexmesh.runtime.train.stragglers import ComputeClock
from flexmesh.runtime.train.task_training import TaskTraining
from flexmesh.spec.model import ModelSpec
from flexmesh.spec.tasks import TaskSet

P = TypeVar("P", bound=TrainingPart)

# Under tensor parallelism a micro-batch's row is rounded up to a multiple of this many tokens (with the
# tp and cp degrees): DTensor propagates the sharding of every operator once per new shape (tens of ms of
# CPU each, forward and backward), and packed documents give nearly every micro-batch a length of its
# own. The padding is a document of its own that no real token attends to, and carries no labels.
TP_ROW_TOKENS = 64


class Trainer:
    """Builds the model for this rank from a Plan, then runs steps. Needs the process group joined.

    >>> # on each rank, after init_distributed():
    >>> # trainer = Trainer(plan, spec, TrainConfig(max_steps=3))
    >>> # metrics = trainer.step(docs, schedule)
    """

    def __init__(self, plan: Plan, spec: ModelSpec, config: TrainConfig, weights: str | None = None,
                 tasks: TaskSet | None = None, mixture: Mixture | None = None):
        if not dist.is_initialized():
            raise PlanError("the trainer needs a process group: launch with torchrun (or `flexmesh train --nproc N`)")
        world = dist.get_world_size()
        if world != plan.world_size:
            raise PlanError(
                f"plan {plan.layout!r} is for {plan.world_size} ranks but {world} were launched; launch with "
                f"--nproc-per-node {plan.world_size} (times nodes) or make a plan for {world} ranks"
            )
        check_runnable(plan, spec)
        check_dtype(config.dtype)
        self.device = compute_device()
        config = for_device(config, self.device.type)
        self.plan, self.spec, self.config = plan, spec, config
        self.several = len(plan.groups) > 1
        # Where this rank runs (None: a device the plan leaves unused) and its replica group's layout.
        self.place = rank_place(plan, dist.get_rank())
        self.group = plan.groups[self.place.group] if self.place is not None else None
        self.layout = group_layout(self.group) if self.group is not None else None
        self.data_offset = data_rank_offsets(plan)[self.place.group] if self.place is not None else 0
        self.data_of = data_rank_of_ranks(plan)
        lay = self.layout
        # Process groups, made by every rank in one order (new_group is collective over the world):
        # every group's mesh, every group's pool of context-parallel groups, the cross-group reductions.
        meshes = build_group_meshes(plan, self.device.type)
        self.mesh = meshes[self.place.group] if self.place is not None else None
        pipelined = self.mesh is not None and lay is not None and lay.pp > 1
        self.pp_group = self.mesh["pp"].get_group() if self.mesh is not None and pipelined else None
        self.cp_groups: ContextGroups | None = None
        for i, g in enumerate(plan.groups):
            if g.data_ranks > 1:
                mine = self.place if self.place is not None and self.place.group == i else None
                pool = ContextGroups(group_layout(g), spec, g.ranks, mine.pp if mine else None,
                                     mine.tp if mine else None)
                self.cp_groups = pool if mine else self.cp_groups
        self.cross = CrossGroupGrads(plan) if self.several else None
        # The run's features as parts (flexmesh.runtime.train.parts): LoRA tasks, whose adapters train on a
        # frozen base; experts, whose process groups, placements and loads it keeps (collective to make).
        self.parts: list[TrainingPart] = [part for part in (
            TaskTraining.of(tasks, spec, config),
            ExpertTraining.of(plan, spec, self.place, config),
            MixtureTraining(mixture) if mixture is not None else None,
            SampleReweighting(config.reweight, config.reweight_delta) if config.reweight else None,
        ) if part is not None]
        self.loss_part = next((part for part in self.parts if part.owns_loss), None)
        self.readers = [part for part in self.parts if part.reads_logits]  # e.g. a data mixture's domain losses
        # The loss chunk by chunk inside the model's forward (flexmesh.runtime.model.loss): where the last stage
        # is the whole model, its head is not split over tensor-parallel ranks and no part computes the loss.
        self.chunked_loss = (bool(config.chunked_loss) and lay is not None and lay.pp == 1 and lay.tp == 1
                             and self.loss_part is None and not self.readers)
        # Ranks may run different numbers of micro-batches unless something pairs collectives per
        # micro-batch across all data ranks; the scheduler and simulator price the same rule.
        self.uneven = lay is not None and not layout_in_lockstep(spec, lay)
        self._cpu_group = cpu_group()
        torch.manual_seed(config.seed)
        np.random.seed(config.seed)
        self.chunks = chunks_of_rank(self.group, self.place.pp) if self.group and self.place else []
        self.modules = self._build(weights)
        # An unused device steps an optimizer over nothing it trains (a placeholder keeps AdamW and the
        # LR scheduler, whose states checkpoints and metrics read, the same objects everywhere).
        self.params = ([p for m in self.modules for p in m.parameters() if p.requires_grad]
                       or [torch.nn.Parameter(torch.zeros(1))])
        answer = first_answer(self.parts, "optimizer", self.modules)
        groups, lr = answer if answer is not None else ([{"params": self.params}], (
            lambda s: lr_schedule_factor(s, config.warmup_steps, config.max_steps, config.min_lr_ratio)))
        for param_group in groups:
            param_group["params"] = param_group["params"] or [torch.nn.Parameter(torch.zeros(1))]
        # One fused kernel on a GPU (the multi-tensor foreach path on CPU); neither across the DTensor
        # meshes tensor parallelism mixes, nor where replica groups of other layouts must make
        # bit-identical updates (the single-tensor path on every rank).
        tp1 = lay is None or lay.tp == 1
        fused = self.device.type == "cuda" and tp1 and not self.several
        self.optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                                           weight_decay=config.weight_decay,
                                           foreach=tp1 and not fused and not self.several, fused=fused or None)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr)
        self.loss_fn = GlobalLoss()
        # the last pipeline stage's loss of each micro-batch (flexmesh.runtime.parallel.pipeline)
        self.pipeline_loss = MicroBatchLoss(self.microbatch_loss)
        # pipeline schedules by (micro-batches, shape, units): the latest few (flexmesh.runtime.parallel.pipeline)
        self._schedules: OrderedDict = OrderedDict()
        # keys and values of cut documents, within one chain of micro-batches (detached leaves under a
        # pipeline, whose micro-batches each run their own backward: flexmesh.runtime.model.carry)
        self.carry = KVCarry(detached=lay is not None and lay.pp > 1)
        self.step_index = 0
        # Compute time of this rank's micro-batches, stretched where --emulate-speed names this rank
        # (flexmesh.runtime.train.stragglers); the pipeline path is not timed per piece.
        emulated = check_emulation(plan, config.emulate_speed)
        self.emulated_speed = tuple(emulated.get(r, 1.0) for r in range(world)) if emulated else ()
        self.clock = ComputeClock(self.device.type, emulated.get(dist.get_rank(), 1.0))

    # ---- model -----------------------------------------------------------------------------------
    def _build(self, weights: str | None) -> list[StageModule]:
        if self.group is None:
            return []
        n = len(self.group.stages)
        modules = []
        for k, stage in self.chunks:
            # Small models are built whole on CPU with the seeded init (identical on every rank) and
            # then cut and sharded; with a weights file the model stays on meta until loaded.
            model = build_model(self.spec)  # on meta: initialised once, below
            if not weights:
                model.to_empty(device="cpu")
                model.init_buffers()
                model.init_weights(self.config.seed)
            split_stage(model, stage.start, stage.end, first=k == 0, last=k == n - 1)
            for part in self.parts:
                part.adapt(model)
            root = StageModule(model, compute=partial(autocast_bf16, self._lay(), self.config.dtype,
                                                      self.device.type))
            options = {key: value for part in self.parts for key, value in part.parallel_options().items()}
            parallelize(model, self._lay(), self._mesh(), root=root, dtype=self.config.dtype,
                        compile=bool(self.config.compile), context=self.cp_groups, **options)
            report = None
            if weights:
                root.to_empty(device=self.device)
                model.init_buffers()  # the checkpoint holds weights only; to_empty left the buffers unset
                report = load_hf_safetensors(model, weights)
            else:
                root.to(self.device)
            for part in self.parts:
                part.ready(model, report)
            modules.append(root)
        return modules

    # ---- where this rank runs ----------------------------------------------------------------------
    def _place(self) -> Place:
        """This rank's place in the plan; asked only on a rank the plan uses."""
        assert self.place is not None, "a device the plan leaves unused has no place"
        return self.place

    def _lay(self) -> Layout:
        """This rank's replica group's layout; asked only on a rank the plan uses."""
        assert self.layout is not None, "a device the plan leaves unused has no layout"
        return self.layout

    def _mesh(self) -> DeviceMesh:
        assert self.mesh is not None, "a device the plan leaves unused has no mesh"
        return self.mesh

    # ---- data ------------------------------------------------------------------------------------
    @property
    def data_rank(self) -> int:
        """This rank's data rank inside its replica group (``dp_index * cp + cp_index``)."""
        if self.place is None or self.layout is None:
            return 0
        return self.place.dp * self.layout.cp + self.place.cp

    def _own(self, schedule: StepSchedule) -> tuple[list[Group], Group]:
        """The schedule groups of this rank's replica group in the group's own data-rank numbering, and
        this rank's among them; every group must be an aligned power-of-two run (ScheduleError)."""
        lo = self.data_offset
        own = [dataclasses.replace(g, ranks=tuple(r - lo for r in g.ranks)) if lo else g
               for g in schedule_parts(self.plan, schedule)[self._place().group]]
        for g in own:
            if self.cp_groups is not None:
                self.cp_groups.check(g.ranks)
            elif tuple(g.ranks) != (0,):
                raise ScheduleError(f"schedule group {list(g.ranks)} names data ranks this replica group lacks: "
                                    "it has one data rank; schedule for one data rank")
        mine = [g for g in own if self.data_rank in g.ranks]
        if len(mine) != 1:
            raise ScheduleError(f"data rank {self.data_rank + lo} appears in {len(mine)} groups; give each data rank "
                                f"exactly one of {self._lay().data_ranks} data ranks (dp {self._lay().dp} x cp "
                                f"{self._lay().cp}) of its replica group")
        return own, mine[0]

    def local_batches(self, docs: Sequence[np.ndarray], own: list[Group], group: Group,
                      even: bool = False) -> list[PackedBatch]:
        """This rank's micro-batches for the step (``own``, ``group``: :meth:`_own` of its schedule):
        packed, padded, cp-sliced; count-equalised unless uneven (``even``: always, as a forward-only
        pass whose every forward may gather weights needs).

        The first ``len(group.microbatches)`` hold data; any after them are empty padding.
        """
        lay = self._lay()
        cp = group.cp
        count = len(group.microbatches)
        if even or not self.uneven:
            count = max(len(g.microbatches) for g in own)
            count = padded_microbatch_count(self.plan.pipeline_schedule, count, lay.pp)
        packed = [self._pack(docs, mb) for mb in group.microbatches]
        quantum = cp * lay.tp  # T must split over the group's ranks, then over tp ranks (sequence parallel)
        row = math.lcm(quantum, TP_ROW_TOKENS) if lay.tp > 1 else quantum  # lengths that repeat (TP_ROW_TOKENS)
        if lay.pp > 1:  # pipelining needs one shape for every micro-batch of the step
            longest = max([b.num_tokens for b in packed] + [1])
            count = max(count, lay.pp)  # a pipeline schedule runs at least one micro-batch per stage
            lengths = [-(-longest // row) * row] * count
        else:
            lengths = [-(-b.num_tokens // row) * row for b in packed] + [quantum] * (count - len(packed))
        keep = chain_plan(group)[0]
        out = []
        for i in range(count):
            b = pad_to(packed[i], lengths[i]) if i < len(packed) else self.empty_microbatch(lengths[i])
            if i < len(packed) and (keep[i] or any(p.start > 0 for p in b.segments)):
                b = dataclasses.replace(b, carry=self.carry.view(b.segments, keep[i]))  # a cut document's piece
            if cp > 1:
                b = shard_for_cp(b, self.data_rank - group.ranks[0], cp)
            out.append(b.to(self.device))
        return out

    def _pack(self, docs: Sequence[np.ndarray], pieces: Sequence[Piece]) -> PackedBatch:
        """One micro-batch's tensors, as a part lays them out or plainly (flexmesh.runtime.model.packing)."""
        packed = first_answer(self.parts, "pack", docs, pieces)
        return packed if packed is not None else pack_microbatch(docs, pieces)

    def empty_microbatch(self, length: int) -> PackedBatch:
        """A micro-batch of ``length`` tokens without labels (padding), as a part lays it out or plainly."""
        empty = first_answer(self.parts, "empty", length)
        return empty if empty is not None else empty_batch(length)

    def _set_context(self, group: Group) -> None:
        """Attention over this rank's context-parallel group of the step (flexmesh.runtime.parallel.context)."""
        if self.cp_groups is not None:
            self.cp_groups.use(group.ranks, self.data_rank)

    def _check_cuts(self, schedule: StepSchedule) -> None:
        """Every cut sequence can be carried where it runs (StepSchedule.check_cuts)."""
        schedule.check_cuts(dynamic_rope=self.spec.rope_scaling is not None
                            and self.spec.rope_scaling.rope_type == "dynamic")

    # ---- forwards without a step ------------------------------------------------------------------
    def forward_only(self, docs: Sequence[np.ndarray], schedule: StepSchedule,
                     each: Callable[[torch.nn.Module, PackedBatch], None]) -> None:
        """Run the forwards of ``docs`` laid out by ``schedule``: the step's path (its micro-batches, context
        groups and parallel model) without backward or optimizer, in eval mode under ``torch.no_grad``,
        ``each(model, batch)`` calling the model on each of this rank's micro-batches. Every rank calls it at
        the same point (collectives). Nothing the next step reads changes: no gradient, optimizer or LR
        state, no RNG draw, weights sharded again afterwards. Plans with pp 1 only (PlanError)."""
        from torch.distributed.fsdp import FSDPModule

        if any(g.pp > 1 for g in self.plan.groups):
            raise PlanError("a forward outside the step runs plans with pp 1; use such a plan")
        self._check_cuts(schedule)
        if self.place is None:
            schedule_parts(self.plan, schedule)  # a device left unused checks the schedule as the others do
            return
        own, group = self._own(schedule)
        # as many forwards on every data rank: each may gather weights over them (FSDP2)
        batches = self.local_batches(docs, own, group, even=True)
        self._set_context(group)
        root, was = self.modules[0], [m.training for m in self.modules]
        ends = chain_ends(own, len(batches))
        try:
            for m in self.modules:
                m.eval()
            with torch.no_grad():
                for b, end in zip(batches, ends, strict=True):
                    each(root, b)
                    if end:  # a chain of micro-batches linked by a cut document ends here
                        self.carry.clear()
        finally:
            self.carry.clear()
            for m, mode in zip(self.modules, was, strict=True):
                m.train(mode)
            for sub in (s for m in self.modules for s in m.modules()):
                if isinstance(sub, FSDPModule):  # as a step leaves them: sharded
                    sub.reshard()

    def doc_losses(self, docs: Sequence[np.ndarray], schedule: StepSchedule) -> np.ndarray:
        """Each document's mean token cross-entropy under the current weights (:meth:`forward_only` of the
        step's own layout, its pieces' sums added over micro-batches and data ranks; NaN for a document
        with no label token in the schedule). The same on every rank."""
        sums = torch.zeros(len(docs) + 1, dtype=torch.float64, device=self.device)  # the last: padding
        owner = self.place is not None and self.place.tp == 0  # tp ranks hold copies of their data rank's

        def each(model: torch.nn.Module, b: PackedBatch) -> None:  # on the device: no wait per micro-batch
            logits = model(b.tokens, b)
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), b.labels.reshape(-1),
                                 ignore_index=IGNORE_INDEX, reduction="none")
            doc = np.where((d := token_docs(b)) >= 0, d, len(docs))
            sums.index_add_(0, torch.from_numpy(doc).to(sums.device), ce.double())

        self.forward_only(docs, schedule, each)
        box = sums[:-1].cpu() * float(owner)
        if dist.get_world_size() > 1:
            dist.all_reduce(box, group=self._cpu_group)
        tokens = doc_label_tokens(docs, schedule)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(tokens > 0, box.numpy() / tokens, np.nan)

    # ---- one step --------------------------------------------------------------------------------
    def step(self, docs: Sequence[np.ndarray], schedule: StepSchedule) -> StepMetrics:
        """Run one step's schedule. Nothing in it waits for the device before the optimizer's step
        (losses stay on the device, timings are CUDA events); activations are metered on the steps
        ``config.meter_every`` picks."""
        t0 = time.perf_counter()
        marks = Marks(self.device, t0)
        label_tokens = global_label_tokens(docs, schedule)
        self._check_cuts(schedule)
        if label_tokens == 0:
            raise ScheduleError("the step has no label tokens (every document is a single token); "
                                "feed longer documents")
        # every rank refuses a schedule that does not fit this rank's group, before any collective
        own, group = self._own(schedule) if self.place is not None else ([], None)
        if self.place is None:
            schedule_parts(self.plan, schedule)  # a device left unused checks the schedule as the others do
        self.loss_fn.normaliser = label_tokens
        self.optimizer.zero_grad(set_to_none=True)
        self.clock.reset()
        every = self.config.meter_every or 0
        metered = every > 0 and self.step_index % every == 0
        batches: list[PackedBatch] = []
        local_loss: torch.Tensor | float = 0.0
        busy = marks.mark()
        meter: SavedActivationMeter | None = None  # on metered steps of a rank that trains
        scorers = [part for part in self.parts if part.scores_docs]
        if scorers:  # e.g. loss-based reweighting: each document's loss before the step
            losses = self.doc_losses(docs, schedule)
            for part in scorers:
                part.score(docs, schedule, losses)
        for part in self.parts:
            part.begin_step(docs, schedule, self.inner_models())
        if group is not None:
            batches = self.local_batches(docs, own, group)
            self._set_context(group)
            with SavedActivationMeter() if metered else nullcontext() as meter:
                local_loss, busy = self._forward_backward(batches, group, marks, own)
            for part in self.parts:
                part.after_backward(self.inner_models())
        if self.cross is not None:
            from flexmesh.runtime.model.params import canonical_name
            self.cross.reduce([(canonical_name(n), p) for m in self.inner_models() for n, p in m.named_parameters()
                               if p.requires_grad])
        grad_norm = self._clip()
        lrs, elapsed = update(self.optimizer, self.lr_scheduler, self.device, t0)
        # Each data rank's loss is a partial sum of the global mean; count each once (tp ranks and
        # earlier pipeline stages hold copies or nothing). One gather carries it with the timings.
        owner = self.place is not None and self.layout is not None and self.place.tp == 0 and \
            self.place.pp == self.layout.pp - 1
        peak = float(meter.peak_bytes) if meter is not None else (0.0 if metered else -1.0)
        table, common = gathered_step([float(local_loss) if owner else 0.0, marks.seconds(busy), peak, elapsed,
                                       self.clock.total()], self._cpu_group, schedule, self.device)
        self.step_index += 1
        timed = any(g.pp == 1 for g in self.plan.groups)  # pipelines are not timed per piece
        for part in self.parts:  # the parts' fields (a part owning the loss says what the step's loss is)
            common.update(part.end_step(self.inner_models(), owner))
        return StepMetrics(
            step=self.step_index, grad_norm=grad_norm, lr=lrs[0], label_tokens=label_tokens,
            task_lr=tuple(lrs) if common.get("tasks") else (),  # LoRA: one parameter group per task slot
            padded_tokens=sum(b.num_tokens for b in batches) * (group.cp if group is not None else 1),
            microbatches=len(batches), cut_documents=len(schedule.cut_sequences()),
            predicted_busy_s=self._predicted_busy(schedule), dtype=self.config.dtype,
            microbatch_tokens=self.group.microbatch_tokens(self.plan.seq_len) if self.group is not None else None,
            **common, compute_s=tuple(float(x) for x in table[:, 4]) if timed else (),
            emulated_speed=self.emulated_speed,
        )

    def _clip(self) -> float:
        """The global gradient norm, every gradient clipped by it (by group 0's with several replica groups)."""
        leader = self.place is not None and self.place.group == 0
        answer = first_answer(self.parts, "clip", self.optimizer.param_groups, self.pp_group, leader, self.several)
        if answer is not None:
            return float(answer)
        total = replica_grad_norm(self.params, self.pp_group, self.several, leader, self._cpu_group)
        clip_grads(self.params, self.config.grad_clip, total)
        return total

    def microbatch_loss(self, output: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """A micro-batch's share of the step's loss from the model's ``output`` (the logits): the
        summed cross-entropy over the step's label tokens, or the loss of the part that owns it."""
        for part in self.readers:
            part.observe(output, batch)
        if self.loss_part is not None:  # e.g. LoRA tasks: each task's own mean
            return self.loss_part.loss(output, batch)
        return self.loss_fn(output, batch.labels)

    def _predicted_busy(self, schedule: StepSchedule) -> tuple[float, ...]:
        """Per global rank: the predicted time of the group holding its data rank."""
        by_rank = {r: g.predicted_time for g in schedule.groups for r in g.ranks}
        return tuple(0.0 if d is None else float(by_rank.get(d, 0.0)) for d in self.data_of)

    def _forward_backward(self, batches: list[PackedBatch], group: Group, marks: Marks,
                          own: list[Group]) -> tuple[torch.Tensor | float, object]:
        """Run the step's micro-batches; returns (this rank's loss, on the device; the mark where its
        own micro-batches were done, read by ``marks.seconds`` after the step).

        The group's ``len(group.microbatches)`` first batches hold data, the rest are padding; under a
        pipeline its schedule runs them (flexmesh.runtime.parallel.pipeline), else they accumulate
        (flexmesh.runtime.train.accumulate). ``own``: the step's groups of this replica group.
        """
        if self._lay().pp > 1:
            loss = run_pipeline_step(self, batches, units_from_ends(chain_ends(own, len(batches))))
            return loss, marks.mark()
        return run_microbatches(self, batches, group, marks, own, self._lay().tp)

    # ---- state for checkpoints -------------------------------------------------------------------
    def part(self, kind: type[P]) -> P | None:
        """The run's part of class ``kind`` (flexmesh.runtime.train.parts), None when the run has none."""
        return next((part for part in self.parts if isinstance(part, kind)), None)

    def inner_models(self) -> list[Transformer]:
        return [m.model for m in self.modules]

    def state_module(self) -> torch.nn.Module:
        """The module whose state a checkpoint holds: the model chunk, or the chunks of an interleaved
        pipeline (a list of chunks with one group; under the model's own names with several, where
        groups of other layouts read what group 0 wrote)."""
        inner = self.inner_models()
        if len(inner) == 1:
            return inner[0]
        return Chunks(inner) if self.several else torch.nn.ModuleList(inner)

    def checkpoint_state(self, saving: bool, options) -> tuple[dict, dict]:  # noqa: ANN001
        """(model, optimizer) state dicts a checkpoint writes (``saving``) or reads into. Every group
        holds the same weights and AdamW states, so only group 0 writes; every group reads."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.place is None or (saving and self.place.group != 0):
            return {}, {}
        return get_state_dict(self.state_module(), self.optimizer, options=options)

    def load_checkpoint_state(self, model_sd: dict, optim_sd: dict, options) -> None:  # noqa: ANN001
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if self.place is not None:
            set_state_dict(self.state_module(), self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                           options=options)


