"""Held-out evaluation during training (``flexmesh train --eval-corpus``; docs/cli-train.md#evaluation).

A fixed set of documents, the same at every evaluation: the first ``count`` documents of the held-out
corpus with a label token (two tokens or more), each truncated to the run's ``seq_len``, laid out once
by the ``fixed`` policy over the plan's data ranks. Every ``every`` steps and at the last step each
rank runs their forwards (flexmesh.runtime.train.trainer.Trainer.held_out_loss) and the step's
metrics row gets ``eval_loss``, the mean token cross-entropy over their label tokens, and ``eval_ppl``,
its exponential. Nothing of it is checkpointed: the documents and their layout are rebuilt from the
flags, so a resume evaluates the same ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from flexmesh.data.loader import TokenizedCorpus
from flexmesh.errors import PlanError, ScheduleError
from flexmesh.layout.step import StepSchedule
from flexmesh.runtime.model.loss import summed_cross_entropy
from flexmesh.runtime.model.packing import global_label_tokens
from flexmesh.runtime.train.config import StepMetrics
from flexmesh.runtime.train.trainer import Trainer


def held_out_loss(trainer: Trainer, docs: Sequence[np.ndarray], schedule: StepSchedule) -> float:
    """The mean token cross-entropy of ``docs`` laid out by ``schedule``: the trainer's step path (its
    micro-batches, context groups and parallel model) without backward or optimizer, in eval mode under
    ``torch.no_grad``, on every rank of the layout (every rank calls it at the same point, between steps).
    Each data rank sums its label tokens' cross-entropy, the sums are all-reduced and divided by the
    global label-token count, as the step's loss is. Nothing the next step reads changes: no gradient,
    optimizer or LR state, no RNG draw, weights sharded again afterwards. Pipelines and parts (tasks,
    experts) are refused."""
    import torch
    import torch.distributed as dist

    if any(not part.plain_model for part in trainer.parts) or any(g.pp > 1 for g in trainer.plan.groups):
        raise PlanError("held-out evaluation runs plans with pp 1 and no --tasks or experts; drop --eval-corpus "
                        "or use such a plan")
    label_tokens = global_label_tokens(docs, schedule)
    if label_tokens == 0:
        raise ScheduleError("the held-out documents have no label tokens; give documents of two tokens or more")
    total = torch.zeros((), dtype=torch.float64, device=trainer.device)

    def each(model, b) -> None:  # noqa: ANN001
        nonlocal total
        if trainer.chunked_loss:  # the model's forward ends in the summed loss
            loss = model(b.tokens, b, labels=b.labels)
        else:
            loss = summed_cross_entropy(model(b.tokens, b), b.labels)
        total = total + loss.double()

    trainer.forward_only(docs, schedule, each)
    owner = trainer.place is not None and trainer.place.tp == 0  # tp ranks hold copies of their data rank's loss
    box = torch.tensor([float(total) if owner else 0.0], dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(box, group=trainer._cpu_group)
    return float(box.item()) / label_tokens


def held_out_documents(corpus: TokenizedCorpus | Sequence[np.ndarray], count: int, seq_len: int) -> list[np.ndarray]:
    """The first ``count`` documents of ``corpus`` that have a label token, each cut to ``seq_len`` tokens.

    >>> docs = [np.arange(5), np.arange(1), np.arange(3), np.arange(9)]
    >>> [len(d) for d in held_out_documents(docs, 2, 4)]
    [4, 3]
    """
    out: list[np.ndarray] = []
    for i in range(len(corpus)):
        if len(out) == count:
            break
        doc = corpus[i]
        if len(doc) >= 2:
            out.append(np.asarray(doc[:seq_len]))
    return out


def perplexity(loss: float) -> float:
    """``exp(loss)``, infinite where that overflows a float.

    >>> round(perplexity(math.log(50.0)), 6), perplexity(1e6)
    (50.0, inf)
    """
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@dataclass(frozen=True)
class HeldOutEval:
    """The run's held-out documents, their layout, and how often they are evaluated."""

    docs: tuple[np.ndarray, ...]
    schedule: StepSchedule
    every: int  # steps between evaluations (the last step is always evaluated)

    @classmethod
    def of(cls, docs: Sequence[np.ndarray], every: int,
           schedule_fn: Callable[[list[int]], StepSchedule]) -> HeldOutEval:
        """``docs`` laid out by ``schedule_fn`` (lengths in, a StepSchedule out: the run's ``fixed`` scheduler)."""
        return cls(tuple(docs), schedule_fn([len(d) for d in docs]), every)

    def due(self, step: int, max_steps: int) -> bool:
        """Whether step ``step`` (1-based) is evaluated.

        >>> e = HeldOutEval((), StepSchedule(lengths=(), groups=(), policy="fixed"), every=4)
        >>> [s for s in range(1, 11) if e.due(s, 10)]
        [4, 8, 10]
        """
        return step % self.every == 0 or step == max_steps

    def run(self, trainer: Trainer, m: StepMetrics) -> StepMetrics:
        """Step ``m``'s metrics with the held-out loss and perplexity of the trainer's current weights."""
        loss = held_out_loss(trainer, self.docs, self.schedule)
        return replace(m, eval_loss=loss, eval_ppl=perplexity(loss))


@dataclass(frozen=True)
class DomainEvals:
    """Held-out sets of several domains (``flexmesh train --domains`` whose manifest names each one's
    ``eval``), evaluated on the same steps: the row gets each domain's mean token cross-entropy
    (``eval_domain_loss``), their unweighted mean as ``eval_loss`` (every domain counts alike, whatever
    its size, as DoReMi and DataFlex report) and its exponential as ``eval_ppl``."""

    names: tuple[str, ...]
    sets: tuple[HeldOutEval, ...]

    def due(self, step: int, max_steps: int) -> bool:
        return self.sets[0].due(step, max_steps)

    def run(self, trainer: Trainer, m: StepMetrics) -> StepMetrics:
        losses = tuple(held_out_loss(trainer, e.docs, e.schedule) for e in self.sets)
        mean = sum(losses) / len(losses)
        return replace(m, eval_loss=mean, eval_ppl=perplexity(mean), eval_domain_loss=losses)
