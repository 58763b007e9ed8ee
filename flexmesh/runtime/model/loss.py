"""The training loss: summed token cross-entropy in fp32, whole or chunk by chunk.

Both forms return the sum over label tokens (``IGNORE_INDEX`` skipped) of ``-log p(label)``; the
trainer divides by the step's global label-token count (the correctness contract,
flexmesh.runtime.train.trainer).

- :func:`summed_cross_entropy` takes logits: bf16 logits are upcast first (as torchtitan and Megatron
  do), since a bf16 log-softmax over the vocabulary loses the small probabilities the loss is made
  of. It keeps the logits and their fp32 copy for backward: at 8192 tokens and a 32,000-token
  vocabulary that is 1.5 GiB beside a 1.1B model's 2 GiB of bf16 weights.
- :func:`linear_cross_entropy` takes the final hidden states and the head's weight and never holds
  more than one chunk of logits: each chunk's logits are made, their softmax turned into the
  gradients of the hidden states and of the weight at once (``softmax - onehot``), and dropped;
  backward only scales the stored gradients by the incoming one. No recomputation, so it costs the
  head's three matmuls as the whole form does (Liger-Kernel's fused linear cross-entropy works the
  same way). The sum is exact up to the order of floating-point additions.

>>> torch.manual_seed(0)
<torch._C.Generator object at ...>
>>> h, w = torch.randn(10, 4, requires_grad=True), torch.randn(7, 4, requires_grad=True)
>>> labels = torch.tensor([1, 2, 3, -100, 5, 6, 0, 1, 2, -100])
>>> whole = summed_cross_entropy(h @ w.t(), labels)
>>> chunked = linear_cross_entropy(h, w, labels, chunk=3)
>>> bool(torch.allclose(whole, chunked))
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexmesh.runtime.model.packing import IGNORE_INDEX

# Logit elements per chunk of linear_cross_entropy: 2^26 fp32 logits are 256 MiB (2,097 tokens of a
# 32,000-token vocabulary), large enough for the head's matmuls to run at full rate.
CHUNK_LOGITS = 2**26


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the tokens' cross-entropy, in fp32, over ``logits`` [..., vocab] against ``labels`` [...]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk of :func:`linear_cross_entropy` for a vocabulary of ``vocab``.

    >>> chunk_tokens(32000), chunk_tokens(128256)
    (2097, 523)
    """
    return max(1, CHUNK_LOGITS // vocab)


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T`` against ``labels``, gradients made in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk):  # noqa: ANN001, ANN205
        n = hidden.shape[0]
        need = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h: torch.Tensor | None = None
        grad_w: torch.Tensor | None = None
        if need:
            grad_h = torch.empty_like(hidden)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for a in range(0, n, chunk):
            h, lab = hidden[a:a + chunk], labels[a:a + chunk]
            logits = (h @ weight.t()).float()
            valid = lab != IGNORE_INDEX
            safe = torch.where(valid, lab, torch.zeros_like(lab))
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None])[:, 0]
            total = total + torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
            if grad_h is not None and grad_w is not None:  # gradients wanted (need)
                # d(sum of losses)/d(logits) = softmax - onehot on label tokens, 0 elsewhere (in place)
                probs = logits.sub_(lse[:, None]).exp_()
                probs.scatter_add_(1, safe[:, None], -valid[:, None].to(probs.dtype))
                probs.mul_(valid[:, None])
                g = probs.to(hidden.dtype)
                grad_h[a:a + chunk] = g @ weight.to(hidden.dtype)
                grad_w.add_(g.t() @ h.to(g.dtype))
        if grad_h is not None and grad_w is not None:
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk: int | None = None) -> torch.Tensor:
    """Sum of the tokens' cross-entropy of the logits ``hidden @ weight.T``, ``chunk`` tokens at a time
    (default :func:`chunk_tokens`); ``hidden`` [..., H], ``weight`` [vocab, H], ``labels`` [...]."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _LinearCrossEntropy.apply(flat, weight, labels.reshape(-1), chunk or chunk_tokens(weight.shape[0]))


class GlobalLoss:
    """Summed token cross-entropy (fp32, flexmesh.runtime.model.loss) over the step's global label-token
    count (the pipeline loss_fn)."""

    def __init__(self) -> None:
        self.normaliser = 1

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return summed_cross_entropy(logits, labels) / self.normaliser


def weighted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
                           tasks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the tokens' cross-entropy, each times its weight (LoRA tasks: 1 / its task's label tokens
    in the step, so each task's loss is its own mean whatever shares its micro-batches), and the same
    sum per task slot (``slots`` [T]; -1: padding, left out) as a detached [tasks] float64 vector."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                         ignore_index=IGNORE_INDEX, reduction="none") * weights.reshape(-1)
    per_task = torch.zeros(tasks + 1, dtype=torch.float64, device=ce.device)
    per_task.index_add_(0, torch.where(slots < 0, tasks, slots), ce.detach().double())
    return ce.sum(), per_task[:tasks]
