"""Features of a run as parts: the Trainer calls every part's hooks at fixed points, never a feature by name.

A part is what one feature changes in training: the LoRA adapters of many tasks
(flexmesh.runtime.train.task_training.TaskTraining) or the placement, balancing and routing records of a
mixture of experts (flexmesh.runtime.train.expert_training.ExpertTraining). A run holds the parts its
job needs (none for plain pre-training) and the Trainer calls, part by part in that order::

    building    adapt(chunk)                a model chunk cut from the whole model, before parallelism
                parallel_options()          what parallelize needs from the part (keyword arguments)
                ready(chunk, loaded)        the chunk holds its weights (``loaded``: the weights file's report)
                optimizer(modules)          AdamW's parameter groups and their LR factors   [answers]
    each step   score(docs, schedule, losses)           each document's mean loss from a forward without
                                            gradient before the step, to the parts that scores_docs
                begin_step(docs, schedule, models)      before any micro-batch
                pack(docs, pieces) / empty(length)      one micro-batch's tensors        [answers]
                observe(output, batch)      a micro-batch's logits, read by the parts that reads_logits
                loss(output, batch)         a micro-batch's loss, by the part that owns_loss
                after_backward(models)      gradients the part's layers leave partial on this rank
                clip(param_groups, pp_group, leader, several)   the norm and clipping [answers]
                end_step(models, owner)     its fields of the step's StepMetrics (collective)
    checkpoints manifest()                  what the checkpoint's manifest records of the part
                state() / load_state(state) what the part carries from step to step (rank files)

A hook marked [answers] returns None to leave the trainer's own way; the first part that answers
decides. Every other hook does nothing by default. Hooks that run collectives (``begin_step``,
``end_step``) are called on every rank, a device the plan leaves unused included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from flexmesh.layout.step import Piece, StepSchedule
from flexmesh.runtime.model.packing import PackedBatch
from flexmesh.runtime.state.weights import LoadReport


class TrainingPart:
    """The hooks of a feature (module doc); a subclass overrides the ones it needs."""

    owns_loss = False  # whether :meth:`loss` computes every micro-batch's loss (the chunked loss is then off)
    reads_logits = False  # whether :meth:`observe` reads every micro-batch's logits (the chunked loss is then off)
    plain_model = False  # whether the model and its loss stay the plain model's (held-out evaluation then runs)
    scores_docs = False  # whether :meth:`score` needs the step's documents' losses before it (a forward more)

    # ---- building ----------------------------------------------------------------------------------
    def adapt(self, chunk: nn.Module) -> None:
        """Change a model chunk (a Transformer or a pipeline stage of one) before parallelism is applied."""

    def parallel_options(self) -> dict[str, Any]:
        """Keyword arguments of flexmesh.runtime.parallel.parallelize.parallelize this part supplies."""
        return {}

    def ready(self, chunk: nn.Module, loaded: LoadReport | None) -> None:
        """The chunk is parallelised and holds its weights (``loaded``: None when freshly initialised)."""

    def optimizer(self, modules: Sequence[nn.Module]) -> tuple[list[dict], list[Callable[[int], float]]] | None:
        """AdamW's parameter groups and one learning-rate factor per group, or None for the trainer's."""
        return None

    # ---- each step ---------------------------------------------------------------------------------
    def score(self, docs: Sequence[np.ndarray], schedule: StepSchedule, losses: np.ndarray) -> None:
        """Each of the step's documents' mean token loss under the current weights (every rank, the same
        values; NaN where a document has no label token), before :meth:`begin_step` (a part that
        ``scores_docs``)."""

    def begin_step(self, docs: Sequence[np.ndarray], schedule: StepSchedule, models: Sequence[nn.Module]) -> None:
        """Before the step's first micro-batch (every rank; ``models``: this rank's chunks, maybe none)."""

    def pack(self, docs: Sequence[np.ndarray], pieces: Sequence[Piece]) -> PackedBatch | None:
        """One micro-batch's tensors, or None for flexmesh.runtime.model.packing.pack_microbatch."""
        return None

    def empty(self, length: int) -> PackedBatch | None:
        """A micro-batch of ``length`` tokens without labels, or None for packing's empty_batch."""
        return None

    def observe(self, output: torch.Tensor, batch: PackedBatch) -> None:
        """Read a micro-batch's logits ``output`` without changing the loss (a part that ``reads_logits``)."""

    def loss(self, output: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """A micro-batch's loss from the model's ``output`` (called on the part that ``owns_loss``)."""
        raise NotImplementedError

    def after_backward(self, models: Sequence[nn.Module]) -> None:
        """After the step's last backward on a rank that trains (before gradients leave the replica group)."""

    def clip(self, param_groups: list[dict], pp_group: Any, leader: bool, several: bool) -> float | None:
        """Clip the gradients; returns the norm reported, or None for the trainer's global clipping.
        ``pp_group``: this rank's pipeline ranks (None without stages), whose disjoint weights' squared
        norms add up; ``leader``: a rank of replica group 0, whose norms every group takes when there are
        ``several``."""
        return None

    def end_step(self, models: Sequence[nn.Module], owner: bool) -> dict[str, Any]:
        """After the optimizer's step (every rank, collectively): the part's fields of StepMetrics.
        ``owner``: this rank counts its data rank's loss (tp index 0 on the last pipeline stage)."""
        return {}

    # ---- checkpoints --------------------------------------------------------------------------------
    def manifest(self) -> dict[str, Any]:
        """Entries of a checkpoint's manifest (what `flexmesh export` and a resume read back)."""
        return {}

    def state(self) -> dict[str, Any]:
        """What the part carries from step to step, saved in each rank's file of a checkpoint (plain values)."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state` from a checkpoint."""


def first_answer(parts: Sequence[TrainingPart], hook: str, *args: Any) -> Any:
    """The first part's answer (not None) to ``hook(*args)``, or None when no part answers."""
    for part in parts:
        answer = getattr(part, hook)(*args)
        if answer is not None:
            return answer
    return None
