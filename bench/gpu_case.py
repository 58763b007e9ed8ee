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


# Kernel names by kind, for the profiler's breakdown of a step (first match wins).
KINDS = (("attention", r"flash|fmha|attention|attn"), ("GEMM", r"gemm|nvjet|cutlass|xmma|cublas|addmm|\bmm\b|matmul"),
         ("optimizer", r"adam|multi_tensor"), ("loss", r"cross_entropy|log_softmax|nll|logsumexp"),
         ("fused (Triton)", r"^triton_|_kernel$"), ("copies", r"copy|memcpy|memset|fill|cat|index"))


def traced_step(step, device_type: str) -> dict:  # noqa: ANN001
    """Run ``step()`` under torch.profiler: the device's busy time by kernel kind and the top kernels,
    against the step's wall time (a device idle for much of it waits on the host)."""
    import re
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device_type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages()
              if (e.device_type == torch.autograd.DeviceType.CUDA if cuda else e.key.startswith("aten::"))]
    own = [(e.key, (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6, e.count) for e in events]
    own = [o for o in own if o[1] > 0]
    kinds: dict[str, float] = {}
    for name, t, _ in own:
        kind = next((k for k, rx in KINDS if re.search(rx, name, re.I)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + t
    busy = sum(kinds.values())
    top = sorted(own, key=lambda o: -o[1])[:12]
    return {"wall_s": wall, "busy_s": busy, "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top": [{"name": n[:120], "s": t, "calls": c} for n, t, c in top]}
