"""The cases of bench.gpu and what every system's worker shares: the model, the plan, the steps' documents,
the ``fixed`` policy's schedules and the device (bench/gpu.py runs flexmesh and transformers on them,
bench/gpu_torchtitan.py torchtitan)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Case:
    name: str
    doc_len: int  # fixed document length, or the cap of the shipped lengths (mix)
    docs_per_step: int
    microbatch_tokens: int
    mixed: bool = False


GPU_CASES = (Case("2048", 2048, 16, 8192), Case("8192", 8192, 4, 8192), Case("mix", 8192, 40, 8192, mixed=True))
CPU_CASES = (Case("256", 256, 8, 1024), Case("1024", 1024, 2, 1024), Case("mix", 1024, 8, 1024, mixed=True))


def model_spec(cpu: bool):
    from flexmesh.spec.model import MODEL_PRESETS

    if cpu:
        return replace(MODEL_PRESETS["tiny"], dtype="fp32")
    return replace(MODEL_PRESETS["tinyllama-1.1b"], max_position=8192, dtype="bf16")


def make_plan(spec, case: Case, cluster: str):
    """One rank, no parallelism; ``seq_len`` the case's documents, micro-batches of the case's tokens."""
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    s = LayerStrategy.parse("tp1-dp1z0")
    m = case.docs_per_step * case.doc_len // case.microbatch_tokens
    return Plan.uniform(model=spec.name, cluster=cluster, world_size=1, pp=1, pipeline_schedule="1f1b",
                        num_microbatches=m,
                        seq_len=case.doc_len, global_batch=case.docs_per_step,
                        stages=(StagePlan(0, spec.num_layers, (s,) * spec.num_layers),))


def make_steps(spec, case: Case, steps: int, seed: int = 0) -> list[list[np.ndarray]]:
    """The documents of every step: random token ids, of the case's lengths."""
    from flexmesh.data.lengths import load_lengths

    rng = np.random.default_rng(seed)
    if case.mixed:
        pool = load_lengths("wikipedia")
        lengths = np.minimum(rng.choice(pool[pool >= 2], size=(steps, case.docs_per_step)), case.doc_len)
    else:
        lengths = np.full((steps, case.docs_per_step), case.doc_len)
    return [[rng.integers(1, spec.vocab, size=int(n)) for n in row] for row in lengths]


def schedules(spec, plan, steps_docs, max_len: int, cost=None):
    """The ``fixed`` policy's step schedules (packing under the plan's budget), with the simulator's
    predicted step time when ``cost`` is given."""
    from flexmesh.schedule.scheduler import Scheduler

    if cost is None:
        fn = Scheduler(plan, spec, "fixed", max_len)
    else:
        from flexmesh.sim.predict import simulated_scheduler

        fn = simulated_scheduler(Scheduler(plan, spec, "fixed", max_len, cost=cost))
    return [fn([len(d) for d in docs]) for docs in steps_docs]


def device_of(cpu: bool):
    import torch

    return torch.device("cpu" if cpu or not torch.cuda.is_available() else "cuda")


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def case_of(a: argparse.Namespace) -> Case:
    return next(c for c in (CPU_CASES if a.cpu else GPU_CASES) if c.name == a.case)
