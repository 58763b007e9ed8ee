"""What a data mixture changes in a run (``flexmesh train --domains``; docs/mixtures.md): a part the
trainer calls (flexmesh.runtime.train.parts).

Nothing of the loss that is differentiated: the trainer's own loss runs as without domains, so a
``static`` mixture trains exactly as the same documents fed without it. The part reads each micro-batch's
logits once more, without gradient, for each domain's summed token cross-entropy (that is why a run with
domains computes whole logits rather than the chunked loss), sums them over the data ranks after the
step, and gives the step's mean loss per domain to the mixture (flexmesh.data.mixture.Mixture), which
moves the weights the next batches are drawn with. The mixture's state is checkpointed with the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flexmesh.data.mixture import Mixture
from flexmesh.layout.step import StepSchedule
from flexmesh.runtime.model.packing import IGNORE_INDEX, PackedBatch, token_docs
from flexmesh.runtime.parallel.distributed import cpu_group
from flexmesh.runtime.train.parts import TrainingPart
from flexmesh.runtime.train.task_training import doc_tasks, task_label_tokens


class MixtureTraining(TrainingPart):
    """The domains' losses of each step, and the mixture they move (module doc)."""

    reads_logits = True
    plain_model = True

    def __init__(self, mixture: Mixture) -> None:
        self.mixture = mixture
        k = len(mixture.names)
        self._sums: torch.Tensor | None = None  # this rank's summed cross-entropy per domain (and padding)
        self.tokens: list[int] = [0] * k  # each domain's label tokens in the step's global batch
        self._slots: np.ndarray | None = None

    def begin_step(self, docs: Sequence[np.ndarray], schedule: StepSchedule, models: Sequence[nn.Module]) -> None:
        self._slots = doc_tasks(docs, self.mixture.names)
        self.tokens = task_label_tokens(docs, schedule, self._slots, len(self.mixture.names))
        if self._sums is not None:
            self._sums.zero_()

    def observe(self, output: torch.Tensor, batch: PackedBatch) -> None:
        """Add micro-batch ``batch``'s summed cross-entropy per domain (its logits ``output``; no gradient, no
        wait for the device: the sums stay there until the step ends)."""
        assert self._slots is not None
        k = len(self.mixture.names)
        doc = token_docs(batch)
        domain = np.where(doc >= 0, self._slots[np.maximum(doc, 0)], k)  # k: padding, left out
        with torch.no_grad():
            ce = F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), batch.labels.reshape(-1),
                                 ignore_index=IGNORE_INDEX, reduction="none").double()
            if self._sums is None or self._sums.device != ce.device:
                self._sums = torch.zeros(k + 1, dtype=torch.float64, device=ce.device)
            self._sums.index_add_(0, torch.from_numpy(domain).to(ce.device), ce)

    def end_step(self, models: Sequence[nn.Module], owner: bool) -> dict[str, Any]:
        """Each domain's mean loss over its label tokens in the step (counted once: on ``owner`` ranks), the
        mixture moved by them, and the weights the next batches draw from."""
        k = len(self.mixture.names)
        sums = (self._sums[:k].cpu() if self._sums is not None else torch.zeros(k, dtype=torch.float64)) * float(owner)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums, group=cpu_group())
        loss = [float(s) / n if n else None for s, n in zip(sums.tolist(), self.tokens, strict=True)]
        step = self.mixture.updates + 1
        self.mixture.update(step, [x if x is not None else 0.0 for x in loss], self.tokens)
        return {"domains": tuple(self.mixture.names), "domain_loss": tuple(loss),
                "domain_tokens": tuple(self.tokens), "domain_weight": tuple(self.mixture.weights.tolist())}

    def state(self) -> dict[str, Any]:
        return {"mixture": self.mixture.state_dict()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.mixture.load_state_dict(state["mixture"])
