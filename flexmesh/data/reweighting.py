"""Loss-based sample reweighting (``flexmesh train --reweight``; docs/mixtures.md#sample-reweighting).

The method: Sow et al., "Dynamic Loss-Based Sample Reweighting for Improved Large Language Model
Pretraining" (ICLR 2025; DataFlex's ``loss`` weighter). Each step, every sample's loss under the current
weights is normalised to [-delta, delta] over the batch (its minimum to -delta, its maximum to delta),
passed through a strategy, and the samples weighted by the softmax of the result:

- ``linupper``: min(x + delta, delta), weighing the lossier half up to e^delta times the easiest sample (the
  paper's choice for pre-training: easy, already-learned samples count less, the noisiest are capped);
- ``quadratic``: 1 - x^2 / delta^2, weighing the batch's middle losses up and both extremes down (the same
  for every delta: x / delta is in [-1, 1]);
- ``extremes``: |x|, weighing both extremes up.

Here a sample is a document and the batch the step's global batch, so the weights are the same whatever
plan or micro-batching runs it (the correctness contract): a forward of the step's documents without
gradient (flexmesh.runtime.train.trainer.Trainer.doc_losses, about a third of a step's compute) gives each
document's mean token loss, all-reduced over the data ranks, before any backward. The weights then scale
each document's tokens in the differentiated loss, normalised so that they average 1 over the step's
label tokens: the loss stays the sum of weighted token cross-entropies over the step's label-token count,
and equal losses give every token weight 1, today's loss. On documents of one length this is the paper's
sum of softmax weights times sample losses exactly; on uneven lengths each document keeps its tokens'
share, times its weight. The loss reported (``loss`` in metrics.jsonl) stays the plain mean token
cross-entropy of the step, comparable with an unweighted run; ``doc_weight`` gives the step's smallest
and largest token weight.
"""

from __future__ import annotations

import numpy as np

from flexmesh.errors import PlanError

STRATEGIES = ("linupper", "quadratic", "extremes")


def check_strategy(strategy: str) -> None:
    """A PlanError naming the strategies, for one that is not."""
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown reweighting strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")


def strategy_scores(losses: np.ndarray, strategy: str, delta: float) -> np.ndarray:
    """Each sample's score before the softmax: ``losses`` mapped linearly onto [-delta, delta] (min to
    max; all 0 when they are equal), then the strategy (module doc).

    >>> strategy_scores(np.array([1.0, 2.0, 3.0]), "linupper", 1.0).tolist()
    [0.0, 1.0, 1.0]
    >>> strategy_scores(np.array([1.0, 2.0, 3.0]), "quadratic", 2.0).tolist()
    [0.0, 1.0, 0.0]
    """
    check_strategy(strategy)
    lo, hi = float(losses.min()), float(losses.max())
    x = (2.0 * delta * (losses - lo) / (hi - lo) - delta) if hi > lo else np.zeros_like(losses)
    if strategy == "linupper":
        return np.minimum(x + delta, delta)
    if strategy == "quadratic":
        return 1.0 - x * x / (delta * delta)
    return np.abs(x)


def doc_weights(losses: np.ndarray, tokens: np.ndarray, strategy: str, delta: float) -> np.ndarray:
    """Each document's token weight: the softmax of its score (:func:`strategy_scores` over the documents
    with label tokens), scaled so that the weights average 1 over the label tokens (sum of weight times
    ``tokens`` = sum of ``tokens``); 0 where a document has none.

    >>> w = doc_weights(np.array([1.0, 2.0, 3.0]), np.array([10, 10, 20]), "linupper", 1.0)
    >>> round(float((w * [10, 10, 20]).sum()), 9), bool(w[0] < w[1] == w[2])
    (40.0, True)
    """
    live = tokens > 0
    out = np.zeros(len(losses))
    if not live.any():
        return out
    s = strategy_scores(np.asarray(losses, dtype=np.float64)[live], strategy, delta)
    e = np.exp(s - s.max())
    out[live] = e * tokens[live].sum() / (e * tokens[live]).sum()
    return out
