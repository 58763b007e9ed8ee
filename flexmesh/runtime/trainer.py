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
(flexmesh.runtime.parallelize.ContextGroups); FSDP2 shards weights over all data ranks, so weights
never depend on the step's groups.

Precision (``config.dtype``, docs/precision.md): parameters, gradients and AdamW states are fp32
in both dtypes. In bf16 the forward computes in bfloat16, through FSDP2's mixed-precision policy
where FSDP2 wraps the model and under ``torch.autocast`` where it does not
(flexmesh.runtime.parallelize.autocast_bf16); gradient reductions and the loss are fp32 (the
logits are upcast before the cross-entropy).

Micro-batch counts. With pp == 1 and no ZeRO-3 layer, nothing in a micro-batch talks to all data
ranks once weights are gathered, so each rank runs only its own group's micro-batches with
gradient sync off and weights kept gathered, then one empty micro-batch (all labels ignored) with
sync on carries the step's single gradient reduction. ZeRO-3 (weights gathered per micro-batch)
and pipelines pair collectives per micro-batch, so there every rank runs the step's largest count,
groups with fewer padded with empty micro-batches.

Cut documents (flexmesh.runtime.carry): micro-batches linked by a document cut into pieces form a
chain whose forwards all run before one backward of their summed loss, the earlier pieces' keys and
values carried to the later ones, so a cut document trains as the whole one. Without pipelining
only; every step's schedule is checked first (StepSchedule.check_cuts).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from contextlib import nullcontext
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from flexmesh.errors import PlanError, ScheduleError
from flexmesh.layout.mesh import Layout, layout_from_plan, padded_microbatch_count, rank_coords, runs_in_lockstep
from flexmesh.layout.plan import Plan
from flexmesh.layout.step import Group, StepSchedule
from flexmesh.runtime.attention_kernels import USED as ATTENTION_KERNELS_USED
from flexmesh.runtime.attention_kernels import select_kernel
from flexmesh.runtime.carry import KVCarry, chain_ends, chain_plan
from flexmesh.runtime.config import StepMetrics, TrainConfig, for_device, lr_schedule_factor
from flexmesh.runtime.distributed import clip_grad_norm, compute_device, cpu_group, peak_memory_gib
from flexmesh.runtime.loss import summed_cross_entropy
from flexmesh.runtime.memory import SavedActivationMeter
from flexmesh.runtime.packing import (
    IGNORE_INDEX,
    PAD_TOKEN,
    PackedBatch,
    global_label_tokens,
    pack_microbatch,
    pad_to,
    shard_for_cp,
)
from flexmesh.runtime.parallelize import (
    ContextGroups,
    activation_dtypes,
    autocast_bf16,
    build_mesh,
    check_dtype,
    data_mesh,
    local_coords,
    parallelize,
)
from flexmesh.runtime.pipeline import (
    StageModule,
    build_pipeline_schedule,
    check_partition,
    chunks_of_rank,
    make_stages,
    split_stage,
)
from flexmesh.runtime.stragglers import ComputeClock, parse_emulation
from flexmesh.spec.model import ModelSpec


def _dummy_batch(length: int) -> PackedBatch:
    """A micro-batch with no label tokens: keeps collectives paired when a group has fewer micro-batches."""
    return PackedBatch(
        tokens=torch.full((1, length), PAD_TOKEN, dtype=torch.long),
        labels=torch.full((1, length), IGNORE_INDEX, dtype=torch.long),
        positions=torch.arange(length)[None, :],
        cu_seqlens=torch.tensor([0, length], dtype=torch.int32),
        num_label_tokens=0,
    )


def update(optimizer: torch.optim.Optimizer, lr_scheduler, device: torch.device, t0: float) -> tuple[float, float]:
    """The step's optimizer and learning-rate scheduler steps, once the gradients are final: (the
    learning rate the step used, seconds since ``t0`` once the device has finished)."""
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    lr_scheduler.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return lr, time.perf_counter() - t0


def gathered_step(row: Sequence[float], group, schedule: StepSchedule,
                  device: torch.device) -> tuple[torch.Tensor, dict]:
    """One all_gather over ``group`` of each rank's ``row`` -- its share of the loss (0 where another
    rank holds it), busy seconds, saved-activation peak bytes (negative: not metered this step),
    elapsed seconds, then anything else -- and the StepMetrics fields every trainer derives from that
    table and the schedule. Returns the table (one row per rank) and those fields."""
    mine = torch.tensor(list(row), dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows)
    step_time = float(table[:, 3].max())
    tokens = sum(p.length for g in schedule.groups for mb in g.microbatches for p in mb)
    return table, {
        "loss": float(table[:, 0].sum()), "tokens": tokens, "step_time_s": step_time,
        "tokens_per_s": tokens / step_time if step_time > 0 else 0.0, "peak_memory_gib": peak_memory_gib(device),
        "policy": schedule.policy, "requested_policy": schedule.requested_policy or schedule.policy,
        "fallback": schedule.fallback, "scheduler_s": schedule.scheduler_seconds,
        "busy_s": tuple(float(x) for x in table[:, 1]),
        "activation_peak_bytes": () if bool((table[:, 2] < 0).any()) else tuple(int(x) for x in table[:, 2]),
        "attention_kernel": "+".join(sorted(ATTENTION_KERNELS_USED)),
    }


class _GlobalLoss:
    """Summed token cross-entropy (fp32, flexmesh.runtime.loss) over the step's global label-token
    count (the pipeline loss_fn)."""

    def __init__(self) -> None:
        self.normaliser = 1

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return summed_cross_entropy(logits, labels) / self.normaliser


class _Marks:
    """Seconds from the step's start to chosen points of it, with no synchronisation before the step's
    end: CUDA events on a GPU, read by :meth:`seconds` once the step has synchronised; the host clock
    on CPU."""

    def __init__(self, device: torch.device, t0: float) -> None:
        self.cuda, self.t0 = device.type == "cuda", t0
        self.start = self._event() if self.cuda else None

    @staticmethod
    def _event():  # noqa: ANN205
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def mark(self):  # noqa: ANN201 - an event on a GPU, seconds on CPU
        return self._event() if self.cuda else time.perf_counter() - self.t0

    def seconds(self, mark) -> float:  # noqa: ANN001
        if not self.cuda:
            return float(mark)
        return self.start.elapsed_time(mark) / 1e3


class Trainer:
    """Builds the model for this rank from a Plan, then runs steps. Needs the process group joined.

    >>> # on each rank, after init_distributed():
    >>> # trainer = Trainer(plan, spec, TrainConfig(max_steps=3))
    >>> # metrics = trainer.step(docs, schedule)
    """

    def __init__(self, plan: Plan, spec: ModelSpec, config: TrainConfig, weights: str | None = None):
        if not dist.is_initialized():
            raise PlanError("the trainer needs a process group: launch with torchrun (or `flexmesh train --nproc N`)")
        world = dist.get_world_size()
        if world != plan.world_size:
            raise PlanError(
                f"plan {plan.layout!r} is for {plan.world_size} ranks but {world} were launched; launch with "
                f"--nproc-per-node {plan.world_size} (times nodes) or make a plan for {world} ranks"
            )
        if plan.num_layers != spec.num_layers:
            raise PlanError(f"plan covers {plan.num_layers} layers but model {spec.name!r} has {spec.num_layers}; "
                            "plan for this model")
        check_partition(plan, spec.num_layers)
        check_dtype(config.dtype)
        self.layout: Layout = layout_from_plan(plan)
        self.device = compute_device()
        config = for_device(config, self.device.type)
        self.plan, self.spec, self.config = plan, spec, config
        # The loss chunk by chunk inside the model's forward (flexmesh.runtime.loss): where the last stage
        # is the whole model and its head is not split over tensor-parallel ranks.
        self.chunked_loss = bool(config.chunked_loss) and self.layout.pp == 1 and self.layout.tp == 1
        self.mesh = build_mesh(self.layout, self.device.type)
        self.coords = local_coords(self.mesh)
        self.pp_group = self.mesh["pp"].get_group() if self.layout.pp > 1 else None
        lay = self.layout
        self.cp_groups = ContextGroups(lay, spec, self.coords["pp"], self.coords["tp"]) if lay.data_ranks > 1 \
            else None
        # Ranks may run different numbers of micro-batches unless something pairs collectives per
        # micro-batch across all data ranks; the scheduler and simulator price the same rule.
        self.uneven = not runs_in_lockstep(lay.pp, lay.zero)
        self._cpu_group = cpu_group()
        torch.manual_seed(config.seed)
        np.random.seed(config.seed)
        self.chunks = chunks_of_rank(plan, self.coords["pp"])
        self.modules = self._build(weights)
        self.params = [p for m in self.modules for p in m.parameters()]
        # One fused kernel on a GPU (the multi-tensor foreach path on CPU); neither across the DTensor
        # meshes tensor parallelism mixes.
        fused = self.device.type == "cuda" and self.layout.tp == 1
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=config.betas, eps=config.eps,
                                           weight_decay=config.weight_decay, foreach=self.layout.tp == 1 and not fused,
                                           fused=fused or None)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_schedule_factor(s, config.warmup_steps, config.max_steps, config.min_lr_ratio))
        self.loss_fn = _GlobalLoss()
        self._schedules: dict = {}
        self.carry = KVCarry()  # keys and values of cut documents, within one chain of micro-batches
        self.step_index = 0
        # Compute time of this rank's micro-batches, stretched where --emulate-speed names this rank
        # (flexmesh.runtime.stragglers); the pipeline path is not timed per piece.
        emulated = parse_emulation(config.emulate_speed, world)
        if emulated and self.layout.pp > 1:
            raise PlanError("--emulate-speed needs a plan without pipeline stages (pp 1): a pipeline's forwards "
                            "and backwards run inside torch's pipeline schedule, where they are not timed")
        self.emulated_speed = tuple(emulated.get(r, 1.0) for r in range(world)) if emulated else ()
        self.clock = ComputeClock(self.device.type, emulated.get(dist.get_rank(), 1.0))

    # ---- model -----------------------------------------------------------------------------------
    def _build(self, weights: str | None) -> list[StageModule]:
        from flexmesh.runtime.model import build_model

        n = len(self.plan.stages)
        dmesh = data_mesh(self.mesh) if self.layout.data_ranks > 1 else None
        modules = []
        for k, stage in self.chunks:
            # Small models are built whole on CPU with the seeded init (identical on every rank) and
            # then cut and sharded; with a weights file the model stays on meta until loaded.
            model = build_model(self.spec, device="meta" if weights else "cpu")
            if not weights:
                model.init_weights(self.config.seed)
            split_stage(model, stage.start, stage.end, first=k == 0, last=k == n - 1)
            root = StageModule(model, compute=partial(autocast_bf16, self.layout, self.config.dtype,
                                                      self.device.type))
            parallelize(model, self.layout, self.mesh, root=root, dmesh=dmesh, dtype=self.config.dtype,
                        compile=bool(self.config.compile))
            if weights:
                from flexmesh.runtime.weights import load_hf_safetensors

                root.to_empty(device=self.device)
                load_hf_safetensors(model, weights)
            else:
                root.to(self.device)
            modules.append(root)
        return modules

    def attention_kernels(self) -> list[str]:
        """The local attention kernels this run's layers will use (flexmesh.runtime.attention_kernels),
        as the run's log names them before the first step; metrics.jsonl names those that ran."""
        dtype = torch.bfloat16 if self.config.dtype == "bf16" else torch.float32
        gqa = self.spec.num_kv_heads != self.spec.num_heads
        windows = {self.spec.window_of(i) for i in range(self.spec.num_layers)}
        return sorted({select_kernel(self.device.type, dtype, w, self.spec.head_dim, gqa).name for w in windows})

    # ---- data ------------------------------------------------------------------------------------
    @property
    def data_rank(self) -> int:
        return self.coords["dp"] * self.layout.cp + self.coords["cp"]

    def my_group(self, schedule: StepSchedule) -> Group:
        """This rank's group of the step; every group must be an aligned power-of-two run (ScheduleError)."""
        lay = self.layout
        for g in schedule.groups:
            if self.cp_groups is not None:
                self.cp_groups.check(g.ranks)
            elif tuple(g.ranks) != (0,):
                raise ScheduleError(f"schedule group {list(g.ranks)} names data ranks this run lacks: it has one "
                                    "data rank (0); schedule for one data rank")
        groups = [g for g in schedule.groups if self.data_rank in g.ranks]
        if len(groups) != 1:
            raise ScheduleError(f"data rank {self.data_rank} appears in {len(groups)} groups; give each data rank "
                                f"exactly one of {lay.data_ranks} data ranks (dp {lay.dp} x cp {lay.cp})")
        return groups[0]

    def local_batches(self, docs: Sequence[np.ndarray], schedule: StepSchedule) -> list[PackedBatch]:
        """This rank's micro-batches for the step: packed, padded, cp-sliced; count-equalised unless uneven.

        The first ``len(group.microbatches)`` hold data; any after them are empty padding.
        """
        lay = self.layout
        group = self.my_group(schedule)
        cp = group.cp
        count = len(group.microbatches)
        if not self.uneven:
            count = max(len(g.microbatches) for g in schedule.groups)
            count = padded_microbatch_count(self.plan.pipeline_schedule, count, lay.pp)
        packed = [pack_microbatch(docs, mb) for mb in group.microbatches]
        quantum = cp * lay.tp  # T must split over the group's ranks, then over tp ranks (sequence parallel)
        if lay.pp > 1:  # pipelining needs one shape for every micro-batch of the step
            longest = max([b.num_tokens for b in packed] + [1])
            lengths = [-(-longest // quantum) * quantum] * count
        else:
            lengths = [-(-b.num_tokens // quantum) * quantum for b in packed] + [quantum] * (count - len(packed))
        keep = chain_plan(group)[0]
        out = []
        for i in range(count):
            b = pad_to(packed[i], lengths[i]) if i < len(packed) else _dummy_batch(lengths[i])
            if i < len(packed) and (keep[i] or any(p.start > 0 for p in b.segments)):
                b = dataclasses.replace(b, carry=self.carry.view(b.segments, keep[i]))  # a cut document's piece
            if cp > 1:
                b = shard_for_cp(b, self.data_rank - group.ranks[0], cp)
            out.append(b.to(self.device))
        return out

    def _set_context(self, group: Group) -> None:
        cp = self.cp_groups.context(group.ranks, self.data_rank) if self.cp_groups is not None else None
        for m in self.inner_models():
            m.set_cp(cp)

    # ---- one step --------------------------------------------------------------------------------
    def step(self, docs: Sequence[np.ndarray], schedule: StepSchedule) -> StepMetrics:
        """Run one step's schedule. Nothing in it waits for the device before the optimizer's step
        (losses stay on the device, timings are CUDA events); activations are metered on the steps
        ``config.meter_every`` picks."""
        t0 = time.perf_counter()
        marks = _Marks(self.device, t0)
        label_tokens = global_label_tokens(docs, schedule)
        schedule.check_cuts(self.layout.pp, dynamic_rope=self.spec.rope_scaling is not None
                            and self.spec.rope_scaling.rope_type == "dynamic")
        if label_tokens == 0:
            raise ScheduleError("the step has no label tokens (every document is a single token); "
                                "feed longer documents")
        group = self.my_group(schedule)
        batches = self.local_batches(docs, schedule)
        self._set_context(group)
        self.loss_fn.normaliser = label_tokens
        self.optimizer.zero_grad(set_to_none=True)
        self.clock.reset()
        every = self.config.meter_every or 0
        metered = every > 0 and self.step_index % every == 0
        with SavedActivationMeter() if metered else nullcontext() as meter:
            local_loss, busy = self._forward_backward(batches, group, marks, schedule)
        grad_norm = clip_grad_norm(self.params, self.config.grad_clip, self.pp_group)
        lr, elapsed = update(self.optimizer, self.lr_scheduler, self.device, t0)
        # Each data rank's loss is a partial sum of the global mean; count each once (tp ranks and
        # earlier pipeline stages hold copies or nothing). One gather carries it with the timings.
        owner = self.coords["tp"] == 0 and self.coords["pp"] == self.layout.pp - 1
        table, common = gathered_step([float(local_loss) if owner else 0.0, marks.seconds(busy),
                                       float(meter.peak_bytes) if metered else -1.0, elapsed,
                                       self.clock.total()], self._cpu_group, schedule, self.device)
        self.step_index += 1
        return StepMetrics(
            step=self.step_index, grad_norm=grad_norm, lr=lr, label_tokens=label_tokens,
            padded_tokens=sum(b.num_tokens for b in batches) * group.cp, microbatches=len(batches),
            predicted_step_time_s=schedule.predicted_step_time if schedule.predicted_step_time > 0 else None,
            predicted_busy_s=self._predicted_busy(schedule), dtype=self.config.dtype,
            microbatch_tokens=self.plan.microbatch_tokens, **common,
            compute_s=tuple(float(x) for x in table[:, 4]) if self.layout.pp == 1 else (),
            emulated_speed=self.emulated_speed,
        )

    def _predicted_busy(self, schedule: StepSchedule) -> tuple[float, ...]:
        """Per global rank: the predicted time of the group holding its data rank."""
        lay = self.layout
        by_rank = {r: g.predicted_time for g in schedule.groups for r in g.ranks}
        out = []
        for rank in range(lay.world_size):
            c = rank_coords(rank, lay.pp, lay.dp, lay.cp, lay.tp)
            out.append(float(by_rank.get(c["dp"] * lay.cp + c["cp"], 0.0)))
        return tuple(out)

    def _forward_backward(self, batches: list[PackedBatch], group: Group, marks: _Marks,
                          schedule: StepSchedule) -> tuple[torch.Tensor, object]:
        """Run the step's micro-batches; returns (this rank's loss, on the device; the mark where its
        own micro-batches were done, read by ``marks.seconds`` after the step).

        The group's ``len(group.microbatches)`` first batches hold data, the rest are padding. On the
        uneven path one more empty micro-batch of ``cp * tp`` tokens carries the gradient reduction,
        after the busy time is taken.
        """
        own, cp = len(group.microbatches), group.cp
        if self.layout.pp > 1:
            loss = self._pipeline_step(batches)
            return loss, marks.mark()
        root = self.modules[0]
        sync = hasattr(root, "set_requires_gradient_sync")  # FSDP2 or replicate over the data ranks
        # the step's loss summed in float64, as Python floats summed it before it stayed on the device
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        busy = None
        # A chain of micro-batches linked by a cut document runs all its forwards, then one backward of
        # their summed loss (flexmesh.runtime.carry); ranks in lockstep end chains at the same places.
        ends = chain_ends([group] if self.uneven else list(schedule.groups), len(batches))
        chain: list[torch.Tensor] = []

        def run(b: PackedBatch, end: bool = True, timed: bool = True) -> torch.Tensor:
            # Only this rank's own micro-batches are timed (and stretched when emulating a slow rank):
            # the empty one carrying the gradient reduction is communication, padding ones no work.
            with self.clock.piece() if timed else nullcontext():
                if self.chunked_loss:  # the model's forward ends in the loss (flexmesh.runtime.loss)
                    loss = root(b.tokens, b, labels=b.labels) / self.loss_fn.normaliser
                else:
                    loss = self.loss_fn(root(b.tokens, b), b.labels)
            chain.append(loss)
            if end:
                with self.clock.piece() if timed else nullcontext():
                    sum(chain).backward()
                chain.clear()
                self.carry.clear()
            return loss.detach().double()

        if self.uneven:
            if sync:
                # Accumulate gradients locally and keep weights gathered: with FSDP2's default
                # re-shard after each backward, every micro-batch's forward would gather weights over
                # all data ranks again, and ranks with different counts would wait on each other
                # forever (seen on torch 2.13 gloo). The step's one weight gather happens in each
                # rank's first forward, the one reduction in the empty micro-batch below.
                root.set_requires_gradient_sync(False)
                root.set_reshard_after_backward(False)
            for b, end in zip(batches, ends, strict=True):
                total = total + run(b, end)
            busy = marks.mark()
            if sync:
                root.set_requires_gradient_sync(True)
                root.set_reshard_after_backward(True)
                empty = _dummy_batch(cp * self.layout.tp)
                if cp > 1:
                    empty = shard_for_cp(empty, self.data_rank - group.ranks[0], cp)
                total = total + run(empty.to(self.device), timed=False)
            return total, busy
        for i, b in enumerate(batches):
            if i == own:
                busy = marks.mark()
            if sync:  # reduce gradients once, after the last micro-batch
                root.set_requires_gradient_sync(i == len(batches) - 1)
            total = total + run(b, ends[i], timed=i < own)
        return total, busy if busy is not None else marks.mark()

    def _pipeline_step(self, batches: list[PackedBatch]) -> float:
        m, length = len(batches), batches[0].num_tokens
        key = (m, length)
        if key not in self._schedules:
            hidden, logits = activation_dtypes(self.layout, self.config.dtype)
            stages = make_stages(self.modules, [k for k, _ in self.chunks], len(self.plan.stages), self.device,
                                 self.pp_group, tokens=length, tp=self.layout.tp, hidden=self.spec.hidden,
                                 vocab=self.spec.vocab, dtype=hidden, logits_dtype=logits)
            self._schedules[key] = build_pipeline_schedule(stages, self.plan.pipeline_schedule, m, self.loss_fn)
        sched = self._schedules[key]
        for mod in self.modules:
            mod.feed(batches)
        first = self.coords["pp"] == 0
        last = self.coords["pp"] == self.layout.pp - 1
        tokens = torch.cat([b.tokens for b in batches]) if first else None
        labels = torch.cat([b.labels for b in batches]) if last else None
        losses: list = []
        args = (tokens,) if first else ()
        sched.step(*args, target=labels, losses=losses if last else None, return_outputs=False)
        for mod in self.modules:
            if mod.consumed() != m:
                raise RuntimeError(f"pipeline stage ran {mod.consumed()} forwards for {m} micro-batches")
        return float(sum(float(x.detach()) for x in losses)) if last else 0.0

    # ---- state for checkpoints -------------------------------------------------------------------
    def inner_models(self) -> list[torch.nn.Module]:
        return [m.model for m in self.modules]

    def state_module(self) -> torch.nn.Module:
        """The module whose state a checkpoint holds: the model chunk, or a list of chunks (interleaved)."""
        inner = self.inner_models()
        return inner[0] if len(inner) == 1 else torch.nn.ModuleList(inner)

