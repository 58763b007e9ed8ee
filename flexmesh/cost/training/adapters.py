"""LoRA fine-tuning as a part of the cost model: a frozen base and many tasks' adapters (docs/adapters.md).

What changes against training every weight (:class:`~flexmesh.cost.training.weights.FullTraining`),
nothing else:

- Backward computes no weight gradient of the base: each layer's backward loses its weight-gradient
  GEMMs, one GEMM of the forward's shape per linear layer (``Kernels.linear``: backward = input
  gradient + weight gradient). Under a model profile, whose backward is measured whole, the same
  share is taken off as the analytic model of the same device gives it.
- The adapters add, per adapted projection, the two skinny GEMMs ``x A^T`` (rank r) and ``(.) B^T``
  forward and both gradients backward, priced by the same kernels at the largest rank of a task
  that adapts the projection (every token is charged at it: an upper bound); under tensor
  parallelism split as the runtime splits them (the rank-r all-reduce of row-parallel ones is left
  out: T x r values).
- States: the base keeps its weights only (no gradient, no optimizer state; ZeRO-3 still shards
  them); the adapters keep weights, gradients and AdamW states, replicated.
- Gradient sync moves the adapters' gradients only, once per step; ZeRO-3 still gathers the base's
  weights every micro-batch, forward and backward. The optimizer steps the adapters only.
- Saved activations are priced as in full training (an upper bound: a frozen linear layer that no
  adapter targets need not keep its input).

>>> from flexmesh.cost import CostModel
>>> from flexmesh.cost.training.parts import Parts
>>> from flexmesh.spec import parse_cluster, parse_model
>>> from flexmesh.spec.tasks import Task, TaskSet
>>> tasks = TaskSet((Task(name="chat", rank=8, alpha=16, targets=("q_proj", "v_proj")),))
>>> lora = CostModel(parse_model("llama2-7b"), parse_cluster("8xA100-80GB"), parts=Parts(tasks=tasks))
>>> type(lora.trained).__name__, lora.trained.adapter_params  # r (in + out) for q and v: 8 x 2 x 8192
('AdapterCosts', 131072.0)
"""

from __future__ import annotations

import numpy as np

from flexmesh.cost.device.hardware import Hardware, group_shape
from flexmesh.cost.training.analytic import AnalyticTiming, linear_shapes
from flexmesh.cost.training.weights import GradComm
from flexmesh.cost.training.work import Amount
from flexmesh.layout.overlap import NO_OVERLAP, Overlap
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.model import ModelSpec
from flexmesh.spec.tasks import TaskSet, projection_shape


def adapter_params_per_layer(model: ModelSpec, tasks: TaskSet) -> float:
    """Parameters of every task's adapters in one layer: r (in + out) per targeted projection."""
    total = 0.0
    for t in tasks:
        for target in t.targets:
            fan_in, fan_out = projection_shape(model, target)
            total += t.rank * (fan_in + fan_out)
    return total


class AdapterCosts:
    """A frozen base training ``tasks``' LoRA adapters (see the module doc); ``analytic``: the analytic
    timing of the same device, whose kernels price the adapters' GEMMs and the weight gradients left out."""

    def __init__(self, model: ModelSpec, hw: Hardware, cluster: ClusterSpec, state_bytes: tuple[float, float, float],
                 optimizer_s_per_param: float, tasks: TaskSet, analytic: AnalyticTiming,
                 reduce_bytes: float | None = None):
        self.model, self.hw, self.cluster = model, hw, cluster
        self.weight_bytes, self.grad_bytes, self.optim_bytes = state_bytes
        self.reduce_bytes = self.grad_bytes if reduce_bytes is None else reduce_bytes
        self.optimizer_s_per_param = optimizer_s_per_param
        self.tasks = tasks
        self.adapter_params = adapter_params_per_layer(model, tasks)
        self.ranks = {t: max(task.rank for task in tasks if t in task.targets) for t in tasks.targets()}
        self.analytic = analytic

    def synced_params(self, params: float) -> float:
        """Trainable parameters among ``params`` of a layer (its adapters) or of an end (none)."""
        return self.adapter_params if params == self.model.layer_params else 0.0

    def states(self, params: float, s: LayerStrategy, overlap: Overlap = NO_OVERLAP) -> float:
        weights = params / s.tp * self.weight_bytes / (s.shard_degree if s.zero >= 3 else 1)
        return weights + self.synced_params(params) * (self.weight_bytes + self.grad_bytes + self.optim_bytes)

    def grad_comm(self, params: float, s: LayerStrategy, work_fwd: float, work_bwd: float,
                  overlap: Overlap = NO_OVERLAP) -> GradComm:
        trainable = self.synced_params(params)
        optim = trainable * self.optimizer_s_per_param
        d = s.shard_degree
        if d == 1:
            return 0.0, 0.0, 0.0, optim
        shape = group_shape(d, s.tp, self.cluster)
        ct = self.hw.collective_time
        sync = float(ct("all_reduce", trainable * self.reduce_bytes, shape)) if trainable else 0.0
        if s.zero < 3:
            return 0.0, 0.0, sync, optim
        ag = ct("all_gather", params / s.tp * self.weight_bytes, shape)
        win_f, win_b = (work_fwd, work_bwd) if overlap.zero3_prefetch else (0.0, 0.0)
        return float(self.hw.exposed(ag, win_f)), float(self.hw.exposed(ag, win_b)), sync, optim

    def compute(self, s: LayerStrategy, tokens: Amount, sq_tokens: Amount, fwd: Amount,
                bwd: Amount) -> tuple[Amount, Amount]:
        """The layer's compute less the base's weight gradients, plus the adapters' GEMMs."""
        k = self.analytic.kernels
        rows = tokens / s.cp
        wgrad = 0.0
        for n, red in linear_shapes(self.model, s.tp):
            wgrad = wgrad + k.gemm(n, red, rows)  # the weight gradient's GEMM (Kernels.linear)
        analytic = self.analytic.layer_times(s, tokens, sq_tokens)
        total = np.asarray(analytic.bwd, dtype=float)
        share = np.where(total > 0, wgrad / np.where(total > 0, total, 1.0), 0.0)
        a_f = a_b = 0.0
        for target, r in self.ranks.items():
            fan_in, fan_out = projection_shape(self.model, target)
            # under tp the adapter splits as its projection does (flexmesh.runtime.model.lora.Adapters): a
            # column-parallel one's B by rows, a row-parallel one's A by columns; the other factor whole
            column = target not in ("o_proj", "down_proj")
            shapes = ((r, fan_in), (fan_out / s.tp, r)) if column else ((r, fan_in / s.tp), (fan_out, r))
            for n, red in shapes:
                f, b = k.linear(rows, n, red)
                a_f, a_b = a_f + f, a_b + b
        return fwd + a_f, bwd * (1 - share) + a_b
