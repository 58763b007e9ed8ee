"""Run scheduling policies over the same global batches and simulate every step.

This is what ``flexmesh simulate`` and ``bench/schedule.py`` share: each policy schedules each batch
(:func:`flexmesh.schedule.registry.make_schedule`), the simulator plays the schedule out
(:func:`flexmesh.sim.timeline.simulate_step`), and the steps are summarised.

The baselines (``fixed``, ``padded``, ``balanced``, ``wlb``: what people run, one static
context-parallel degree each) always run, each over its own knob: every static degree whose memory
holds its micro-batches (:func:`baseline_options`); the fastest setting is kept and named
(``fixed (cp=8)``). Every speedup is the tokens/s of a run over that of the best baseline on the same
batches, so an adaptive policy is measured against the strongest static setting, not a strawman.

Sequences a schedule defers (``wlb``'s outlier delay, ``balanced`` with ``defer=True``) go to the
front of the next batch, as a loader that holds them would; tokens still held after the last step
are not counted as trained.

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
from flexmesh.layout.enums import Policy
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
    speedup: float = float("nan")  # tokens/s over the best baseline's; filled by compare_policies
    # With speed factors: tokens/s of the same policy and options when its schedules are made for
    # nominal speed and run at the true speeds (flexmesh.sim.simulation.with_static); None otherwise.
    static_tokens_per_s: float | None = None
    first_timeline: StepTimeline | None = field(default=None, compare=False, repr=False)

    @property
    def kind(self) -> str:
        """``baseline`` (one static degree, what people run) or ``adaptive`` (chooses per step)."""
        known = self.policy in {str(p) for p in Policy}
        return "baseline" if known and Policy(self.policy).is_baseline else "adaptive"

    @property
    def mean_ratio_to_lower_bound(self) -> float:
        """Mean over the steps of simulated step / (lower bound + tail)."""
        return float(np.mean(self.ratio_to_lower_bound))

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
            "kind": self.kind,
            "options": dict(self.options),
            "steps": self.steps,
            "mean_step_time_s": self.mean_step_time,
            "tokens_per_s": self.tokens_per_s,
            "speedup_vs_best_baseline": None if np.isnan(self.speedup) else self.speedup,
            "imbalance": float(np.mean(self.imbalance)),
            "ratio_to_lower_bound": self.mean_ratio_to_lower_bound,
            "scheduler_ms_per_step": self.scheduler_ms,
            "scheduler_ms_p95": self.scheduler_ms_p95,
            "utilisation": float(np.mean(self.utilisation)),
            "padding": float(np.mean(self.padding)),
            "predicted_step_time_s": float(np.mean(self.predicted_step_times)),
            "static_tokens_per_s": self.static_tokens_per_s,
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
    held = np.zeros(0, dtype=np.int64)
    for k, batch in enumerate(batches):
        lengths = np.concatenate([held, np.asarray(batch, dtype=np.int64)])  # held sequences arrive first
        s = schedule_fn(policy, lengths, ctx, seed=seed + k, **options)
        held = lengths[list(s.deferred)] if s.deferred else held[:0]
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
    """Static context-parallel degrees whose memory holds one micro-batch of ``context`` tokens."""
    return [d for d in ctx.group_sizes if ctx.max_tokens(d) >= context]


BASELINES: tuple[str, ...] = tuple(str(p) for p in Policy if p.is_baseline)


def baseline_options(policy: str, ctx: ScheduleContext, context: int, longest: int) -> list[dict]:
    """The settings a baseline is swept over: every static degree that holds what it must hold.

    ``fixed`` and ``padded`` pack micro-batches (slots) of ``context`` tokens, so their degree must
    hold that many; ``balanced`` and ``wlb`` only need the longest sequence of the batches.
    """
    if policy in (Policy.FIXED, Policy.PADDED):
        return [{"cp": d, "context": context} for d in fixed_degrees(ctx, context)]
    return [{"cp": d} for d in fixed_degrees(ctx, longest)]


def compare_policies(policies: Sequence[str], batches: Sequence[np.ndarray], ctx: ScheduleContext, *,
                     context: int, seed: int = 0, virtual_stages: int = 1, speed: ArrayLike | None = None,
                     make_schedule: ScheduleFn | None = None,
                     on_step: Callable[[], None] | None = None) -> list[PolicyRun]:
    """Every baseline at its best setting, then the other ``policies``; speedups over the best baseline.

    Baselines come first (in :data:`BASELINES` order), whether or not ``policies`` names them: the
    speedups are measured against the best of them. ``batches`` must already be truncated to
    ``context`` tokens per sequence.
    """
    longest = max(int(np.max(b)) for b in batches)
    if longest > context:
        raise ScheduleError(f"a batch holds a {longest}-token sequence but the context is {context}; "
                            f"truncate the batches to the context length")
    runs: list[PolicyRun] = []
    common: dict[str, Any] = dict(seed=seed, virtual_stages=virtual_stages, speed=speed,
                                  make_schedule=make_schedule, on_step=on_step)
    for policy in list(BASELINES) + [p for p in policies if p not in BASELINES]:
        if policy not in BASELINES:
            runs.append(run_policy(policy, batches, ctx, **common))
            continue
        settings = baseline_options(policy, ctx, context, longest)
        if not settings:
            raise ScheduleError(
                f"no static context-parallel degree holds a {context}-token micro-batch (largest group of "
                f"{ctx.group_sizes[-1]} ranks holds {ctx.max_tokens(ctx.group_sizes[-1])}); lower --seq-len, "
                f"enable --recompute, or add devices"
            )
        # A padded slot computes its padding too: the simulator charges every micro-batch `context` tokens.
        slot = context if policy == Policy.PADDED else None
        tried = [run_policy(policy, batches, ctx, options=o, label=f"{policy} (cp={o['cp']})", slot_tokens=slot,
                            **common) for o in settings]
        runs.append(min(tried, key=lambda r: r.mean_step_time))
    base = best_baseline(runs)
    return [replace(r, speedup=r.tokens_per_s / base.tokens_per_s) for r in runs]


def why_faster(fast: PolicyRun, slow: PolicyRun) -> str:
    """The term that differs most between two runs' steps: imbalance over the data ranks, padding, or
    idle time (pipeline bubbles and exposed communication, read from the ranks' utilisation)."""
    terms = {
        "imbalance": (float(np.mean(slow.imbalance)) / max(float(np.mean(fast.imbalance)), 1e-9),
                      lambda r: f"slowest data rank {np.mean(r.imbalance):.2f}x the mean"),
        "padding": ((1 + float(np.mean(slow.padding))) / (1 + float(np.mean(fast.padding))),
                    lambda r: f"{np.mean(r.padding):.0%} padding"),
        "idle time": (float(np.mean(fast.utilisation)) / max(float(np.mean(slow.utilisation)), 1e-9),
                      lambda r: f"ranks busy {np.mean(r.utilisation):.0%} of the step"),
    }
    name, (ratio, say) = max(terms.items(), key=lambda kv: kv[1][0])
    if ratio <= 1.01:  # no one term: the whole step against what no schedule beats
        return (f"{slow.label}'s step is {slow.mean_ratio_to_lower_bound:.2f}x its lower bound, {fast.label}'s "
                f"{fast.mean_ratio_to_lower_bound:.2f}x")
    return f"{name}: {slow.label} {say(slow)}, {fast.label} {say(fast)}"


@dataclass(frozen=True)
class Recommendation:
    """The ``--policy`` to train with, against the runtime's default, and why: the line ``simulate`` and
    ``plan`` print and the ``recommendation`` object of their ``--json`` (docs/simulate-output.md)."""

    policy: str  # the value of train's --policy
    schedule: str  # the simulated run it stands for ("hdp", "fixed (cp=8)", "dispatch+hdp")
    against: str  # the policy compared with: train's default for one replica group (fixed), shares for several
    speedup: float | None  # the recommended run's tokens/s over that policy's; None where it did not run
    why: str  # the term that makes the difference, or why the default is kept
    line: str  # the one line printed
    left_out: tuple[str, ...] = ()  # runs not considered: their scheduler takes longer than the step

    def to_dict(self) -> dict:
        return {"policy": self.policy, "schedule": self.schedule, "against": self.against, "speedup": self.speedup,
                "why": self.why, "left_out": list(self.left_out),
                "line": self.line}


def recommendation(runs: Sequence[PolicyRun], default: str = "fixed", margin: float = 0.02) -> Recommendation:
    """The ``--policy`` to train with, against the runtime's ``default``, and why.

    The fastest run is recommended when it beats the default's by more than ``margin``; otherwise the
    default, saying how the adaptive policies fared (they can lose: pipeline plans, small batches). A
    policy whose scheduler takes longer than the step on this machine is left out: training schedules
    the next step during the current one, and a late schedule is replaced by the fallback's."""
    late = [r for r in runs if r.scheduler_ms / 1e3 > r.mean_step_time and r.policy != default]
    runs = [r for r in runs if r not in late] or list(runs)
    best = max(runs, key=lambda r: r.tokens_per_s)
    base = next((r for r in runs if r.policy == default), None)
    left = tuple(r.label for r in late)
    if base is None:
        return Recommendation(best.policy, best.label, default, None, "the fastest here",
                              f"recommended: --policy {best.policy} ({best.label}), the fastest here", left)
    gain = best.tokens_per_s / base.tokens_per_s
    left_out = (f" ({', '.join(left)} left out: its scheduler takes longer than the step here)" if late else "")
    if best is not base and gain > 1 + margin:
        why = why_faster(best, base)
        return Recommendation(best.policy, best.label, default, gain, why,
                              f"recommended: --policy {best.policy} ({best.label}), {gain:.2f}x the tokens/s of the "
                              f"default {base.label}; why, {why}{left_out}", left)
    adaptive = [r for r in runs if r.kind == "adaptive"]
    why = f"no policy here is {margin:.0%} faster"
    if adaptive:
        top = max(adaptive, key=lambda r: r.tokens_per_s)
        ratio = top.tokens_per_s / base.tokens_per_s
        why += f"; the best adaptive, {top.label}, gives {ratio:.2f}x" + (
            f" (why, {why_faster(base, top)})" if ratio < 1 else "")
    return Recommendation(default, base.label, default, 1.0, why,
                          f"recommended: the default --policy {default} ({base.label}): {why}{left_out}", left)


def best_baseline(runs: Sequence[PolicyRun]) -> PolicyRun:
    """The baseline run with the most tokens/s (the reference of every speedup)."""
    return max((r for r in runs if r.kind == "baseline"), key=lambda r: r.tokens_per_s)


def runs_needed(ctx: ScheduleContext, context: int, policies: Sequence[str]) -> int:
    """How many policy runs :func:`compare_policies` makes at most (for a progress bar)."""
    extra = [p for p in policies if p not in BASELINES]
    return sum(len(baseline_options(p, ctx, context, 1)) for p in BASELINES) + len(extra)
