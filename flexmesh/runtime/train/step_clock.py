"""A training step's clock and its per-step figures: marks taken inside the step without waiting for
the device, the optimizer's step once the gradients are final, and the one gather of every rank's
figures into the StepMetrics fields every step reports (flexmesh.runtime.train.trainer)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from flexmesh.layout.step import StepSchedule
from flexmesh.runtime.model.attention_kernels import USED as ATTENTION_KERNELS_USED
from flexmesh.runtime.parallel.distributed import peak_memory_gib


def update(optimizer: torch.optim.Optimizer, lr_scheduler, device: torch.device,
           t0: float) -> tuple[list[float], float]:
    """The step's optimizer and learning-rate scheduler steps, once the gradients are final: (the
    learning rate each parameter group used, seconds since ``t0`` once the device has finished)."""
    lr = [float(g["lr"]) for g in optimizer.param_groups]
    optimizer.step()
    lr_scheduler.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return lr, time.perf_counter() - t0


def gathered_step(row: Sequence[float], group, schedule: StepSchedule,
                  device: torch.device) -> tuple[torch.Tensor, dict]:
    """One all_gather over ``group`` of each rank's ``row`` -- its share of the loss (0 where another
    rank holds it), busy seconds, saved-activation peak bytes (negative: not metered this step),
    elapsed seconds, then anything else -- and the StepMetrics fields every trainer derives from that
    table and the schedule. Returns the table (one row per rank) and those fields."""
    mine = torch.tensor(list(row), dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows)
    step_time = float(table[:, 3].max())
    tokens = sum(p.length for g in schedule.groups for mb in g.microbatches for p in mb)
    return table, {
        "loss": float(table[:, 0].sum()), "tokens": tokens, "step_time_s": step_time,
        "tokens_per_s": tokens / step_time if step_time > 0 else 0.0, "peak_memory_gib": peak_memory_gib(device),
        "policy": schedule.policy, "requested_policy": schedule.requested_policy or schedule.policy,
        "fallback": schedule.fallback, "scheduler_s": schedule.scheduler_seconds,
        "predicted_step_time_s": schedule.predicted_step_time if schedule.predicted_step_time > 0 else None,
        "busy_s": tuple(float(x) for x in table[:, 1]),
        "activation_peak_bytes": () if bool((table[:, 2] < 0).any()) else tuple(int(x) for x in table[:, 2]),
        "attention_kernel": "+".join(sorted(ATTENTION_KERNELS_USED)),
    }


class Marks:
    """Seconds from the step's start to chosen points of it, with no synchronisation before the step's
    end: CUDA events on a GPU, read by :meth:`seconds` once the step has synchronised; the host clock
    on CPU."""

    def __init__(self, device: torch.device, t0: float) -> None:
        self.cuda, self.t0 = device.type == "cuda", t0
        self.start = self._event() if self.cuda else None

    @staticmethod
    def _event():  # noqa: ANN205
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def mark(self):  # noqa: ANN201 - an event on a GPU, seconds on CPU
        return self._event() if self.cuda else time.perf_counter() - self.t0

    def seconds(self, mark) -> float:  # noqa: ANN001
        if self.start is None:  # on CPU marks are seconds already
            return float(mark)
        return self.start.elapsed_time(mark) / 1e3
