"""The training loop: run a Plan's layout on StepSchedules, step by step, and measure.

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

Micro-batch counts. With pp == 1 and no ZeRO-3 layer, nothing in a micro-batch talks to all data
ranks once weights are gathered, so each rank runs only its own group's micro-batches with
gradient sync off and weights kept gathered, then one empty micro-batch (all labels ignored) with
sync on carries the step's single gradient reduction. ZeRO-3 (weights gathered per micro-batch)
and pipelines pair collectives per micro-batch, so there every rank runs the step's largest count,
groups with fewer padded with empty micro-batches.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from flexmesh.data.packing import IGNORE_INDEX, PAD_TOKEN, PackedBatch, global_label_tokens, pack_microbatch, pad_to, \
    shard_for_cp
from flexmesh.errors import PlanError, ScheduleError
from flexmesh.layout.plan import Plan
from flexmesh.layout.mesh import Layout, layout_from_plan, rank_coords
from flexmesh.runtime.memory import SavedActivationMeter
from flexmesh.runtime.parallelize import ContextGroups, build_mesh, data_mesh, local_coords, parallelize
from flexmesh.runtime.pipeline import StageModule, build_schedule, check_partition, chunks_of_rank, make_stages, \
    padded_microbatch_count, split_stage
from flexmesh.layout.step import Group, StepSchedule
from flexmesh.spec.model import ModelSpec


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int
    lr: float = 3e-4
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at max_steps
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    seed: int = 0
    checkpoint_every: int = 0  # steps; 0: only at the end when out_dir is set
    out_dir: str | None = None  # metrics.jsonl and checkpoints/ go here
    resume: bool = True  # continue from out_dir/checkpoints when one exists
    progress: bool = True  # live progress line on rank 0


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimiser step ``step`` (0-based).

    Linear warmup over ``warmup_steps`` then a half cosine down to ``min_ratio`` at ``max_steps``.

    >>> [round(lr_factor(s, 2, 6, 0.1), 3) for s in range(6)]
    [0.5, 1.0, 1.0, 0.868, 0.55, 0.232]
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class StepMetrics:
    """What one step did and how long it took (fields and units in docs/metrics.md).

    Lists are indexed by global rank; every rank gets the same lists (gathered once per step).
    """

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int  # real (unpadded) tokens of the global batch
    label_tokens: int
    padded_tokens: int  # tokens this rank's data group ran, padding included
    microbatches: int
    step_time_s: float  # the slowest rank's wall time, packing to optimiser step
    tokens_per_s: float
    peak_memory_gib: float | None  # this rank's allocator peak (GPU) or resident set (CPU)
    policy: str = ""  # policy of the schedule that ran
    requested_policy: str = ""  # policy asked for; differs from ``policy`` after a fallback
    fallback: bool = False  # the background scheduler was late and the fallback schedule ran
    scheduler_s: float = 0.0  # seconds the schedule that ran took to compute
    predicted_step_time_s: float | None = None  # the schedule's prediction, None when it has none
    predicted_busy_s: tuple[float, ...] = ()  # per rank: its group's predicted time
    busy_s: tuple[float, ...] = ()  # per rank: step start until its own micro-batches were done
    activation_peak_bytes: tuple[int, ...] = ()  # per rank: peak bytes saved for backward

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in ((k, getattr(self, k)) for k in self.__dataclass_fields__)}


class StepSource(Protocol):
    """Where global batches come from: documents of the step and their StepSchedule.

    ``state_dict``/``load_state_dict`` make resume exact (the loader position is checkpointed).
    """

    def __next__(self) -> tuple[Sequence[np.ndarray], StepSchedule]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class ListSource:
    """A fixed list of steps as a resumable source: (docs, schedule) pairs for the trainer, or global
    batches for an AdaptiveSource to schedule; used by tests and the benchmark."""

    steps: list
    position: int = 0

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        if self.position >= len(self.steps):
            raise StopIteration
        self.position += 1
        return self.steps[self.position - 1]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def init_distributed(timeout_s: float = 600.0) -> None:
    """Join the process group torchrun describes (NCCL on GPUs, gloo on CPUs); no-op when joined."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        import os

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


_CPU_GROUPS: dict = {}


def cpu_group():
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


def _dummy_batch(length: int) -> PackedBatch:
    """A micro-batch with no label tokens: keeps collectives paired when a group has fewer micro-batches."""
    return PackedBatch(
        tokens=torch.full((1, length), PAD_TOKEN, dtype=torch.long),
        labels=torch.full((1, length), IGNORE_INDEX, dtype=torch.long),
        positions=torch.arange(length)[None, :],
        cu_seqlens=torch.tensor([0, length], dtype=torch.int32),
        num_label_tokens=0,
    )


def _peak_memory_gib(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    except (ImportError, OSError):
        return None


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, pp_group=None) -> float:
    """Global L2 norm of the gradients (DTensors of any mesh, plain tensors), clipped to ``max_norm``.

    ``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms, which fails when DTensors live on
    different meshes (FSDP-only weights next to FSDP x TP ones), so norms are taken per (mesh,
    placement) group with ``get_total_norm`` and made global with ``full_tensor``; pipeline stages
    hold disjoint weights, so their squared norms are summed over the pp group.
    """
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        if p.grad is not None:
            g = p.grad
            key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
            groups.setdefault(key, []).append(g)
    device = params[0].device if params else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        sq = sq + n.float().to(device) ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, group=pp_group)
    total = float(sq.sqrt())
    if max_norm > 0 and total > 0:
        coef = min(1.0, max_norm / (total + 1e-6))  # torch.nn.utils.clip_grad_norm_'s formula
        if coef < 1.0:
            for grads in groups.values():
                for g in grads:
                    g.mul_(coef)
    return total


class _GlobalLoss:
    """Summed token cross-entropy over the step's global label-token count (the pipeline loss_fn)."""

    def __init__(self) -> None:
        self.normaliser = 1

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
        return loss / self.normaliser


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
        self.plan, self.spec, self.config = plan, spec, config
        self.layout: Layout = layout_from_plan(plan)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.mesh = build_mesh(self.layout, self.device.type)
        self.coords = local_coords(self.mesh)
        self.pp_group = self.mesh["pp"].get_group() if self.layout.pp > 1 else None
        lay = self.layout
        self.cp_groups = ContextGroups(lay, spec, self.coords["pp"], self.coords["tp"]) if lay.data_ranks > 1 \
            else None
        # Ranks may run different numbers of micro-batches unless something pairs collectives per
        # micro-batch across all data ranks: ZeRO-3's weight gathers, or a pipeline schedule.
        self.uneven = lay.pp == 1 and not any(z == 3 for z in lay.zero)
        self._cpu_group = cpu_group()
        torch.manual_seed(config.seed)
        np.random.seed(config.seed)
        self.chunks = chunks_of_rank(plan, self.coords["pp"])
        self.modules = self._build(weights)
        self.params = [p for m in self.modules for p in m.parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=config.betas, eps=config.eps,
                                           weight_decay=config.weight_decay, foreach=self.layout.tp == 1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, config.warmup_steps, config.max_steps, config.min_lr_ratio))
        self.loss_fn = _GlobalLoss()
        self._schedules: dict = {}
        self.step_index = 0

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
            root = StageModule(model)
            parallelize(model, self.layout, self.mesh, root=root, dmesh=dmesh)
            if weights:
                from flexmesh.runtime.weights import load_hf_safetensors

                root.to_empty(device=self.device)
                load_hf_safetensors(model, weights)
            else:
                root.to(self.device)
            modules.append(root)
        return modules

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
        out = []
        for i in range(count):
            b = pad_to(packed[i], lengths[i]) if i < len(packed) else _dummy_batch(lengths[i])
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
        t0 = time.perf_counter()
        label_tokens = global_label_tokens(docs, schedule)
        if label_tokens == 0:
            raise ScheduleError("the step has no label tokens (every document is a single token); feed longer documents")
        group = self.my_group(schedule)
        batches = self.local_batches(docs, schedule)
        self._set_context(group)
        self.loss_fn.normaliser = label_tokens
        self.optimizer.zero_grad(set_to_none=True)
        with SavedActivationMeter() as meter:
            local_loss, busy = self._forward_backward(batches, group, t0)
        grad_norm = clip_grad_norm(self.params, self.config.grad_clip, self.pp_group)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        # Each data rank's loss is a partial sum of the global mean; count each once (tp ranks and
        # earlier pipeline stages hold copies or nothing). One gather carries it with the timings.
        owner = self.coords["tp"] == 0 and self.coords["pp"] == self.layout.pp - 1
        mine = torch.tensor([local_loss if owner else 0.0, busy, float(meter.peak_bytes), elapsed],
                            dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine, group=self._cpu_group)
        table = torch.stack(rows)
        step_time = float(table[:, 3].max())
        tokens = sum(p.length for g in schedule.groups for mb in g.microbatches for p in mb)
        self.step_index += 1
        return StepMetrics(
            step=self.step_index, loss=float(table[:, 0].sum()), grad_norm=grad_norm, lr=lr, tokens=tokens,
            label_tokens=label_tokens, padded_tokens=sum(b.num_tokens for b in batches) * group.cp,
            microbatches=len(batches), step_time_s=step_time,
            tokens_per_s=tokens / step_time if step_time > 0 else 0.0,
            peak_memory_gib=_peak_memory_gib(self.device),
            policy=schedule.policy, requested_policy=schedule.requested_policy or schedule.policy,
            fallback=schedule.fallback, scheduler_s=schedule.scheduler_seconds,
            predicted_step_time_s=schedule.predicted_step_time if schedule.predicted_step_time > 0 else None,
            predicted_busy_s=self._predicted_busy(schedule),
            busy_s=tuple(float(x) for x in table[:, 1]),
            activation_peak_bytes=tuple(int(x) for x in table[:, 2]),
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

    def _forward_backward(self, batches: list[PackedBatch], group: Group, t0: float) -> tuple[float, float]:
        """Run the step's micro-batches; returns (this rank's loss, seconds until its own were done).

        The group's ``len(group.microbatches)`` first batches hold data, the rest are padding. On the
        uneven path one more empty micro-batch of ``cp * tp`` tokens carries the gradient reduction,
        after the busy time is taken.
        """
        own, cp = len(group.microbatches), group.cp

        def since_start() -> float:
            if self.device.type == "cuda":  # kernels run asynchronously: time what has finished
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        if self.layout.pp > 1:
            loss = self._pipeline_step(batches)
            return loss, since_start()
        root = self.modules[0]
        sync = hasattr(root, "set_requires_gradient_sync")  # FSDP2 or replicate over the data ranks
        total, busy = 0.0, None

        def run(b: PackedBatch) -> float:
            loss = self.loss_fn(root(b.tokens, b), b.labels)
            loss.backward()
            return float(loss.detach())

        if self.uneven:
            if sync:
                # Accumulate gradients locally and keep weights gathered: with FSDP2's default
                # re-shard after each backward, every micro-batch's forward would gather weights over
                # all data ranks again, and ranks with different counts would wait on each other
                # forever (seen on torch 2.13 gloo). The step's one weight gather happens in each
                # rank's first forward, the one reduction in the empty micro-batch below.
                root.set_requires_gradient_sync(False)
                root.set_reshard_after_backward(False)
            for b in batches:
                total += run(b)
            busy = since_start()
            if sync:
                root.set_requires_gradient_sync(True)
                root.set_reshard_after_backward(True)
                empty = _dummy_batch(cp * self.layout.tp)
                if cp > 1:
                    empty = shard_for_cp(empty, self.data_rank - group.ranks[0], cp)
                total += run(empty.to(self.device))
            return total, busy
        for i, b in enumerate(batches):
            if i == own:
                busy = since_start()
            if sync:  # reduce gradients once, after the last micro-batch
                root.set_requires_gradient_sync(i == len(batches) - 1)
            total += run(b)
        return total, busy if busy is not None else since_start()

    def _pipeline_step(self, batches: list[PackedBatch]) -> float:
        m, length = len(batches), batches[0].num_tokens
        key = (m, length)
        if key not in self._schedules:
            dtype = next(self.modules[0].parameters()).dtype
            stages = make_stages(self.modules, [k for k, _ in self.chunks], len(self.plan.stages), self.device,
                                 self.pp_group, tokens=length, tp=self.layout.tp, hidden=self.spec.hidden,
                                 vocab=self.spec.vocab, dtype=dtype)
            self._schedules[key] = build_schedule(stages, self.plan.pipeline_schedule, m, self.loss_fn)
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


# ---- the loop --------------------------------------------------------------------------------------
def fit(trainer: Trainer, source: StepSource, config: TrainConfig) -> list[StepMetrics]:
    """Run steps until ``config.max_steps``: resume, log metrics.jsonl, show progress, checkpoint.

    Rank 0 appends one JSON object per step to ``<out_dir>/metrics.jsonl`` (fields in
    docs/metrics.md); on resume, lines of steps after the checkpoint are dropped first so the file
    never holds a step twice. Checkpoints go to ``<out_dir>/checkpoints`` every
    ``checkpoint_every`` steps and at the end.
    """
    import json
    from pathlib import Path

    from flexmesh.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    out = Path(config.out_dir) if config.out_dir else None
    ckpt_root = out / "checkpoints" if out else None
    rank0 = dist.get_rank() == 0
    if ckpt_root is not None and config.resume:
        found = latest_checkpoint(ckpt_root)
        if found is not None:
            source.load_state_dict(load_checkpoint(found, trainer))
    metrics_file = out / "metrics.jsonl" if out else None
    if rank0 and metrics_file is not None:
        out.mkdir(parents=True, exist_ok=True)
        kept = []
        if metrics_file.exists():
            kept = [ln for ln in metrics_file.read_text().splitlines()
                    if ln.strip() and json.loads(ln)["step"] <= trainer.step_index]
        metrics_file.write_text("".join(ln + "\n" for ln in kept))
    history: list[StepMetrics] = []
    progress = _Progress(config.max_steps, trainer.step_index) if rank0 and config.progress else None
    try:
        while trainer.step_index < config.max_steps:
            try:
                docs, schedule = next(source)
            except StopIteration:
                break
            m = trainer.step(docs, schedule)
            history.append(m)
            if rank0 and metrics_file is not None:
                with metrics_file.open("a") as f:
                    f.write(json.dumps(m.to_dict()) + "\n")
            if progress is not None:
                progress.update(m)
            every = config.checkpoint_every
            due = (every and m.step % every == 0) or m.step == config.max_steps
            if ckpt_root is not None and due:
                save_checkpoint(ckpt_root, m.step, trainer, source.state_dict())
    finally:
        if progress is not None:
            progress.close()
        if hasattr(source, "close"):  # e.g. AdaptiveSource's background scheduler
            source.close()
    return history


class _Progress:
    """A live one-line progress bar with loss, tokens/s and step time (rich)."""

    def __init__(self, total: int, done: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                             TimeRemainingColumn(), transient=False)
        self._task = self._bar.add_task("", total=total, completed=done)
        self._bar.start()

    def update(self, m: StepMetrics) -> None:
        self._bar.update(self._task, completed=m.step, description=(
            f"loss {m.loss:.4f}  {m.tokens_per_s:,.0f} tok/s  {m.step_time_s * 1e3:.0f} ms/step  lr {m.lr:.2e}  "
            f"{m.policy}{' (fallback)' if m.fallback else ''}"))

    def close(self) -> None:
        self._bar.stop()
