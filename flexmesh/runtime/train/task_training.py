"""What training many LoRA tasks changes in a run (docs/adapters.md): a part the trainer calls
(flexmesh.runtime.train.parts).

- Only the adapters train: the base model is frozen (no gradients, no optimizer state), and AdamW
  holds one parameter group per task with that task's learning rate.
- Each task's loss is its own mean: every label token is weighted by 1 / (its task's label tokens in
  the step's global batch), so the gradient of a task's adapters is that of training it alone on its
  own documents, whatever other tasks shared its micro-batches.
- Each task has its own schedule (warm-up, then cosine to its own ``steps``; learning rate 0 after),
  its own gradient clipping, and its own loss and token count in the step's metrics.
- Packing lays a micro-batch's documents task by task and records each token's loss weight
  (flexmesh.runtime.model.packing.pack_microbatch); the adapters split under tensor parallelism as their
  projections (flexmesh.runtime.parallel.adapters), whose replicated factors' gradients are summed over
  the tp ranks after backward. Under a pipeline each stage holds its layers' adapters, the last stage
  weighs every micro-batch's loss (flexmesh.runtime.parallel.pipeline.MicroBatchLoss) and each task's
  gradient norm sums over the stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Sized
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from flexmesh.errors import ScheduleError
from flexmesh.layout.step import Piece, StepSchedule
from flexmesh.runtime.model.lora import adapter_parameters, attach_adapters, init_adapters
from flexmesh.runtime.model.loss import weighted_cross_entropy
from flexmesh.runtime.model.packing import PackedBatch, doc_label_tokens, empty_batch, pack_microbatch
from flexmesh.runtime.parallel.adapters import tp_sum_replicated
from flexmesh.runtime.parallel.distributed import clip_grads, cpu_group, grad_norm
from flexmesh.runtime.state.peft import load_adapter_inits
from flexmesh.runtime.state.weights import LoadReport
from flexmesh.runtime.train.config import TrainConfig, lr_schedule_factor
from flexmesh.runtime.train.parts import TrainingPart
from flexmesh.spec.model import ModelSpec
from flexmesh.spec.tasks import TaskSet


def doc_tasks(docs: Sequence[np.ndarray], tasks: Sized) -> np.ndarray:
    """The task slot of every document of a step (``docs.tasks``, set by the task loader; a data mixture's
    loader sets each document's domain there: ``tasks`` is then the domains' names)."""
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
    return np.bincount(slots, weights=doc_label_tokens(docs, schedule), minlength=n).astype(np.int64).tolist()


class TaskTraining(TrainingPart):
    """The adapters of ``tasks`` through a run: frozen base, per-task optimizer groups, schedules, loss
    weights, clipping and metrics (module doc). :meth:`of` makes it for a run with tasks."""

    owns_loss = True

    def __init__(self, tasks: TaskSet, spec: ModelSpec, config: TrainConfig) -> None:
        self.tasks, self.spec, self.config = tasks, spec, config
        self.task_loss = torch.zeros(len(tasks), dtype=torch.float64)  # each task's own mean loss, this rank's part
        self.task_tokens: list[int] = []  # each task's label tokens in the step
        self._slots: np.ndarray | None = None  # the task slot of each of the step's documents
        self._weights: list[float] = []  # the loss weight of a label token of each task, this step

    @classmethod
    def of(cls, tasks: TaskSet | None, spec: ModelSpec, config: TrainConfig) -> TaskTraining | None:
        return cls(tasks, spec, config) if tasks is not None else None

    def steps(self, slot: int) -> int:
        return self.tasks.tasks[slot].steps or self.config.max_steps

    # ---- building ------------------------------------------------------------------------------------
    def adapt(self, chunk: nn.Module) -> None:
        """Freeze the base and give every layer the tasks' adapters (zeros until :meth:`ready`)."""
        attach_adapters(chunk, self.spec, self.tasks)

    def ready(self, chunk: nn.Module, loaded: LoadReport | None) -> None:
        """Every adapter's first values: LoRA's draw, or the PEFT folder its task names (``init``)."""
        init_adapters(chunk, self.tasks, self.config.seed)
        load_adapter_inits(chunk, self.tasks, self.spec)

    def param_groups(self, modules: Sequence[nn.Module]) -> list[dict]:
        """AdamW parameter groups, one per task slot (its adapters held by ``modules``; maybe none)."""
        return [{"params": ps, "lr": t.lr if t.lr is not None else self.config.lr}
                for t, ps in zip(self.tasks, adapter_parameters(modules, self.tasks), strict=True)]

    def lr_lambdas(self) -> list[Callable[[int], float]]:
        """Per task: warm-up then cosine over its own steps, 0 once they are done."""
        c = self.config

        def factor(slot: int) -> Callable[[int], float]:
            steps = self.steps(slot)
            return lambda s: lr_schedule_factor(s, c.warmup_steps, steps, c.min_lr_ratio) if s < steps else 0.0

        return [factor(i) for i in range(len(self.tasks))]

    def optimizer(self, modules: Sequence[nn.Module]) -> tuple[list[dict], list[Callable[[int], float]]]:
        return self.param_groups(modules), self.lr_lambdas()

    # ---- each step -----------------------------------------------------------------------------------
    def weights(self, tokens: list[int]) -> list[float]:
        """Loss weight of a label token of each task: 1 / the task's label tokens in the step."""
        return [1.0 / n if n else 0.0 for n in tokens]

    def begin_step(self, docs: Sequence[np.ndarray], schedule: StepSchedule, models: Sequence[nn.Module]) -> None:
        self._slots = doc_tasks(docs, self.tasks)
        self.task_tokens = task_label_tokens(docs, schedule, self._slots, len(self.tasks))
        self._weights = self.weights(self.task_tokens)
        self.task_loss.zero_()

    def pack(self, docs: Sequence[np.ndarray], pieces: Sequence[Piece]) -> PackedBatch:
        """The micro-batch laid out task by task, each label token weighted by its task's weight."""
        return pack_microbatch(docs, pieces, self._slots, self._weights)

    def empty(self, length: int) -> PackedBatch:
        return empty_batch(length, tasks=True)  # padding of a LoRA run: every adapter runs, with zero gradient

    def loss(self, output: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """The micro-batch's part of every task's own mean loss, their sum the loss to differentiate."""
        assert batch.weights is not None
        slots = torch.tensor([s for s, n in batch.task_runs for _ in range(n)], device=batch.weights.device)
        loss, per_task = weighted_cross_entropy(output, batch.labels, batch.weights, slots, len(self.task_loss))
        self.task_loss += per_task.cpu()
        return loss

    def after_backward(self, models: Sequence[nn.Module]) -> None:
        tp_sum_replicated(models)  # adapter factors replicated over tp ranks hold partial gradients

    def clip(self, param_groups: list[dict], pp_group: Any, leader: bool, several: bool) -> float:
        """Clip each task's gradient by its own norm limit (over the pipeline's stages); the norm of the
        tasks' norms. With several replica groups the ``leader`` group's norms are given to all (every
        group holds the whole gradient)."""
        norms = torch.tensor([grad_norm(g["params"], pp_group) if leader else 0.0 for g in param_groups],
                             dtype=torch.float64)
        if several:
            dist.all_reduce(norms, op=dist.ReduceOp.MAX, group=cpu_group())
        for t, g, n in zip(self.tasks, param_groups, norms.tolist(), strict=True):
            clip_grads(g["params"], t.clip if t.clip is not None else self.config.grad_clip, n)
        return float(sum(n * n for n in norms.tolist()) ** 0.5)

    def end_step(self, models: Sequence[nn.Module], owner: bool) -> dict[str, Any]:
        """Each task's own mean loss (a part on every data rank, counted once) and the step's loss: their
        mean over the tasks that trained."""
        self.task_loss *= float(owner)
        dist.all_reduce(self.task_loss, group=cpu_group())
        return {"loss": float(self.task_loss.sum()) / max(1, sum(1 for n in self.task_tokens if n)),
                "tasks": self.tasks.names, "task_loss": tuple(self.task_loss.tolist()),
                "task_tokens": tuple(self.task_tokens)}

    def manifest(self) -> dict[str, Any]:
        return {"tasks": [t.to_dict() for t in self.tasks]}  # what `flexmesh export` writes PEFT adapters from
