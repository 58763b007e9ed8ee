"""What the cost model prices and what it answers: work of a micro-batch, cost of a layer, phases.

Work is described by sufficient statistics, not a token count: a micro-batch with sequence lengths
``s_k`` costs ``sum(s_k)`` in the linear layers and ``sum(s_k**2)`` in causal attention (with a
sliding window less: :func:`attention_sq`, the one place that maps lengths to squared tokens).

>>> w = Work.from_lengths([1000, 24, 500])
>>> w.tokens, w.sq_tokens, w.seqs
(1524.0, 1250576.0, 3.0)
>>> (LayerCost(fwd=1.0, transient=5.0) + LayerCost(bwd=2.0, transient=3.0)).time
3.0
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flexmesh.cost.device.layer_shapes import NO_WINDOW, attention_sq

# Seconds or bytes: a float, or a numpy array when many micro-batches are priced at once.
Amount = float | np.ndarray

def ring_hops(cp: int, block_tokens, windows: Sequence[int | None] = NO_WINDOW):  # noqa: ANN001, ANN201
    """K/V hops of ring attention per pass with blocks of ``block_tokens``, mean over layers.

    Without a sliding window every pass makes all ``cp - 1`` hops. A block ``h`` ranks back is within
    reach of a window ``w`` while ``(h - 1) * block + 1 < w``, so ``min(cp - 1, ceil((w - 1) / block))``
    hops (the runtime's ``ring_steps`` minus one). Floats or numpy arrays.

    >>> ring_hops(8, 512.0, (1000,)), ring_hops(8, 100.0, (1000,)), ring_hops(8, 1000.0, (1000, None))
    (2.0, 7.0, 4.0)
    """
    block = np.maximum(np.asarray(block_tokens, dtype=float), 1.0)
    mean = sum(n * (np.full(block.shape, cp - 1.0) if w is None else np.minimum(cp - 1.0, np.ceil((w - 1) / block)))
               for w, n in Counter(windows).items()) / len(windows)
    return mean if np.ndim(mean) else float(mean)


@dataclass(frozen=True)
class Work:
    """What one replica (a tp x cp group) processes in one micro-batch."""

    tokens: float
    sq_tokens: float
    seqs: float = 1.0

    @classmethod
    def uniform(cls, seqs: float, seq_len: int, windows: Sequence[int | None] = NO_WINDOW) -> "Work":
        """``seqs`` sequences of ``seq_len`` tokens each (``windows``: per layer, :func:`attention_sq`)."""
        return cls(tokens=seqs * seq_len, sq_tokens=seqs * float(attention_sq(0.0, float(seq_len), windows)),
                   seqs=seqs)

    @classmethod
    def from_lengths(cls, lengths, windows: Sequence[int | None] = NO_WINDOW) -> "Work":  # noqa: ANN001
        """The sequences of the given lengths (``windows``: per layer, :func:`attention_sq`)."""
        a = np.asarray(lengths, dtype=float)
        return cls(tokens=float(a.sum()), sq_tokens=float(attention_sq(0.0, a, windows).sum()), seqs=float(len(a)))


@dataclass(frozen=True)
class LayerCost:
    """One layer (or the embedding/head part of a stage) on one device for one micro-batch."""

    fwd: float = 0.0  # forward compute, s
    bwd: float = 0.0  # backward compute including recomputation, s
    comm_fwd: float = 0.0  # communication not hidden under forward compute, s
    comm_bwd: float = 0.0  # communication not hidden under backward compute, s
    grad_sync: float = 0.0  # once-per-step gradient/parameter collective, overlappable, s
    optim: float = 0.0  # optimizer step, s
    states: float = 0.0  # weights + grads + optimizer states, bytes
    act: float = 0.0  # activations kept per in-flight micro-batch, bytes
    transient: float = 0.0  # working memory needed while this layer runs, bytes

    @property
    def time(self) -> float:
        """Seconds of one micro-batch through it: compute and exposed communication, both passes."""
        return self.fwd + self.bwd + self.comm_fwd + self.comm_bwd

    def __add__(self, o: "LayerCost") -> "LayerCost":
        # Working memory is needed one layer at a time, so it is the larger of the two, not the sum.
        return LayerCost(
            self.fwd + o.fwd, self.bwd + o.bwd, self.comm_fwd + o.comm_fwd, self.comm_bwd + o.comm_bwd,
            self.grad_sync + o.grad_sync, self.optim + o.optim, self.states + o.states, self.act + o.act,
            max(self.transient, o.transient),
        )


@dataclass(frozen=True)
class MicrobatchPhases:
    """:meth:`CostModel.microbatch_time` split by phase (seconds; numpy arrays when given arrays).

    ``fwd`` and ``bwd`` are compute (``bwd`` includes recomputation); ``comm_fwd`` and ``comm_bwd``
    are the communication that does not hide under it. The four add up to ``microbatch_time``.
    """

    fwd: Amount
    bwd: Amount
    comm_fwd: Amount
    comm_bwd: Amount

    @property
    def total(self) -> Amount:
        """The four phases added: :meth:`CostModel.microbatch_time`."""
        return self.fwd + self.bwd + self.comm_fwd + self.comm_bwd
