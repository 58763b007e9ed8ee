"""What a training job holds beyond a dense model trained whole on flexmesh's runtime: the parts the
cost model is assembled from (:class:`~flexmesh.cost.training.model.CostModel`).

Each part changes a few answers of the layer's pricing and is asked for them, never subclassed or
wrapped around the cost model:

- ``stack``: how another training stack runs a layer (:mod:`flexmesh.layout.stack`: unfused attention,
  tensor parallelism without sequence parallelism, dropout); the layer timing prices it, and a model
  profile, which times flexmesh's own runtime, prices no other;
- ``experts``: how a mixture of experts runs (:class:`~flexmesh.cost.training.experts.ExpertParallel`);
  read only for a MoE model (:mod:`flexmesh.cost.training.expert_layers`);
- ``tasks``: LoRA fine-tuning, a frozen base and these tasks' adapters
  (:mod:`flexmesh.cost.training.adapters`); None: every weight trains
  (:mod:`flexmesh.cost.training.weights`).

>>> Parts().stack.label, Parts().tasks is None
('flash2 attention, sequence parallel', True)
"""

from __future__ import annotations

from dataclasses import dataclass

from flexmesh.cost.training.experts import ExpertParallel
from flexmesh.layout.stack import RUNTIME_STACK, Stack
from flexmesh.spec.tasks import TaskSet


@dataclass(frozen=True)
class Parts:
    """The parts of a job the cost model prices (see the module doc); the default: full training of a
    dense model (or a MoE model at its default placement) on flexmesh's runtime."""

    stack: Stack = RUNTIME_STACK
    experts: ExpertParallel = ExpertParallel()
    tasks: TaskSet | None = None
