"""A job resolved once: what a command's flags and its plan say about the work, in one frozen object the
library takes (argparse stays in flexmesh.commands).

A :class:`Job` holds the model, the sequence cap (``seq_len``: longer sequences are truncated to it),
the step's size, its parts (:class:`~flexmesh.cost.training.parts.Parts`: the training stack whose
layers are priced, how a mixture of experts runs, the LoRA tasks), the precision it computes in, the
plan where there is one, and the cost model built with those parts. :func:`build_job` is the one place
that puts it together: each command reads its flags into these values (no fallback written back into
the flags) and calls it.

>>> from flexmesh.layout.stack import Stack
>>> from flexmesh.spec.cluster import parse_cluster
>>> from flexmesh.spec.model import parse_model
>>> model = parse_model("llama2-7b")
>>> job = build_job(model, 4096, 64, base=CostModel(model, parse_cluster("8xA100-80GB")),
...                 parts=Parts(stack=Stack(dropout=True)))
>>> job.cost.timing.stack.label, job.dtype, job.task_batches
('fused attention, sequence parallel, dropout', 'bf16', (64,))
"""

from __future__ import annotations

from dataclasses import dataclass

from flexmesh.cost.training.mixed import MixedCosts
from flexmesh.cost.training.model import CostModel
from flexmesh.cost.training.parts import Parts
from flexmesh.layout.plan import Plan
from flexmesh.spec.cluster import MixedCluster
from flexmesh.spec.model import ModelSpec


@dataclass(frozen=True)
class Job:
    """One job's settings as resolved from its flags and its plan (see the module doc)."""

    model: ModelSpec
    seq_len: int  # the sequence cap, in tokens (every command's --seq-len; the plan's by default)
    global_batch: int  # sequences per step (with tasks: every task's batch together)
    tokens_per_batch: int | None = None  # a step counted in tokens instead of sequences
    # whose layers are priced, how a mixture of experts runs, the LoRA tasks trained on the frozen model
    parts: Parts = Parts()
    dtype: str = ""  # the precision the job computes in; "": the model's
    plan: Plan | None = None
    cost: CostModel | None = None  # the assembled cost model of one device type
    costs: MixedCosts | None = None  # one assembled cost model per device group of a mixed cluster

    def __post_init__(self) -> None:
        if not self.dtype:
            object.__setattr__(self, "dtype", self.model.dtype)

    @property
    def task_batches(self) -> tuple[int, ...]:
        """Sequences per step of each task (one entry, the whole batch, without tasks)."""
        tasks = self.parts.tasks
        return tasks.batches(self.global_batch) if tasks is not None else (self.global_batch,)


def plan_sizes(plan: Plan, seq_len: int | None, global_batch: int | None) -> tuple[int, int]:
    """The sequence cap and the batch (sequences per step) of a job on ``plan``: those given, else the plan's."""
    return (plan.seq_len if seq_len is None else seq_len,
            plan.global_batch if global_batch is None else global_batch)


def build_job(model: ModelSpec, seq_len: int, global_batch: int, *, base: CostModel | None = None,
              cluster: MixedCluster | None = None, tokens_per_batch: int | None = None, parts: Parts | None = None,
              dtype: str = "", plan: Plan | None = None) -> Job:
    """The :class:`Job` of these settings, its cost model built with ``parts`` in one place: over ``base``
    (one device type: its presets or profiles, :meth:`CostModel.replace`) or over each device group's
    presets of ``cluster`` (a mixed cluster, :class:`MixedCosts`); neither: a job that prices nothing.
    ``parts``: default full training of every weight on flexmesh's runtime."""
    parts = Parts() if parts is None else parts
    cost = base.replace(parts=parts) if base is not None else None
    costs = MixedCosts(model, cluster, parts=parts) if cluster is not None else None
    return Job(model, seq_len, global_batch, tokens_per_batch, parts, dtype, plan, cost, costs)
