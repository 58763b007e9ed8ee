"""The cost model of LoRA fine-tuning: a frozen base model and many tasks' adapters (docs/adapters.md).

What changes against training every weight (:class:`~flexmesh.cost.training.model.CostModel`), nothing else:

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
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np

from flexmesh.cost.device.hardware import group_shape
from flexmesh.cost.device.kernels import Kernels
from flexmesh.cost.training.analytic import AnalyticTiming, linear_shapes
from flexmesh.cost.training.model import CostModel
from flexmesh.layout.overlap import NO_OVERLAP, Overlap
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec.tasks import TaskSet, projection_shape


def adapter_params_per_layer(cost_model: CostModel, tasks: TaskSet) -> float:
    """Parameters of every task's adapters in one layer: r (in + out) per targeted projection."""
    total = 0.0
    for t in tasks:
        for target in t.targets:
            fan_in, fan_out = projection_shape(cost_model.model, target)
            total += t.rank * (fan_in + fan_out)
    return total


class AdapterCostModel(CostModel):
    """:class:`CostModel` of ``base`` (built the same way) training ``tasks``' LoRA adapters only."""

    def __init__(self, base: CostModel, tasks: TaskSet):
        super().__init__(base.model, base.cluster, hardware=base.hw, timing=base.timing)
        self.step_overlap = base.step_overlap
        self.tasks = tasks
        self.adapter_params = adapter_params_per_layer(self, tasks)
        self.ranks = {t: max(task.rank for task in tasks if t in task.targets) for t in tasks.targets()}
        self._analytic = base.timing if isinstance(base.timing, AnalyticTiming) else AnalyticTiming(base.model, base.hw)

    def _trainable(self, params: float) -> float:
        """Trainable parameters among ``params`` of a layer (its adapters) or of an end (none)."""
        return self.adapter_params if params == self.model.layer_params else 0.0

    def _states(self, params: float, s: LayerStrategy, overlap: Overlap = NO_OVERLAP) -> float:
        weights = params / s.tp * self.weight_bytes / (s.shard_degree if s.zero >= 3 else 1)
        return weights + self._trainable(params) * (self.weight_bytes + self.grad_bytes + self.optim_bytes)

    def _grad_comm(self, params: float, s: LayerStrategy, work_fwd: float, work_bwd: float,
                   overlap: Overlap = NO_OVERLAP):
        trainable = self._trainable(params)
        optim = trainable * self.timing.optimizer_s_per_param()
        d = s.shard_degree
        if d == 1:
            return 0.0, 0.0, 0.0, optim
        shape = group_shape(d, s.tp, self.cluster)
        ct = self.hw.collective_time
        sync = float(ct("all_reduce", trainable * self.grad_bytes, shape)) if trainable else 0.0
        if s.zero < 3:
            return 0.0, 0.0, sync, optim
        ag = ct("all_gather", params / s.tp * self.weight_bytes, shape)
        win_f, win_b = (work_fwd, work_bwd) if overlap.zero3_prefetch else (0.0, 0.0)
        return float(self.hw.exposed(ag, win_f)), float(self.hw.exposed(ag, win_b)), sync, optim

    def _layer_phases(self, s: LayerStrategy, tokens, sq_tokens, overlap: Overlap = NO_OVERLAP):
        fwd, bwd, comm_f, comm_b = super()._layer_phases(s, tokens, sq_tokens, overlap)
        k = self._analytic.kernels
        rows = tokens / s.cp
        wgrad = 0.0
        for n, red in linear_shapes(self.model, s.tp):
            wgrad = wgrad + k.gemm(n, red, rows)  # the weight gradient's GEMM (Kernels.linear)
        analytic = self._analytic.layer_times(s, tokens, sq_tokens)
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
        return fwd + a_f, bwd * (1 - share) + a_b, comm_f, comm_b

    def with_kernels(self, change: Callable[[Kernels], Kernels]) -> CostModel:
        return AdapterCostModel(super().with_kernels(change), self.tasks)

    def with_step_overlap(self, overlap: Overlap) -> CostModel:
        other = copy.copy(self)
        other.step_overlap = overlap
        return other


def with_tasks(cost: CostModel, tasks: TaskSet | None) -> CostModel:
    """``cost`` for fine-tuning ``tasks``' adapters; ``cost`` itself without tasks."""
    return cost if tasks is None else AdapterCostModel(cost, tasks)
