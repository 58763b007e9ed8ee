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
from typing import Protocol

import numpy as np

from flexmesh.data.loader import TokenizedCorpus
from flexmesh.layout.step import StepSchedule
from flexmesh.runtime.train.config import StepMetrics


class Evaluating(Protocol):
    """What an evaluation reads of the trainer (flexmesh.runtime.train.trainer.Trainer)."""

    def held_out_loss(self, docs: Sequence[np.ndarray], schedule: StepSchedule) -> float: ...


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
class Evaluation:
    """The run's held-out documents, their layout, and how often they are evaluated."""

    docs: tuple[np.ndarray, ...]
    schedule: StepSchedule
    every: int  # steps between evaluations (the last step is always evaluated)

    @classmethod
    def of(cls, docs: Sequence[np.ndarray], every: int,
           schedule_fn: Callable[[list[int]], StepSchedule]) -> Evaluation:
        """``docs`` laid out by ``schedule_fn`` (lengths in, a StepSchedule out: the run's ``fixed`` scheduler)."""
        return cls(tuple(docs), schedule_fn([len(d) for d in docs]), every)

    def due(self, step: int, max_steps: int) -> bool:
        """Whether step ``step`` (1-based) is evaluated.

        >>> e = Evaluation((), StepSchedule(lengths=(), groups=(), policy="fixed"), every=4)
        >>> [s for s in range(1, 11) if e.due(s, 10)]
        [4, 8, 10]
        """
        return step % self.every == 0 or step == max_steps

    def run(self, trainer: Evaluating, m: StepMetrics) -> StepMetrics:
        """Step ``m``'s metrics with the held-out loss and perplexity of the trainer's current weights."""
        loss = trainer.held_out_loss(self.docs, self.schedule)
        return replace(m, eval_loss=loss, eval_ppl=perplexity(loss))
