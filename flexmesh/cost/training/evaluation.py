"""A plan's predicted step, as :meth:`flexmesh.cost.CostModel.evaluate_stages` returns it."""

from __future__ import annotations

from dataclasses import dataclass, field

from flexmesh.units import GIB


@dataclass
class Evaluation:
    """A plan's predicted step: time breakdown and per-pipeline-rank memory (bytes)."""

    step_time: float
    tokens_per_s: float
    mfu: float
    compute: float  # busiest rank's compute in the step, s
    exposed_comm: float
    bubble: float
    grad_sync: float  # exposed gradient sync + optimizer, s
    stage_times: list[float]  # per pp rank, one micro-batch (fwd + bwd), s
    memory: list[dict[str, float]]  # per pp rank: states, activations, transient, logits, total (bytes)
    fits: bool
    budget: float  # usable bytes per device: what ``total`` may reach
    extra: dict = field(default_factory=dict)
    # What the device shows beyond the tensors counted in ``memory``: the CUDA context (bytes) and the
    # caching allocator's fragmentation (a fraction of the tensors' bytes); docs/cost-model.md, "Memory".
    reserve: float = 0.0
    fragmentation: float = 0.0

    @property
    def peak_memory(self) -> float:
        """Bytes on the fullest pipeline rank."""
        return max(m["total"] for m in self.memory)

    @property
    def device_peak_memory(self) -> float:
        """Bytes the fullest device shows at its peak (nvidia-smi's figure): tensors, fragmentation, context."""
        return self.peak_memory * (1.0 + self.fragmentation) + self.reserve

    def to_dict(self) -> dict:
        """The plan file's ``predicted`` section (docs/plan-format.md): seconds and GiB."""
        return {
            "step_time_s": self.step_time,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "breakdown_s": {
                "compute": self.compute, "exposed_comm": self.exposed_comm, "bubble": self.bubble,
                "grad_sync_and_optimizer": self.grad_sync,
            },
            "stage_time_s": self.stage_times,
            "peak_memory_gib": [m["total"] / GIB for m in self.memory],
            "memory_gib": [{k: v / GIB for k, v in m.items()} for m in self.memory],
            "memory_budget_gib": self.budget / GIB,
            "device_peak_gib": self.device_peak_memory / GIB,
            "fits": self.fits,
        }
