"""The single-process reference: one step of plain PyTorch over a StepSchedule's micro-batches.

Every parallel layout must reproduce its loss and gradients (the correctness contract), and the
runtime benchmark measures the trainer's overhead against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexmesh.runtime.packing import global_label_tokens, pack_microbatch


def reference_loss(model: torch.nn.Module, docs, schedule, backward: bool = True) -> float:
    """The step's loss over every micro-batch, normalised by the step's label tokens.

    With ``backward`` it accumulates gradients into ``model`` (the caller zeroes them and steps the
    optimizer); without, it runs under ``torch.no_grad``.
    """
    n = global_label_tokens(docs, schedule)
    total = 0.0
    with torch.set_grad_enabled(backward):
        for g in schedule.groups:
            for mb in g.microbatches:
                b = pack_microbatch(docs, mb)
                logits = model(b.tokens, b)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b.labels.reshape(-1),
                                       ignore_index=-100, reduction="sum") / n
                if backward:
                    loss.backward()
                total += loss.item()
    return total
