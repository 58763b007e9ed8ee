"""A job resolved once: what a command's flags and its plan say about the work, in one frozen object the
library takes (argparse stays in flexmesh.commands).

A :class:`Job` holds the model, the sequence cap (``seq_len``: longer sequences are truncated to it),
the step's size, the LoRA tasks, how a mixture of experts runs, the training stack whose layers are
priced, the precision it computes in, the plan where there is one, and the cost model put together
from those parts. :func:`build_job` is the one place that puts it together: each command reads its
flags into these values (no fallback written back into the flags) and calls it.

>>> from flexmesh.spec.cluster import parse_cluster
>>> from flexmesh.spec.model import parse_model
>>> from flexmesh.cost.training.model import CostModel
>>> model = parse_model("llama2-7b")
>>> job = build_job(model, 4096, 64, base=CostModel(model, parse_cluster("8xA100-80GB")),
...                 stack=Stack(dropout=True))
>>> job.cost.timing.stack.label, job.dtype, job.task_batches
('fused attention, sequence parallel, dropout', 'bf16', (64,))
"""

from __future__ import annotations

from dataclasses import dataclass

from flexmesh.cost.training.experts import ExpertParallel
from flexmesh.cost.training.finetune import with_tasks
from flexmesh.cost.training.mixed import MixedCosts
from flexmesh.cost.training.model import CostModel
from flexmesh.cost.training.stack import with_stack
from flexmesh.layout.plan import Plan
from flexmesh.layout.stack import RUNTIME_STACK, Stack
from flexmesh.spec.cluster import MixedCluster
from flexmesh.spec.model import ModelSpec
from flexmesh.spec.tasks import TaskSet


@dataclass(frozen=True)
class Job:
    """One job's settings as resolved from its flags and its plan (see the module doc)."""

    model: ModelSpec
    seq_len: int  # the sequence cap, in tokens (every command's --seq-len; the plan's by default)
    global_batch: int  # sequences per step (with tasks: every task's batch together)
    tokens_per_batch: int | None = None  # a step counted in tokens instead of sequences
    tasks: TaskSet | None = None  # LoRA fine-tuning: the adapters trained on the frozen model
    experts: ExpertParallel | None = None  # how a mixture of experts runs; None: not one
    stack: Stack = RUNTIME_STACK  # whose layers are priced (flexmesh.layout.stack)
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
        return self.tasks.batches(self.global_batch) if self.tasks is not None else (self.global_batch,)


def assemble(base: CostModel, stack: Stack = RUNTIME_STACK, tasks: TaskSet | None = None,
             experts: ExpertParallel | None = None) -> CostModel:
    """``base`` (a device's presets or profiles) pricing ``stack``'s layers, training ``tasks``' adapters
    on a frozen base, and running the experts as ``experts`` says: the one place a job's cost model is
    put together from its parts; each part left out leaves ``base`` as it is."""
    cost = with_tasks(with_stack(base, stack), tasks)
    return cost if experts is None else cost.with_experts(experts)


def build_job(model: ModelSpec, seq_len: int, global_batch: int, *, base: CostModel | None = None,
              cluster: MixedCluster | None = None, tokens_per_batch: int | None = None,
              tasks: TaskSet | None = None, experts: ExpertParallel | None = None, stack: Stack = RUNTIME_STACK,
              dtype: str = "", plan: Plan | None = None) -> Job:
    """The :class:`Job` of these settings, its cost model assembled (:func:`assemble`) over ``base`` (one
    device type) or over each device group's presets of ``cluster`` (a mixed cluster); neither: a job
    that prices nothing."""
    cost = assemble(base, stack, tasks, experts) if base is not None else None
    costs = None
    if cluster is not None:
        costs = MixedCosts(model, cluster, groups=[assemble(CostModel(model, g), stack, tasks, experts)
                                                   for g in cluster.groups])
    return Job(model, seq_len, global_batch, tokens_per_batch, tasks, experts, stack, dtype, plan, cost, costs)
