"""Pipeline stages from a Plan's (possibly uneven) partition, run by torch.distributed.pipelining.

A stage is the full model with the layers it does not own deleted from the ``layers`` ModuleDict
(so the kept layers keep their global names, which checkpoints and weight loading rely on) and
``tok_embeddings`` / ``norm`` / ``output`` set to None where the stage lacks them.

Per-micro-batch side data. Pipelining passes one activation tensor between stages, but every stage
also needs the micro-batch's ``positions`` and ``cu_seqlens`` (RoPE and the document mask). The
micro-batches of a step are known before it starts, so the trainer *stashes* them on each
:class:`StageModule` (``feed``) and the stage's forward takes the next one: every schedule here
(GPipe, 1F1B, interleaved 1F1B, the sliced order) runs a given stage's forwards in micro-batch order, and
recomputation under activation checkpointing re-enters the blocks, never this forward. The count is
checked after the step.

Shapes. Pipelining sends fixed-shape buffers, so in pipeline mode every micro-batch of a step is
padded to the same length (labels -100 on padding); stages and schedules are built per (length,
count) with their shapes declared (:func:`make_stages`) and cached.

The loss. The schedule's ``target`` is each micro-batch's index, so the last stage's loss function
reads the micro-batch itself (:class:`MicroBatchLoss`): its labels, and what the run weighs them by
(LoRA tasks: each token's task weight).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from flexmesh.errors import PlanError
from flexmesh.layout.plan import ReplicaGroup, StagePlan
from flexmesh.runtime.model.transformer import Transformer

if TYPE_CHECKING:  # only for annotations: pipelining is imported when a pipeline is built
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

SCHEDULE_NAMES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "interleaved": "ScheduleInterleaved1F1B"}


class StageModule(nn.Module):
    """The module a training step calls: ``forward(x)`` with this micro-batch's side data stashed.

    Also used without pipelining (pp 1), where the batch is passed directly; keeping one wrapper
    for both modes gives FSDP one root and checkpoints one naming. ``compute`` makes the context
    the forward runs in (``torch.autocast`` for bf16 without FSDP2's mixed precision, see
    flexmesh.runtime.parallel.parallelize.autocast_bf16); backward and the loss run outside it.
    """

    def __init__(self, model: Transformer, compute: Callable[[], AbstractContextManager] = nullcontext):
        super().__init__()
        self.model = model
        self.compute = compute
        self._stash: list = []
        self._next = 0

    def feed(self, batches: list) -> None:
        self._stash, self._next = list(batches), 0

    def consumed(self) -> int:
        return self._next

    def forward(self, x: torch.Tensor, batch=None, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The model on ``x`` (``labels``: its summed loss instead of its logits, without pipelining)."""
        if batch is None:
            if self._next >= len(self._stash):
                raise RuntimeError(f"stage ran {self._next + 1} forwards but was fed {len(self._stash)} micro-batches")
            batch = self._stash[self._next]
            self._next += 1
        with self.compute():
            return self.model(x, batch) if labels is None else self.model(x, batch, labels)


def split_stage(model: Transformer, start: int, end: int, first: bool, last: bool) -> Transformer:
    """Keep layers [start, end) of a full model (in place) and the ends this stage owns."""
    for name in list(model.layers.keys()):
        if not start <= int(name) < end:
            del model.layers[name]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    return model


def chunks_of_rank(group: ReplicaGroup, pp_rank: int) -> list[tuple[int, StagePlan]]:
    """(chunk index, stage) pairs pipeline rank ``pp_rank`` of a replica group runs; chunk k is the
    k-th in layer order.

    Chunk k sits on rank k % pp (Megatron's interleaved order), so with pp 2 and 4 chunks rank 0
    runs chunks 0 and 2, rank 1 chunks 1 and 3.
    """
    ordered = sorted(group.stages, key=lambda s: (s.start, s.end))
    return [(k, ordered[k]) for k in range(pp_rank, len(ordered), group.pp)]


def check_partition(group: ReplicaGroup, num_layers: int) -> None:
    """A group's stages, in layer order, must tile [0, num_layers) without gaps or overlaps, and only the first and
    the last may hold no layers (a pipeline rank that only passes activations on is priced, not run)."""
    relays = [i for i in range(len(group.stages)) if group.relay(i)]
    if relays:
        raise PlanError(f"pipeline chunk {relays[0]} holds no layers between two others: flexmesh prices such a plan "
                        "(plan --check, simulate) but its runtime trains only chunks with layers, or the "
                        "embedding or head alone at the ends; move a layer into it or lower pp")
    pos = 0
    for st in sorted(group.stages, key=lambda s: (s.start, s.end)):
        if st.start != pos:
            raise PlanError(f"stage [{st.start}, {st.end}) should start at layer {pos}; stages must tile the layers")
        pos = st.end
    if pos != num_layers:
        raise PlanError(f"plan's stages cover layers [0, {pos}) but the model has {num_layers}; fix the partition")


def build_pipeline_schedule(stages: list, schedule: str, n_microbatches: int, loss_fn: Callable,
                            units: list[list[int]] | None = None,
                            pipeline_ranks: list[int] | None = None) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """The torch.distributed.pipelining schedule (GPipe, 1F1B, interleaved 1F1B) over this rank's stages;
    with ``units`` (micro-batches linked by cut documents) the sliced order instead
    (:func:`build_sliced_schedule`; ``pipeline_ranks`` as in :func:`make_stages`).

    Not to be confused with a StepSchedule (flexmesh.layout.step), which says which documents each
    data rank runs; this one orders the forwards and backwards of a step's micro-batches.

    ``scale_grads=False``: the loss is already normalised by the step's global label-token count,
    so the schedule must not divide gradients by the number of micro-batches again.
    """
    from torch.distributed import pipelining

    if units is not None:
        return build_sliced_schedule(stages, units, stages[0].group_size, loss_fn, pipeline_ranks)
    cls = getattr(pipelining, SCHEDULE_NAMES[schedule])
    if schedule == "interleaved":
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if len(stages) != 1:
        raise PlanError(f"schedule {schedule!r} runs one stage per rank; use 'interleaved' for virtual stages")
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


def build_sliced_schedule(stages: list, units: list[list[int]], pp: int, loss_fn: Callable,
                          pipeline_ranks: list[int] | None = None) -> PipelineScheduleMulti:
    """A schedule for a step whose micro-batches are linked by cut documents (``units``,
    flexmesh.layout.pipeline_order): each unit's forwards in order, its backwards in reverse.

    torch.distributed.pipelining runs any per-rank list of forwards and full backwards through its
    schedule runtime (``_PipelineScheduleRuntime``, which adds the sends and receives; private in
    torch 2.13, the class its own interleaved schedules are built on); the lists come from
    :func:`flexmesh.layout.pipeline_order.pipeline_order`. Stage ``s`` runs on pipeline rank
    ``s % pp``; ``pipeline_ranks`` as in :func:`make_stages`.
    """
    from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, _Action, _PipelineScheduleRuntime

    from flexmesh.layout.pipeline_order import pipeline_order

    num_stages = stages[0].num_stages
    order = sorted(pipeline_ranks) if pipeline_ranks is not None else list(range(pp))
    group_rank = [order.index(pipeline_ranks[r]) if pipeline_ranks is not None else r for r in range(pp)]
    kind = {"F": FORWARD, "B": FULL_BACKWARD}
    actions: dict[int, list[_Action | None]] = {
        group_rank[r]: [_Action(a.stage, kind[a.kind], a.mb) for a in acts]
        for r, acts in enumerate(pipeline_order(units, num_stages, pp))}
    m = sum(len(u) for u in units)
    sched = _PipelineScheduleRuntime(stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    sched.pipeline_order = actions
    sched._prepare_schedule_with_comms(actions)
    return sched


def make_stages(modules: list[StageModule], chunk_ids: list[int], num_chunks: int, device: torch.device, group,
                tokens: int, tp: int, hidden: int, vocab: int, dtype: torch.dtype,
                logits_dtype: torch.dtype | None = None, pipeline_ranks: list[int] | None = None) -> list:
    """PipelineStages with their send/receive shapes given up front (``tokens`` = this rank's T).

    Declaring shapes keeps pipelining in its static mode; otherwise it infers them by running an
    extra forward of the first micro-batch, which would consume a stashed micro-batch. Between
    stages flows the residual stream, [1, T/tp, hidden] under sequence parallelism, in ``dtype``;
    the last stage emits full logits [1, T, vocab] in ``logits_dtype`` (default ``dtype``; they
    differ under bf16 autocast, flexmesh.runtime.parallel.parallelize.activation_dtypes).

    ``pipeline_ranks``: the global rank of each pipeline rank in ``group``. A process group orders
    its members by global rank, so where a pipeline runs on falling ranks (stage 0 on rank 3, stage 1
    on rank 2) each stage is told which group rank holds each other stage.
    """
    from torch.distributed.pipelining import PipelineStage

    def hidden_states() -> torch.Tensor:
        return torch.empty(1, tokens // tp, hidden, dtype=dtype, device="meta", requires_grad=True)

    stages = []
    for m, k in zip(modules, chunk_ids):
        inp = torch.empty(1, tokens, dtype=torch.long, device="meta") if k == 0 else hidden_states()
        out = (torch.empty(1, tokens, vocab, dtype=logits_dtype or dtype, device="meta", requires_grad=True)
               if k == num_chunks - 1 else hidden_states())
        stage = PipelineStage(m, stage_index=k, num_stages=num_chunks, device=device, group=group,
                              input_args=inp, output_args=out)
        if pipeline_ranks is not None:
            order = sorted(pipeline_ranks)
            stage.stage_index_to_group_rank = {s: order.index(pipeline_ranks[s % len(pipeline_ranks)])
                                               for s in range(num_chunks)}
        stages.append(stage)
    return stages


class MicroBatchLoss:
    """A pipeline schedule's ``loss_fn``: ``loss(output, batch)`` of the micro-batch whose index is the target.

    The schedule splits its target into one chunk per micro-batch and calls ``loss_fn(output, chunk)`` on
    the last stage; with ``torch.arange(m)`` (on the host) as the target, the chunk is the micro-batch's
    index into :attr:`batches` (the step's micro-batches, set before each step), so nothing reads the
    device.
    """

    def __init__(self, loss: Callable[[torch.Tensor, Any], torch.Tensor]) -> None:
        self.loss = loss
        self.batches: list = []

    def __call__(self, output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.loss(output, self.batches[int(index[0])])


PIPELINE_SCHEDULES_KEPT = 8


def run_pipeline_step(trainer: Any, batches: list, units: list[list[int]]) -> float:
    """Trainer ``trainer``'s step through this rank's pipeline stages; ``units``: micro-batches linked by
    cut documents (one each where none is cut: the plan's own schedule runs). Schedules are kept for
    the latest :data:`PIPELINE_SCHEDULES_KEPT` (micro-batches, shape, units): a step's shape and cut
    documents vary, and each schedule holds its stages' receive buffers."""
    m, length = len(batches), batches[0].num_tokens
    sliced = any(len(u) > 1 for u in units)
    key = (m, length, tuple(map(tuple, units)) if sliced else None)
    if key not in trainer._schedules:
        from flexmesh.runtime.parallel.parallelize import activation_dtypes

        hidden, logits = activation_dtypes(trainer.layout, trainer.config.dtype)
        index = trainer.group.blocks[trainer.place.pp].index(dist.get_rank())
        pipeline_ranks = [block[index] for block in trainer.group.blocks]
        stages = make_stages(trainer.modules, [k for k, _ in trainer.chunks], len(trainer.group.stages), trainer.device,
                             trainer.pp_group, tokens=length, tp=trainer.layout.tp, hidden=trainer.spec.hidden,
                             vocab=trainer.spec.vocab, dtype=hidden, logits_dtype=logits,
                             pipeline_ranks=pipeline_ranks)
        trainer._schedules[key] = build_pipeline_schedule(stages, trainer.plan.pipeline_schedule, m,
                                                          trainer.pipeline_loss, units if sliced else None,
                                                          pipeline_ranks)
        while len(trainer._schedules) > PIPELINE_SCHEDULES_KEPT:
            trainer._schedules.popitem(last=False)
    trainer._schedules.move_to_end(key)
    sched = trainer._schedules[key]
    for mod in trainer.modules:
        mod.feed(batches)
    trainer.pipeline_loss.batches = batches
    first = trainer.place.pp == 0
    last = trainer.place.pp == trainer.layout.pp - 1
    tokens = torch.cat([b.tokens for b in batches]) if first else None
    target = torch.arange(m) if last else None  # each micro-batch's index (MicroBatchLoss)
    losses: list = []
    args = (tokens,) if first else ()
    try:
        sched.step(*args, target=target, losses=losses if last else None, return_outputs=False)
    finally:
        trainer.carry.clear()
    for mod in trainer.modules:
        if mod.consumed() != m:
            raise RuntimeError(f"pipeline stage ran {mod.consumed()} forwards for {m} micro-batches")
    return float(sum(float(x.detach()) for x in losses)) if last else 0.0
