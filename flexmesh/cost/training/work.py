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

# Seconds or bytes: a float, or a numpy array when many micro-batches are priced at once.
Amount = float | np.ndarray

NO_WINDOW: tuple[int | None, ...] = (None,)


def attention_sq(start, end, windows: Sequence[int | None] = NO_WINDOW):  # noqa: ANN001, ANN201 - floats or arrays
    """Causal attention work of queries ``[start, end)`` of one sequence, in squared tokens.

    Squared tokens count ``2 x (query-key pairs) - queries``. Without a window query ``i`` sees
    ``i + 1`` keys, so queries ``[a, b)`` give exactly ``b^2 - a^2`` (``s^2`` for a whole sequence, the
    statistic the attention FLOPs of 2 x q_dim per squared token are written for, 2104.04473). With a
    window ``w`` query ``i`` sees ``min(i + 1, w)`` keys (transformers' sliding window; FLOPs of a
    windowed kernel: each token attends to at most w tokens, Mistral 7B, 2310.06825, section 2): with
    ``m = clip(w, a, b)`` that is ``m^2 - a^2 + (2w - 1)(b - m)``.

    ``windows`` holds one window per layer (None: plain causal); the result is their mean, the work of
    an average layer (exact when all layers share one window). With no window anywhere the result is
    ``end * end - start * start``, bit for bit the statistic used before windows existed.
    Floats or numpy arrays (elementwise).

    >>> attention_sq(0, 10), attention_sq(0, 10, (4,)), attention_sq(6, 10, (4,)), attention_sq(0, 3, (4,))
    (100, 58.0, 28.0, 9.0)
    >>> attention_sq(0, 10, (4, None))  # half the layers slide
    79.0
    """
    if all(w is None for w in windows):  # the common case, asked millions of times: no Counter built
        return end * end - start * start
    counts = Counter(windows)
    parts = []
    for w, n in counts.items():
        if w is None:
            parts.append((n, end * end - start * start))
        else:
            m = np.clip(w, start, end)
            parts.append((n, m * m - start * start + (2 * w - 1) * (end - m)))
    # one window on every layer: its statistic as is, not a mean that could round differently
    total = parts[0][1] if len(parts) == 1 else sum(n * p for n, p in parts) / len(windows)
    return total if np.ndim(total) else float(total)


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
