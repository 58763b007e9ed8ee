"""Run scheduling policies over the same global batches and simulate every step.

This is what ``flexmesh simulate`` and ``bench/schedule.py`` share: each policy schedules each batch
(:func:`flexmesh.schedule.registry.make_schedule`), the simulator plays the schedule out
(:func:`flexmesh.sim.timeline.simulate_step`), and the steps are summarised.

``fixed`` is run once for every static context-parallel degree whose memory holds a full context
slot; the degree with the lowest mean step time is kept and named (``fixed (cp=8)``), so the speedup
of the other policies is measured against the best static setting, not a strawman.

Ratio to the lower bound: the scheduler's bound covers the micro-batch phase only (see
:mod:`flexmesh.schedule.lower_bound`); every schedule also pays the step's exposed gradient sync and optimizer,
so the simulated step time is compared with ``lower_bound + tail`` where ``tail`` is that step's
simulated gradient sync + optimizer time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence, cast

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.errors import ScheduleError
from flexmesh.layout.step import StepSchedule
from flexmesh.schedule.context import ScheduleContext
from flexmesh.sim.timeline import StepTimeline, simulate_step

ScheduleFn = Callable[..., StepSchedule]


@dataclass(frozen=True)
class PolicyRun:
    """One policy over a series of steps; per-step tuples are in step order."""

    policy: str
    label: str  # e.g. "fixed (cp=8)"
    options: dict
    step_times: tuple[float, ...]  # simulated, s
    tokens: tuple[int, ...]  # tokens trained per step (deferred sequences excluded)
    imbalance: tuple[float, ...]  # simulated: slowest rank's micro-batch phase / mean
    ratio_to_lower_bound: tuple[float, ...]
    scheduler_seconds: tuple[float, ...]
    utilisation: tuple[float, ...]  # mean over lanes of compute / step
    predicted_step_times: tuple[float, ...]  # the scheduler's own estimate (micro-batch phase only)
    padding: tuple[float, ...]
    speedup: float = float("nan")  # tokens/s over the best fixed run; filled by compare_policies
    first_timeline: StepTimeline | None = field(default=None, compare=False, repr=False)

    @property
    def steps(self) -> int:
        """Steps simulated."""
        return len(self.step_times)

    @property
    def mean_step_time(self) -> float:
        """Mean simulated step time, s."""
        return float(np.mean(self.step_times))

    @property
    def tokens_per_s(self) -> float:
        """Tokens trained over simulated seconds, all steps together."""
        return float(np.sum(self.tokens) / np.sum(self.step_times))

    @property
    def scheduler_ms(self) -> float:
        """Mean time the scheduler took per step, ms."""
        return 1e3 * float(np.mean(self.scheduler_seconds))

    @property
    def scheduler_ms_p95(self) -> float:
        """95th percentile of the scheduler's time per step, ms."""
        return 1e3 * float(np.percentile(self.scheduler_seconds, 95))

    def to_dict(self) -> dict:
        """Means over the steps and the per-step series, JSON-serialisable."""
        return {
            "policy": self.policy,
            "label": self.label,
            "options": dict(self.options),
            "steps": self.steps,
            "mean_step_time_s": self.mean_step_time,
            "tokens_per_s": self.tokens_per_s,
            "speedup_vs_fixed": None if np.isnan(self.speedup) else self.speedup,
            "imbalance": float(np.mean(self.imbalance)),
            "ratio_to_lower_bound": float(np.mean(self.ratio_to_lower_bound)),
            "scheduler_ms_per_step": self.scheduler_ms,
            "scheduler_ms_p95": self.scheduler_ms_p95,
            "utilisation": float(np.mean(self.utilisation)),
            "padding": float(np.mean(self.padding)),
            "predicted_step_time_s": float(np.mean(self.predicted_step_times)),
            "per_step": {
                "step_time_s": list(self.step_times),
                "tokens": list(self.tokens),
                "imbalance": list(self.imbalance),
                "ratio_to_lower_bound": list(self.ratio_to_lower_bound),
                "scheduler_s": list(self.scheduler_seconds),
            },
        }


def _scheduled_tokens(s: StepSchedule) -> int:
    return sum(g.tokens for g in s.groups)


def run_policy(policy: str, batches: Sequence[np.ndarray], ctx: ScheduleContext, *, seed: int = 0,
               options: dict | None = None, label: str | None = None, virtual_stages: int = 1,
               speed: ArrayLike | None = None,
               slot_tokens: int | None = None, make_schedule: ScheduleFn | None = None,
               on_step: Callable[[], None] | None = None) -> PolicyRun:
    """Schedule and simulate every batch with one policy; the first step keeps its detailed timeline."""
    schedule_fn: ScheduleFn
    if make_schedule is None:
        # Imported here: callers that bring their own scheduling function never load the policies.
        from flexmesh.schedule.registry import make_schedule as default_schedule

        schedule_fn = cast(ScheduleFn, default_schedule)  # batches are arrays; any int sequence will do
    else:
        schedule_fn = make_schedule
    options = dict(options or {})
    rows: dict[str, list] = {k: [] for k in ("t", "tok", "imb", "lb", "sch", "util", "pred", "pad")}
    first = None
    for k, lengths in enumerate(batches):
        s = schedule_fn(policy, lengths, ctx, seed=seed + k, **options)
        tl = simulate_step(ctx, s, virtual_stages=virtual_stages, speed=speed, slot_tokens=slot_tokens,
                           detail=k == 0)
        if k == 0:
            first = tl
        rows["t"].append(tl.step_time)
        rows["tok"].append(_scheduled_tokens(s))
        rows["imb"].append(tl.imbalance)
        rows["lb"].append(tl.step_time / (s.lower_bound + tl.tail) if s.lower_bound > 0 else float("nan"))
        rows["sch"].append(s.scheduler_seconds)
        rows["util"].append(float(tl.utilisation.mean()))
        rows["pred"].append(s.predicted_step_time)
        rows["pad"].append(float(s.extra.get("padding", 0.0)))
        if on_step is not None:
            on_step()
    return PolicyRun(policy=policy, label=label or policy, options=options, step_times=tuple(rows["t"]),
                     tokens=tuple(rows["tok"]), imbalance=tuple(rows["imb"]), ratio_to_lower_bound=tuple(rows["lb"]),
                     scheduler_seconds=tuple(rows["sch"]), utilisation=tuple(rows["util"]),
                     predicted_step_times=tuple(rows["pred"]), padding=tuple(rows["pad"]), first_timeline=first)


def fixed_degrees(ctx: ScheduleContext, context: int) -> list[int]:
    """Static context-parallel degrees whose memory holds one full slot of ``context`` tokens."""
    return [d for d in ctx.group_sizes if ctx.max_tokens(d) >= context]


def compare_policies(policies: Sequence[str], batches: Sequence[np.ndarray], ctx: ScheduleContext, *,
                     context: int, seed: int = 0, virtual_stages: int = 1, speed: ArrayLike | None = None,
                     make_schedule: ScheduleFn | None = None,
                     on_step: Callable[[], None] | None = None) -> list[PolicyRun]:
    """Run each policy (``fixed`` at its best static degree) over ``batches``; speedups relative to fixed.

    ``batches`` must already be truncated to ``context`` tokens per sequence.
    """
    longest = max(int(np.max(b)) for b in batches)
    if longest > context:
        raise ScheduleError(f"a batch holds a {longest}-token sequence but the context is {context}; "
                            f"truncate the batches to the context length")
    runs: list[PolicyRun] = []
    common: dict[str, Any] = dict(seed=seed, virtual_stages=virtual_stages, speed=speed,
                                  make_schedule=make_schedule, on_step=on_step)
    for policy in policies:
        if policy != "fixed":
            runs.append(run_policy(policy, batches, ctx, **common))
            continue
        degrees = fixed_degrees(ctx, context)
        if not degrees:
            raise ScheduleError(
                f"no static context-parallel degree holds a {context}-token slot (largest group of "
                f"{ctx.group_sizes[-1]} ranks holds {ctx.max_tokens(ctx.group_sizes[-1])}); lower --context, "
                f"enable --recompute, or add devices"
            )
        tried = [run_policy("fixed", batches, ctx, options={"cp": d, "context": context},
                            label=f"fixed (cp={d})", slot_tokens=context, **common) for d in degrees]
        runs.append(min(tried, key=lambda r: r.mean_step_time))
    base = next((r for r in runs if r.policy == "fixed"), None)
    if base is None:
        return runs
    return [replace(r, speedup=r.tokens_per_s / base.tokens_per_s) for r in runs]


def fixed_runs_needed(ctx: ScheduleContext, context: int, policies: Sequence[str]) -> int:
    """How many policy runs :func:`compare_policies` makes (for a progress bar)."""
    return sum(len(fixed_degrees(ctx, context)) if p == "fixed" else 1 for p in policies)
