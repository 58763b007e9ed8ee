"""The single-process reference: one step of plain PyTorch over a StepSchedule's micro-batches.

Every parallel layout must reproduce its loss and gradients (the correctness contract), and the
runtime benchmark measures the trainer's overhead against it. The reference never cuts a document:
a document the schedule cuts into pieces runs whole in the micro-batch of its first piece, which is
what the runtime's carried keys and values must reproduce (flexmesh.runtime.model.carry).
"""

from __future__ import annotations

import torch

from flexmesh.layout.step import Piece
from flexmesh.runtime.model.loss import summed_cross_entropy
from flexmesh.runtime.model.packing import global_label_tokens, pack_microbatch


def reference_loss(model: torch.nn.Module, docs, schedule, backward: bool = True) -> float:
    """The step's loss over every micro-batch, normalised by the step's label tokens.

    With ``backward`` it accumulates gradients into ``model`` (the caller zeroes them and steps the
    optimizer); without, it runs under ``torch.no_grad``. The loss is fp32 whatever the logits' dtype
    (they are upcast first, as the trainer does).
    """
    n = global_label_tokens(docs, schedule)
    total = 0.0
    with torch.set_grad_enabled(backward):
        for g in schedule.groups:
            for mb in g.microbatches:
                whole = [Piece(p.seq_id, 0, len(docs[p.seq_id])) for p in mb if p.start == 0]
                if not whole:  # only continuations of documents run whole earlier
                    continue
                b = pack_microbatch(docs, whole)
                loss = summed_cross_entropy(model(b.tokens, b), b.labels) / n
                if backward:
                    loss.backward()
                total += loss.item()
    return total
