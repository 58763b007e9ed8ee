"""A rank's step without pipeline stages: its micro-batches' forwards and backwards, gradients accumulated.

Micro-batch counts. With no ZeRO-3 layer, nothing in a micro-batch talks to all data ranks once
weights are gathered (the trainer's ``uneven`` path), so each rank runs only its own group's
micro-batches with gradient sync off and weights kept gathered, then one empty micro-batch (all labels
ignored) with sync on carries the step's single gradient reduction. ZeRO-3 (weights gathered per
micro-batch) pairs collectives per micro-batch, so there every rank runs the step's largest count,
groups with fewer padded with empty micro-batches, and the last one reduces the gradients.

Cut documents: a chain of micro-batches linked by a cut document runs all its forwards, then one
backward of their summed loss (flexmesh.runtime.model.carry); ranks in lockstep end chains at the same
places (flexmesh.layout.pipeline_order.chain_ends).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Protocol, cast

import torch
from torch.distributed.fsdp import FSDPModule

from flexmesh.layout.pipeline_order import chain_ends
from flexmesh.layout.step import Group
from flexmesh.runtime.model.carry import KVCarry
from flexmesh.runtime.model.loss import GlobalLoss
from flexmesh.runtime.model.packing import PackedBatch, shard_for_cp
from flexmesh.runtime.parallel.pipeline import StageModule
from flexmesh.runtime.train.step_clock import Marks
from flexmesh.runtime.train.stragglers import ComputeClock


class Accumulating(Protocol):
    """What a step of accumulated micro-batches reads of the trainer (flexmesh.runtime.train.trainer.Trainer)."""

    modules: list[StageModule]
    device: torch.device
    uneven: bool  # ranks may run different numbers of micro-batches (module doc)
    chunked_loss: bool
    loss_fn: GlobalLoss
    clock: ComputeClock
    carry: KVCarry

    @property
    def data_rank(self) -> int: ...

    def microbatch_loss(self, output: torch.Tensor, batch: PackedBatch) -> torch.Tensor: ...

    def empty_microbatch(self, length: int) -> PackedBatch: ...


def run_microbatches(trainer: Accumulating, batches: list[PackedBatch], group: Group, marks: Marks,
                     own: list[Group], tp: int) -> tuple[torch.Tensor, object]:
    """Run this rank's ``batches`` (the schedule ``group``'s first, then padding) and their backwards;
    returns (this rank's loss, on the device; the mark where its own micro-batches were done). On the
    uneven path one more empty micro-batch of ``cp * tp`` tokens carries the gradient reduction, after
    the busy time is taken. ``own``: the step's groups of this replica group."""
    own_count, cp = len(group.microbatches), group.cp
    root = trainer.modules[0]
    fsdp = root if isinstance(root, FSDPModule) else None  # FSDP2 or replicate over the data ranks
    # the step's loss summed in float64, as Python floats summed it before it stayed on the device
    total = torch.zeros((), dtype=torch.float64, device=trainer.device)
    busy = None
    # A chain of micro-batches linked by a cut document runs all its forwards, then one backward of
    # their summed loss (flexmesh.runtime.model.carry); ranks in lockstep end chains at the same places.
    ends = chain_ends([group] if trainer.uneven else own, len(batches))
    chain: list[torch.Tensor] = []

    def run(b: PackedBatch, end: bool = True, timed: bool = True) -> torch.Tensor:
        # Only this rank's own micro-batches are timed (and stretched when emulating a slow rank):
        # the empty one carrying the gradient reduction is communication, padding ones no work.
        with trainer.clock.piece() if timed else nullcontext():
            if trainer.chunked_loss:  # the model's forward ends in the loss (flexmesh.runtime.model.loss)
                loss = root(b.tokens, b, labels=b.labels) / trainer.loss_fn.normaliser
            else:
                loss = trainer.microbatch_loss(root(b.tokens, b), b)
        chain.append(loss)
        if end:
            with trainer.clock.piece() if timed else nullcontext():
                cast(torch.Tensor, sum(chain)).backward()
            chain.clear()
            trainer.carry.clear()
        return loss.detach().double()

    if trainer.uneven:
        if fsdp is not None:
            # Accumulate gradients locally and keep weights gathered: with FSDP2's default
            # re-shard after each backward, every micro-batch's forward would gather weights over
            # all data ranks again, and ranks with different counts would wait on each other
            # forever (seen on torch 2.13 gloo). The step's one weight gather happens in each
            # rank's first forward, the one reduction in the empty micro-batch below.
            fsdp.set_requires_gradient_sync(False)
            fsdp.set_reshard_after_backward(False)
        for b, end in zip(batches, ends, strict=True):
            total = total + run(b, end)
        busy = marks.mark()
        if fsdp is not None:
            fsdp.set_requires_gradient_sync(True)
            fsdp.set_reshard_after_backward(True)
            empty = trainer.empty_microbatch(cp * tp)
            if cp > 1:
                empty = shard_for_cp(empty, trainer.data_rank - group.ranks[0], cp)
            total = total + run(empty.to(trainer.device), timed=False)
        return total, busy
    for i, b in enumerate(batches):
        if i == own_count:
            busy = marks.mark()
        if fsdp is not None:  # reduce gradients once, after the last micro-batch
            fsdp.set_requires_gradient_sync(i == len(batches) - 1)
        total = total + run(b, ends[i], timed=i < own_count)
    return total, busy if busy is not None else marks.mark()

