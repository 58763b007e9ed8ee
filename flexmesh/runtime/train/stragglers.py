"""Stragglers: measure every rank's speed each step, detect a sustained change, re-plan the schedules.

Measure. Each rank times its own micro-batches' forwards and backwards (:class:`ComputeClock`,
``compute_s`` in metrics.jsonl): compute, without the packing before it, the gradient reduction
after it and the waits for other ranks at the step's end. The step's schedule says how long the
cost model expects each data rank's work to take (``Group.predicted_time``) at the speeds the
schedule was made for (``StepSchedule.extra["speed"]``, stamped by the Scheduler); times that speed
it is the work at nominal speed. A rank's measured speed is that work over its compute time,
divided by the fastest rank's: relative speeds, so a cost model that is off by the same factor on
every rank (a preset for another device, an uncalibrated profile) still compares ranks correctly.
The figures ride on the trainer's one per-step ``all_gather`` (flexmesh.runtime.train.trainer).

Pace. The fastest rank's own speed against the cost model is the machine's pace (``pace`` in
metrics.jsonl; 1.0: as profiled): a profile taken while a shared machine ran faster, or a device
running hotter than when it was profiled, shows as a pace below 1 on every rank, which relative
speeds cancel and absolute step times do not. Each step also logs ``paced_step_time_s``: the
simulator's step time for its schedule with every data rank at the median of its own speeds against
the cost model (relative speed times pace) over the latest :data:`PACE_STEPS` steps before it (after
the warm-up), a prediction made before the step it predicts. Schedules and re-plans use relative
speeds only: a pace that moves every rank alike changes no rank's share.

Detect (:class:`SpeedDetector`). A data rank deviates when its measured speed differs from the speed
its schedule assumed by more than ``threshold`` (relative). Whether a deviation is sustained depends on
the machine's noise: the mean change of a rank's speed from one step to the next, over every rank's
latest :data:`NOISE_STEPS` steps (measured once each rank has changed twice: nothing is judged before).
On a quiet machine (that noise times :data:`NOISE_BAND` within the threshold) a deviation is sustained
after ``steps`` consecutive deviating steps in the same direction at one speed (within half the
threshold). On a shared one (that band wider than the threshold, or the node's 1-minute load average
at least its cores plus one, :func:`contended`) other processes take a rank's core for a step or a
few and give it back, so speeds jump by tens of percent both ways; there a rank is judged on the mean
of its speeds since it was last judged (at least :data:`MEAN_STEPS` and ``steps + 1`` of them, at most
:data:`NOISE_STEPS`),
off by more than the threshold and :data:`SURE` standard errors, which load spread over the ranks
leaves near the assumed speed and a slow device does not; a streak of ``steps`` steps at one speed off
by more than twice the threshold is sustained there too. A rank off for ``steps`` steps in a row
whose mean, judged, is not off is load: ``speed_noise`` says so once per run, with the noise band and
the load. A sustained change is slower (``straggler_detected``), faster again and back within the
threshold of the fastest (``straggler_recovered``), or any other change of a rank's speed
(``speed_changed``: slower still, or faster but still slow). The first ``warmup`` steps are not judged
(the first step pays one-off costs: allocations, FSDP2's lazy initialisation).

Re-plan (:class:`StragglerMonitor`, rank 0, where the schedules are made). The proposal: each
sustained rank at the median of its last ``steps`` measured speeds, the others as assumed, scaled
so that the fastest is 1. Honest rule: the simulator prices the step just trained twice at the
proposed (believed real) speeds, once as scheduled for the current speeds and once as scheduled for
the proposed ones; the schedules change only when the second is faster by at least ``min_gain``
(``replanned``, with the predicted gain), else nothing changes (``replan_declined``). One step's
documents can leave a re-plan nothing to gain (a long document the old schedule already gave the
fast rank) where the next steps' would: a declined proposal is priced again on each of the next
:data:`RETRY_STEPS` steps' documents (unless the speeds change meanwhile) and applied on the first
where it pays (``replanned``); those retries log nothing while they decline. A change goes
to the scheduler's ``ScheduleContext.speed`` (placers, lower bound and simulator all weigh ranks
by it) and the schedules already computed ahead are recomputed, so the very next step runs on it,
with no restart. Events are attached to the metrics row of the step they were decided after.

Limits. A straggler inside a context-parallel group makes its group-mates wait inside attention's
collectives, so the whole group measures slow; the scheduler runs a group at its slowest member's
speed anyway. Under ZeRO-3 (and every lockstep layout) each forward gathers weights from all data
ranks, so every rank waits for the slowest inside its timed compute and all measure alike; ranks
are told apart on pp 1 without ZeRO-3, where each runs its own micro-batches and then one
reduction. A data rank's speed is its slowest tensor-parallel rank's. The work is the cost
model's group time times the group's speed, exact where no communication is exposed inside the
micro-batches (groups of one rank without tensor parallelism).

Emulation (``flexmesh train --emulate-speed RANK=FACTOR``): for testing on one machine, the named
rank stretches each of its forward and backward computations to 1/FACTOR of their measured time
(:func:`stretch`). Not a measurement of a slow device: metrics.jsonl records the factors as
``emulated_speed``.

>>> d = SpeedDetector(num_ranks=2, config=StragglerConfig(steps=2, warmup=0))
>>> d.update([1.0, 0.5], [1.0, 1.0]), d.update([1.0, 0.51], [1.0, 1.0])  # the noise not yet measured
(([], None), ([], None))
>>> events, proposal = d.update([1.0, 0.52], [1.0, 1.0])
>>> [e["event"] for e in events], proposal
(['straggler_detected'], (1.0, 0.515))
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from flexmesh.errors import PlanError
from flexmesh.layout.step import StepSchedule
from flexmesh.spec.speeds import slow_devices


def stretch(seconds: float, factor: float) -> float:
    """Emulate a device at ``factor`` of its speed after a computation that took ``seconds``: wait
    ``(1 / factor - 1) * seconds`` more; returns the wait.

    A busy wait, not a sleep: a slower processor stays occupied for the longer time, so the wait must
    keep the core (on a shared machine a sleeping rank hands its core to other processes, which makes
    the emulated slowdown cheaper for the machine than a real one, and the wake-up comes late by the
    scheduler's latency, adding noise to short waits). The loop is pure Python, so it still yields
    the interpreter lock every switch interval: the rank's background scheduler thread progresses as
    it would beside real compute.
    """
    if factor >= 1.0 or seconds <= 0.0:
        return 0.0
    wait = (1.0 / factor - 1.0) * seconds
    end = time.perf_counter() + wait
    while time.perf_counter() < end:
        pass
    return wait


class ComputeClock:
    """This rank's busy compute seconds in a step, and the emulated slowdown (``factor`` < 1).

    ``with clock.piece(): ...`` around each forward and each backward. On CUDA the pieces are timed
    by events read after the step's final synchronisation (no stall per piece) unless emulating,
    which needs each piece's time at once.
    """

    def __init__(self, device_type: str = "cpu", factor: float = 1.0) -> None:
        self.cuda, self.factor = device_type == "cuda", factor
        self.reset()

    def reset(self) -> None:
        self._seconds = 0.0
        self._events: list[tuple[Any, Any]] = []  # (start, end) CUDA events of the pieces timed on the device

    @contextmanager
    def piece(self) -> Iterator[None]:
        import torch

        if self.cuda and self.factor >= 1.0:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
            return
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        took = time.perf_counter() - t0
        self._seconds += took + stretch(took, self.factor)

    def total(self) -> float:
        """Seconds of the pieces since :meth:`reset` (on CUDA after the device has synchronised)."""
        return self._seconds + sum(s.elapsed_time(e) for s, e in self._events) / 1e3


def parse_emulation(pairs: Sequence[tuple[int, float]], world: int) -> dict[int, float]:
    """``--slow`` pairs as {rank: factor}, checked as ``plan`` and ``simulate`` check them
    (flexmesh.spec.speeds.slow_devices: a rank outside the run or named twice is a SpecError)."""
    return slow_devices(pairs, world)


@dataclass(frozen=True)
class StragglerConfig:
    """When a speed change counts, and when re-planning pays (see the module doc).

    ``threshold`` 0.25: on this machine the cost model's step-time error is about 12% (median, bench
    calibrate in bench/RESULTS.md) and a relative speed compares two ranks' errors, so deviations up
    to about twice that are the model's noise, not a slow device. ``steps`` 2: one step can be slowed
    by a one-off (garbage collection, another process on a shared core); two in a row in the same
    direction is a trend, and each further step waited is a step run on the wrong schedule (re-planning
    costs one scheduler call, no restart). ``warmup`` 1: the first step pays one-off costs.
    ``min_gain`` 0.02: the simulator's predicted gain must beat its own scatter between two schedules
    of one batch (a few percent), so measurement noise never flips schedules back and forth.
    ``replan`` off: measure and detect only (the static baseline). ``judge`` off: measure only, no
    events (more processes than cores: a rank's speed is then the OS scheduler's choice, not its device's).
    """

    threshold: float = 0.25
    steps: int = 2
    warmup: int = 1
    min_gain: float = 0.02
    replan: bool = True
    judge: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise PlanError(f"the straggler threshold must be in (0, 1), got {self.threshold}")
        if self.steps < 1 or self.warmup < 0 or self.min_gain < 0:
            raise PlanError("straggler steps must be >= 1, warmup and min_gain >= 0")


# The machine's noise: the mean |change| of a rank's speed from one step to the next over every rank's
# latest NOISE_STEPS steps (a mean, not a median: relative speeds hold the fastest rank at exactly 1, so
# on two ranks half the changes are zero however noisy the machine; long enough that one real change of
# speed weighs 1 / (2 NOISE_STEPS) of it, short enough to follow the machine's load). NOISE_BAND times it
# is the noise band: for speeds scattered normally with deviation sd, the mean |change| is 1.13 sd, so the
# band is about 3.4 sd, what one step of noise rarely crosses. A band within the threshold is a quiet
# machine.
NOISE_STEPS = 8
NOISE_BAND = 3.0
# On a noisy machine a rank's mean speed must be off by the threshold and by SURE standard errors of that
# mean (one-sided, about 2.5% of means of pure noise cross it).
SURE = 2.0
# The fewest steps a mean is judged over there (a standard error of 3 steps' speeds is itself noise).
MEAN_STEPS = 4


def contended(load: float | None, cores: int | None = None) -> bool:
    """Whether a node whose 1-minute load average is ``load`` runs more processes than it has cores
    (``os.cpu_count()``) by one at least: other work then takes the ranks' cores by turns. The ranks
    count in the load, one per core at most when the run is not oversubscribed, so a quiet node reads
    about its ranks' number and stays below cores + 1.

    >>> contended(2.3, 2), contended(3.4, 2), contended(None, 2)
    (False, True, False)
    """
    return load is not None and load >= (cores or os.cpu_count() or 1) + 1


class SpeedDetector:
    """Sustained speed changes of data ranks against the speeds their schedules assumed.

    Each change is reported once: after a proposal the speeds it names become the baseline that
    later steps are judged against, whether or not the run re-planned to them (with ``--no-replan``,
    or a declined re-plan, the schedules keep assuming the old speeds; a straggler that stays as
    slow is then not reported again). When the schedules' speeds change (a re-plan, a resume), they
    become the baseline.
    """

    def __init__(self, num_ranks: int, config: StragglerConfig) -> None:
        self.config, self.num_ranks = config, num_ranks
        self.seen = 0
        self.history: list[deque] = [deque(maxlen=config.steps) for _ in range(num_ranks)]
        self.streak = [0] * num_ranks  # > 0: consecutive slower steps, < 0: consecutive faster steps
        self.flagged: set[int] = set()  # ranks reported slow and not yet reported recovered
        self.baseline: list[float] | None = None  # speeds judged against
        self._assumed: list[float] | None = None  # the schedules' speeds at the last step
        self.recent: list[deque] = [deque(maxlen=NOISE_STEPS) for _ in range(num_ranks)]  # since last judged
        self.changes: deque[float] = deque(maxlen=NOISE_STEPS * num_ranks)  # |speed change| step to step
        self._last: list[float | None] = [None] * num_ranks
        self.noise_said = False

    @property
    def mean_steps(self) -> int:
        """The fewest steps whose mean speed a noisy machine judges: :data:`MEAN_STEPS`, and one more than
        a streak's ``steps``."""
        return max(MEAN_STEPS, self.config.steps + 1)

    def noise(self) -> float | None:
        """The machine's step-to-step noise of a rank's relative speed; None until every rank (on
        average) has changed speed twice."""
        return statistics.fmean(self.changes) if len(self.changes) >= 2 * self.num_ranks else None

    def _on_average(self, r: int) -> int:
        """1 (slower) or -1 (faster) where the mean of rank ``r``'s speeds since it was last judged is off
        its baseline by more than the threshold and :data:`SURE` standard errors, over at least
        :attr:`mean_steps` steps; else 0."""
        assert self.baseline is not None
        seen = [m / self.baseline[r] for m in self.recent[r]]
        if len(seen) < self.mean_steps:
            return 0
        q, tol = statistics.fmean(seen), self.config.threshold
        margin = SURE * statistics.stdev(seen) / math.sqrt(len(seen))  # the mean's own scatter, SURE times
        return 1 if q + margin < 1.0 - tol else (-1 if q - margin > 1.0 + tol else 0)

    def update(self, measured: Sequence[float | None], assumed: Sequence[float],
               load: float | None = None) -> tuple[list[dict], tuple | None]:
        """One step's measured and assumed speeds per data rank -> (events, proposed speeds or None);
        ``load``: the node's 1-minute load average, when read (:func:`contended` judges it)."""
        self.seen += 1
        if self.seen <= self.config.warmup:
            return [], None
        tol, k = self.config.threshold, self.config.steps
        if self.baseline is None or list(assumed) != self._assumed:
            self.baseline = [float(a) for a in assumed]
            for window in self.recent:
                window.clear()
        self._assumed = list(assumed)
        for r, (m, a) in enumerate(zip(measured, self.baseline, strict=True)):
            if m is None or not math.isfinite(m):
                continue  # no work this step: no evidence either way
            self.history[r].append(m)
            self.recent[r].append(m)
            last, self._last[r] = self._last[r], m
            if last is not None:
                self.changes.append(abs(m - last))
            q = m / a
            direction = 1 if q < 1.0 - tol else (-1 if q > 1.0 + tol else 0)
            same = direction != 0 and (self.streak[r] > 0) == (direction > 0)
            self.streak[r] = self.streak[r] + direction if same else direction
        noise = self.noise()
        if noise is None:
            return [], None  # the machine's noise not yet measured: nothing judged
        streaks = {r: 1 if self.streak[r] > 0 else -1 for r in range(self.num_ranks) if abs(self.streak[r]) >= k}
        if NOISE_BAND * noise <= tol and not contended(load):  # quiet: steps in a row at one speed (within tol / 2)
            way = {r: d for r, d in streaks.items()
                   if max(self.history[r]) - min(self.history[r]) <= tol / 2 * self.baseline[r]}
        else:  # a noisy one: the mean since last judged decides, or a streak far past any noise (twice the
            # threshold, at one speed: a device at a quarter of its speed is not kept waiting for the mean)
            way = {r: d for r in range(self.num_ranks) if (d := self._on_average(r))}
            way.update({r: d for r, d in streaks.items() if r not in way and all(
                abs(m / self.baseline[r] - 1.0) > 2 * tol for m in self.history[r])
                and max(self.history[r]) - min(self.history[r]) <= tol / 2 * self.baseline[r]})
        # noise only where the mean had its steps to judge and did not find the rank off
        judged = [r for r in streaks if r not in way and len(self.recent[r]) >= self.mean_steps]
        noise_events = self._noise_said(judged, measured, NOISE_BAND * noise, load)
        sustained = sorted(way)
        if not sustained:
            return noise_events, None
        slow = [r for r in sustained if way[r] > 0]
        fast = [r for r in sustained if way[r] < 0]
        proposal = list(self.baseline)
        for r in sustained:
            proposal[r] = statistics.median(self.history[r])
        top = max(proposal)
        proposal_t = tuple(round(min(1.0, p / top), 3) for p in proposal)
        shown = [None if m is None or not math.isfinite(m) else round(m, 3) for m in measured]
        # A rank back within the threshold of the fastest has recovered; any other sustained change
        # (slower still, or faster but still slow) only corrects its speed.
        recovered = [r for r in fast if proposal_t[r] >= 1.0 - tol]
        kinds = {"straggler_detected": [r for r in slow if r not in self.flagged], "straggler_recovered": recovered,
                 "speed_changed": [r for r in sustained if (r in slow and r in self.flagged)
                                   or (r in fast and r not in recovered)]}
        events = [{"event": kind, "ranks": ranks, "speeds": shown} for kind, ranks in kinds.items() if ranks]
        self.flagged = (self.flagged | set(slow)) - set(recovered)
        self.baseline, self.streak = list(proposal_t), [0] * self.num_ranks
        for window in self.recent:
            window.clear()
        return noise_events + events, proposal_t

    def _noise_said(self, ranks: list[int], measured: Sequence[float | None], band: float,
                    load: float | None) -> list[dict]:
        """``speed_noise``, once per run: ``ranks`` were off by more than the threshold for ``steps`` steps
        in a row on a noisy machine, their means not."""
        if not ranks or self.noise_said:
            return []
        self.noise_said = True
        shown = [None if m is None or not math.isfinite(m) else round(m, 3) for m in measured]
        return [{"event": "speed_noise", "ranks": ranks, "speeds": shown, "band": round(band, 3),
                 "load": None if load is None else round(load, 2), "cores": os.cpu_count()}]


def measured_speeds(schedule: StepSchedule, compute_s: Sequence[float], data_of: Sequence[int | None]
                    ) -> tuple[list[float | None], list[float], list[float | None], float | None]:
    """(measured speed per global rank, assumed speed per data rank, measured speed per data rank, pace).

    ``data_of``: every global rank's data rank (None: a device the plan leaves unused;
    flexmesh.layout.mesh.data_rank_of_ranks). Speeds are relative to the fastest rank; None where a
    rank had no work. The pace is that fastest rank's own speed against the cost model (its work at
    nominal speed over its compute time; 1.0: as profiled), None when no rank had work.
    """
    n = 1 + max((d for d in data_of if d is not None), default=-1)
    assumed = [float(x) for x in schedule.extra.get("speed") or [1.0] * n]
    nominal = [0.0] * n
    for g in schedule.groups:
        for r in g.ranks:
            nominal[r] = g.predicted_time * min(assumed[x] for x in g.ranks)
    raw: list[float | None] = []
    for d, t in zip(data_of, compute_s):
        raw.append(nominal[d] / t if d is not None and nominal[d] > 0 and t > 0 else None)
    known = [x for x in raw if x is not None]
    pace = max(known) if known else None
    per_rank = [None if x is None else x / (pace or 1.0) for x in raw]
    per_data: list[float | None] = [None] * n
    for d, x in zip(data_of, per_rank):
        if d is not None and x is not None:
            held = per_data[d]
            per_data[d] = x if held is None else min(held, x)
    return per_rank, assumed, per_data, pace


# Steps whose measured speeds the paced prediction takes the median of: the latest few, so a
# machine whose speed drifts over a long run is followed, and one slow step (garbage collection,
# another process on a shared core) moves the median little.
PACE_STEPS = 5

Price = Callable[[StepSchedule, Sequence[float]], float]  # schedule, speeds -> predicted step time (s)

# Steps on whose documents a declined proposal is priced again: a re-plan's gain depends on the batch
# (which documents the old schedule happened to place well), so one batch's verdict is not the speeds'.
# As many as the noise window's steps; two scheduler calls per step on rank 0 while it lasts.
RETRY_STEPS = NOISE_STEPS


class StragglerMonitor:
    """The training loop's per-step hook (``fit(..., monitor=...)``): speeds into the metrics, events,
    re-plans (see the module doc).

    On rank 0 ``scheduler`` (a flexmesh.schedule.scheduler.Scheduler, for its ``with_speed``) and
    ``price`` (the simulator's step time at given speeds) evaluate a proposal and ``apply(speeds)``
    switches the run's schedules to it (flexmesh.runtime.train.adaptive.AdaptiveSource.set_speed); other
    ranks pass None and only measure (their metrics are not written).
    """

    def __init__(self, data_of: Sequence[int | None], config: StragglerConfig, *, scheduler=None,
                 price: Price | None = None, apply: Callable[[Sequence[float]], None] | None = None,
                 load: Callable[[], float | None] = lambda: os.getloadavg()[0]) -> None:
        self.data_of, self.config, self.load = tuple(data_of), config, load
        self.scheduler, self.price, self.apply = scheduler, price, apply
        self.detector = SpeedDetector(1 + max((d for d in self.data_of if d is not None), default=-1), config)
        # Per judged step: each data rank's speed against the cost model (None: no work that step).
        self.absolute: deque[list[float | None]] = deque(maxlen=PACE_STEPS)
        # A declined proposal, the schedules' speeds it was declined against, and the retries left.
        self.pending: tuple[tuple, list[float], int] | None = None

    def observe(self, m, docs: Sequence, schedule: StepSchedule):
        """Step metrics ``m`` with speeds, pace, the paced prediction and the events decided after this step."""
        if not m.compute_s:
            return m
        per_rank, assumed, per_data, pace = measured_speeds(schedule, m.compute_s, self.data_of)
        # The simulator's step time for this schedule at the speeds measured on the steps before this
        # one (never this step's own): a prediction made before the step.
        paced = self.price(schedule, self._believed(assumed)) if self.absolute and self.price is not None else None
        events, proposal = self.detector.update(per_data, assumed, self.load())
        if not self.config.judge:
            events, proposal = [], None
        if pace is not None and self.detector.seen > self.config.warmup:
            self.absolute.append([None if x is None else x * pace for x in per_data])
        if self.config.replan and self.scheduler is not None and self.price is not None:
            lengths = [len(d) for d in docs]
            if proposal is not None:
                decided = self._decide(assumed, proposal, lengths)
                events.append(decided)
                self.pending = (proposal, assumed, RETRY_STEPS) if decided["event"] == "replan_declined" else None
            elif self.pending is not None:
                events.extend(self._retry(assumed, lengths))
        return replace(m, speed=tuple(None if x is None else round(x, 4) for x in per_rank),
                       assumed_speed=tuple(1.0 if d is None else assumed[d] for d in self.data_of),
                       pace=None if pace is None else round(pace, 4),
                       paced_step_time_s=None if paced is None else round(paced, 6), events=tuple(events))

    def _believed(self, assumed: Sequence[float]) -> list[float]:
        """Each data rank's speed against the cost model: the median of its latest measured ones, or,
        where it had no work on those steps, its assumed speed at the median pace."""
        pace = statistics.median(max(x for x in step if x is not None) for step in self.absolute)
        out = []
        for r, a in enumerate(assumed):
            seen = [x for x in (step[r] for step in self.absolute) if x is not None]
            out.append(statistics.median(seen) if seen else a * pace)
        return out

    def _retry(self, assumed: list[float], lengths: list[int]) -> list[dict]:
        """The pending declined proposal priced on this step's documents: ``[replanned]`` where it pays now,
        else nothing (dropped once its retries are spent, or when the schedules' speeds changed)."""
        assert self.pending is not None
        proposal, declined_at, left = self.pending
        if assumed != declined_at or left <= 0:
            self.pending = None
            return []
        decided = self._decide(assumed, proposal, lengths)
        if decided["event"] == "replanned":
            self.pending = None
            return [decided]
        self.pending = (proposal, declined_at, left - 1)
        return []

    def _decide(self, assumed: list[float], proposal: tuple, lengths: list[int]) -> dict:
        """Price the step just trained at the proposed speeds, scheduled both ways; switch when it pays."""
        assert self.scheduler is not None and self.price is not None  # observe decides only with both
        now = self.price(self.scheduler.with_speed(assumed)(lengths), proposal)
        new = self.price(self.scheduler.with_speed(proposal)(lengths), proposal)
        gain = now / new if new > 0 else 1.0
        changed = [r for r, (a, p) in enumerate(zip(assumed, proposal, strict=True)) if abs(a - p) > 1e-9]
        event = {"ranks": changed, "speeds": list(proposal), "previous": [round(a, 3) for a in assumed],
                 "predicted_step_s": [round(now, 6), round(new, 6)], "predicted_gain": round(gain, 4)}
        if gain >= 1.0 + self.config.min_gain and changed:
            if self.apply is not None:
                self.apply(proposal)
            return {"event": "replanned", **event}
        return {"event": "replan_declined", **event}
