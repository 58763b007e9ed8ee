"""What ``flexmesh train --reweight`` changes in a run (the method: flexmesh.data.reweighting): a part the
trainer calls (flexmesh.runtime.train.parts). It asks for each document's loss before the step (the
trainer's forward without gradient, flexmesh.runtime.train.trainer.Trainer.doc_losses), turns them into
token weights, packs them with the micro-batches and owns the loss: the weighted token cross-entropy over
the step's label-token count; the loss it reports is the plain one."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flexmesh.data.reweighting import check_strategy, doc_weights
from flexmesh.errors import PlanError
from flexmesh.layout.step import Piece, StepSchedule
from flexmesh.runtime.model.packing import IGNORE_INDEX, PackedBatch, doc_label_tokens, pack_microbatch
from flexmesh.runtime.parallel.distributed import cpu_group
from flexmesh.runtime.train.parts import TrainingPart


class SampleReweighting(TrainingPart):
    """The weighted loss of a run with ``--reweight`` (module doc)."""

    owns_loss = True
    plain_model = True
    scores_docs = True

    def __init__(self, strategy: str, delta: float = 1.0) -> None:
        check_strategy(strategy)
        if not delta > 0:
            raise PlanError(f"--reweight-delta must be above 0, got {delta}")
        self.strategy, self.delta = strategy, delta
        self._weights: np.ndarray | None = None  # this step's token weight per document (None: not scored yet)
        self._normaliser = 1
        self._plain: torch.Tensor | None = None  # this rank's plain summed cross-entropy in the step

    def score(self, docs: Sequence[np.ndarray], schedule: StepSchedule, losses: np.ndarray) -> None:
        """The step's documents' mean losses before it (the same on every rank) -> this step's weights."""
        tokens = doc_label_tokens(docs, schedule)
        self._weights = doc_weights(np.nan_to_num(losses), tokens, self.strategy, self.delta)
        self._normaliser, self._plain = int(tokens.sum()), None

    def pack(self, docs: Sequence[np.ndarray], pieces: Sequence[Piece]) -> PackedBatch | None:
        """The plain micro-batch with each label token's weight (before scoring, the plain one)."""
        if self._weights is None:
            return None
        b = pack_microbatch(docs, pieces)
        per_token = np.concatenate([np.full(p.length, self._weights[p.seq_id]) for p in b.segments])
        w = np.where(b.labels[0].numpy() != IGNORE_INDEX, per_token, 0.0).astype(np.float32)
        return dataclasses.replace(b, weights=torch.from_numpy(w)[None, :])

    def loss(self, output: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """The micro-batch's weighted cross-entropy over the step's label tokens; the plain sum kept."""
        ce = F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), batch.labels.reshape(-1),
                             ignore_index=IGNORE_INDEX, reduction="none")
        plain = ce.detach().double().sum()
        self._plain = plain if self._plain is None else self._plain + plain
        weighted = ce if batch.weights is None else ce * batch.weights.reshape(-1)  # None: padding, no labels
        return weighted.sum() / self._normaliser

    def end_step(self, models: Sequence[nn.Module], owner: bool) -> dict[str, Any]:
        """The step's plain mean loss (counted once: on ``owner`` ranks) and its weights' range."""
        plain = torch.tensor([float(self._plain) if owner and self._plain is not None else 0.0], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(plain, group=cpu_group())
        w = self._weights[self._weights > 0] if self._weights is not None else np.ones(1)
        self._weights, self._plain = None, None
        return {"loss": float(plain.item()) / max(1, self._normaliser),
                "doc_weight": (round(float(w.min()), 6), round(float(w.max()), 6))}
