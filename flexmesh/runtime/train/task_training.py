"""What training many LoRA tasks changes in a step (docs/adapters.md); the trainer asks this.

- Only the adapters train: the base model is frozen (no gradients, no optimizer state), and AdamW
  holds one parameter group per task with that task's learning rate.
- Each task's loss is its own mean: every label token is weighted by 1 / (its task's label tokens in
  the step's global batch), so the gradient of a task's adapters is that of training it alone on its
  own documents, whatever other tasks shared its micro-batches.
- Each task has its own schedule (warm-up, then cosine to its own ``steps``; learning rate 0 after),
  its own gradient clipping, and its own loss and token count in the step's metrics.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from flexmesh.errors import PlanError, ScheduleError
from flexmesh.layout.mesh import group_layout
from flexmesh.layout.plan import Plan
from flexmesh.layout.step import StepSchedule
from flexmesh.runtime.model.lora import adapter_parameters, init_adapters
from flexmesh.runtime.model.packing import piece_label_tokens
from flexmesh.runtime.parallel.distributed import clip_grads, grad_norm
from flexmesh.runtime.train.config import TrainConfig, lr_schedule_factor
from flexmesh.spec.model import ModelSpec
from flexmesh.spec.tasks import TaskSet


def check_task_layout(tasks: TaskSet | None, plan: Plan) -> None:
    """Adapters run under data parallelism, FSDP2/ZeRO and context parallelism, and replica groups of
    different layouts, tensor parallelism; not yet over pipeline stages."""
    for g in plan.groups if tasks is not None else ():
        lay = group_layout(g)
        if lay.pp > 1:
            raise PlanError(f"LoRA tasks train under data parallelism, ZeRO/FSDP2, tensor and context parallelism "
                            f"and replica groups, not yet over pipeline stages (plan {plan.layout!r} has pp "
                            f"{lay.pp}): make the plan with `flexmesh plan --tasks`, which keeps to pp 1")


def doc_tasks(docs: Sequence[np.ndarray], tasks: TaskSet) -> np.ndarray:
    """The task slot of every document of a step (``docs.tasks``, set by the task loader)."""
    slots = getattr(docs, "tasks", None)
    if slots is None or len(slots) != len(docs):
        raise ScheduleError("a run with LoRA tasks needs every document's task: feed steps from the task loader "
                            "(flexmesh.data.tasks.TaskLoader)")
    slots = np.asarray(slots)
    if len(slots) and (slots.min() < 0 or slots.max() >= len(tasks)):
        raise ScheduleError(f"a document names task slot {int(slots.max())}; the run has {len(tasks)} tasks")
    return slots


def task_label_tokens(docs: Sequence[np.ndarray], schedule: StepSchedule, slots: np.ndarray, n: int) -> list[int]:
    """Label tokens of each task slot over the step's whole schedule (every group's micro-batches)."""
    out = [0] * n
    for g in schedule.groups:
        for mb in g.microbatches:
            for p in mb:
                out[int(slots[p.seq_id])] += piece_label_tokens(len(docs[p.seq_id]), p)
    return out


class TaskTraining:
    """Per-task optimizer groups, schedules, loss weights and clipping of one run."""

    def __init__(self, tasks: TaskSet, config: TrainConfig):
        self.tasks, self.config = tasks, config

    def init(self, model: torch.nn.Module, spec: ModelSpec) -> None:
        """Every adapter's first values: LoRA's draw, or the PEFT folder its task names (``init``)."""
        from flexmesh.runtime.state.peft import load_adapter_inits

        init_adapters(model, self.tasks, self.config.seed)
        load_adapter_inits(model, self.tasks, spec)

    def steps(self, slot: int) -> int:
        return self.tasks.tasks[slot].steps or self.config.max_steps

    def param_groups(self, modules: Sequence[torch.nn.Module]) -> list[dict]:
        """AdamW parameter groups, one per task slot (its adapters held by ``modules``; maybe none)."""
        return [{"params": ps, "lr": t.lr if t.lr is not None else self.config.lr}
                for t, ps in zip(self.tasks, adapter_parameters(modules, self.tasks), strict=True)]

    def lr_lambdas(self) -> list:
        """Per task: warm-up then cosine over its own steps, 0 once they are done."""
        c = self.config

        def factor(slot: int):  # noqa: ANN202
            steps = self.steps(slot)
            return lambda s: lr_schedule_factor(s, c.warmup_steps, steps, c.min_lr_ratio) if s < steps else 0.0

        return [factor(i) for i in range(len(self.tasks))]

    def weights(self, tokens: list[int]) -> list[float]:
        """Loss weight of a label token of each task: 1 / the task's label tokens in the step."""
        return [1.0 / n if n else 0.0 for n in tokens]

    def clip(self, groups: list[dict], leader: bool, several: bool, cpu_group: dist.ProcessGroup) -> list[float]:
        """Clip each task's gradient by its own norm limit; returns the tasks' norms. With several replica
        groups the ``leader`` group's norms are given to all (every group holds the whole gradient)."""
        norms = torch.tensor([grad_norm(g["params"]) if leader else 0.0 for g in groups], dtype=torch.float64)
        if several:
            dist.all_reduce(norms, op=dist.ReduceOp.MAX, group=cpu_group)
        for t, g, n in zip(self.tasks, groups, norms.tolist(), strict=True):
            clip_grads(g["params"], t.clip if t.clip is not None else self.config.grad_clip, n)
        return norms.tolist()
