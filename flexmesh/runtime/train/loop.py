"""The training loop: feed a Trainer steps from a source until ``max_steps``, resuming, logging and
checkpointing on the way (see :func:`fit`).
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from flexmesh.errors import FlexmeshError
from flexmesh.files import append_file, write_atomic
from flexmesh.layout.step import StepSchedule
from flexmesh.runtime.observe.walltime import WallTime
from flexmesh.runtime.observe.watchdog import Heartbeat, rank_error
from flexmesh.runtime.parallel.distributed import cpu_group
from flexmesh.runtime.state.checkpoint import (
    PendingCheckpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    start_checkpoint,
)
from flexmesh.runtime.state.rundir import (
    ATTEMPT_RECORDS,
    CHECKPOINTS,
    METRICS,
    ROUTING,
    check_run_entries,
    hold_run_folder,
    launcher_holds,
    read_metrics,
    release_run_folder,
    start_over,
)
from flexmesh.runtime.train.config import StepMetrics, TrainConfig
from flexmesh.runtime.train.evaluate import DomainEvals, HeldOutEval
from flexmesh.runtime.train.trainer import Trainer


class StepSource(Protocol):
    """Where global batches come from: documents of the step and their StepSchedule.

    ``state_dict``/``load_state_dict`` make resume exact (the loader position is checkpointed).
    """

    def __next__(self) -> tuple[Sequence[np.ndarray], StepSchedule]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class ListSource:
    """A fixed list of steps as a resumable source: (docs, schedule) pairs for the trainer, or global
    batches for an AdaptiveSource to schedule; used by tests and the benchmark."""

    steps: list
    position: int = 0

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> object:
        if self.position >= len(self.steps):
            raise StopIteration
        self.position += 1
        return self.steps[self.position - 1]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def fit(trainer: Trainer, source: StepSource, config: TrainConfig, monitor: Any = None,
        migration: Any = None, records: Sequence[Callable[[], None]] = (), wall: WallTime | None = None,
        evaluation: HeldOutEval | DomainEvals | None = None) -> list[StepMetrics]:
    """Run steps until ``config.max_steps``: resume, log metrics.jsonl, show progress, checkpoint.

    Rank 0 appends one JSON object per step to ``<out_dir>/metrics.jsonl`` (fields in
    docs/metrics.md), and for a model with experts one per MoE layer and step to ``routing.jsonl``;
    on resume, lines of steps after the checkpoint are dropped first so neither file ever holds a
    step twice. Checkpoints go to ``<out_dir>/checkpoints`` every
    ``checkpoint_every`` steps and at the end. With ``async_checkpoint`` the every-N ones are written by a thread
    (:func:`~flexmesh.runtime.state.checkpoint.start_checkpoint`) and published at the first step boundary where
    every rank's shards are written; one is in flight at a time, and any other checkpoint, a signal, a diverged
    loss or the run's end waits for it first.

    Rank 0 holds the folder's lock for the run (flexmesh.runtime.state.rundir); with ``resume`` off, a
    folder holding an earlier run is refused (RunFolderError on every rank). SIGTERM (preemption)
    ends the run after the current step, with a checkpoint when ``out_dir`` is set, and raises
    :class:`Preempted`; SIGINT (Ctrl-C) ends it there without starting a checkpoint and raises
    :class:`Interrupted`. All ranks agree on a signal through one small all-reduce per step.

    ``monitor`` (flexmesh.runtime.train.stragglers.StragglerMonitor) sees every step before it is logged:
    it adds measured speeds and straggler events to the metrics and may re-plan the schedules.

    ``migration`` (flexmesh.commands.migrate.MigrationCheck; needs ``out_dir``): after a step whose
    events it names as due (``due(m)``, the same answer on every rank), a checkpoint is written and
    timed, rank 0 decides (``decide(m, save_s)`` -> an event dict with ``"event": "migrated"`` or
    ``"migration_declined"``), every rank gets the decision, the event joins the step's metrics row,
    and a migration raises :class:`Migrating` (the launcher relaunches on the new plan).

    ``records`` (rank 0's; e.g. the run's tokenizer and corpus, flexmesh.commands.train) write what the
    run folder records of this attempt: they run once every check of a resume has passed (the
    checkpoint's plan, tasks, ranks and checksums, and its load), before any other file of the
    folder changes, so a refused resume leaves the folder as it was.

    ``wall`` (flexmesh.runtime.observe.walltime.WallTime) gets the first step (where compilation happens),
    the later steps (their data included), the evaluations and the checkpoints' times.

    ``evaluation`` (flexmesh.runtime.train.evaluate.HeldOutEval): on the steps it names, every rank runs
    the held-out documents' forwards after the step; the row gets ``eval_loss`` and ``eval_ppl`` and
    rank 0 says them in one line. With ``config.tensorboard_dir`` rank 0 also writes each row's
    scalars there (flexmesh.runtime.train.scalars).
    """
    wall = wall if wall is not None else WallTime()
    out = Path(config.out_dir) if config.out_dir else None
    ckpt_root = out / CHECKPOINTS if out else None
    rank0 = dist.get_rank() == 0
    launched = _any_rank(launcher_holds(out)) if out else False  # several nodes: node 0's ranks can tell
    held, old_rows = _on_rank0(lambda: _open_run_folder(out, config.resume, launched), (False, [])) if out else (
        False, [])
    preemption = _Preemption()
    heartbeat = Heartbeat()  # names a rank that stops answering (flexmesh.runtime.observe.watchdog)
    progress = None
    scalars = None
    try:
        if ckpt_root is not None and config.resume:
            found = latest_checkpoint(ckpt_root)
            if found is not None:
                reshard = config.reshard_from is not None and found.name == config.reshard_from
                source.load_state_dict(load_checkpoint(found, trainer, reshard=reshard))
                if rank0:
                    _say(None, f"resuming from {found} (step {trainer.step_index} of {config.max_steps})"
                               f"{', resharded to the new plan' if reshard else ''}")
        # On every rank (only rank 0 has records): a FlexmeshError of rank 0's reaches them all.
        _on_rank0(lambda: [write() for write in records], None)
        metrics_file = out / METRICS if out else None
        routing_file = out / ROUTING if out else None
        if rank0 and metrics_file is not None and routing_file is not None:
            kept = [ln for step, ln in old_rows if step <= trainer.step_index]
            write_atomic(metrics_file, "".join(ln + "\n" for ln in kept))
            _note_dtype_change(kept, config.dtype)
            if routing_file.exists():
                rows = [ln for step, ln in read_metrics(routing_file) if step <= trainer.step_index]
                write_atomic(routing_file, "".join(ln + "\n" for ln in rows))
        if rank0 and config.tensorboard_dir:
            from flexmesh.runtime.train.scalars import Scalars

            scalars = Scalars(config.tensorboard_dir, resumed_at=trainer.step_index)
        history: list[StepMetrics] = []
        progress = _Progress(config.max_steps, trainer.step_index) if rank0 and config.progress else None
        late = 0  # consecutive steps that ran the fallback schedule
        background = dist.new_group(backend="gloo") if config.async_checkpoint and ckpt_root is not None else None
        pending: PendingCheckpoint | None = None  # an asynchronous checkpoint being written
        while trainer.step_index < config.max_steps:
            t_step = time.perf_counter()
            try:
                docs, schedule = next(source)
            except StopIteration:
                break
            m = trainer.step(docs, schedule)
            wall.add("steps" if history else "first step", time.perf_counter() - t_step)
            if monitor is not None:
                m = monitor.observe(m, docs, schedule)
            if evaluation is not None and evaluation.due(m.step, config.max_steps):
                with wall.phase("evaluation"):
                    m = evaluation.run(trainer, m)
                if rank0:
                    per = "".join(f", {name} {x:.4f}" for name, x in zip(m.domains, m.eval_domain_loss, strict=False))
                    _say(progress, f"step {m.step}: held-out loss {m.eval_loss:.4f}{per}, perplexity {m.eval_ppl:,.2f}")
            migrated = saved = None
            if pending is not None and pending.done():
                with wall.phase("checkpoints"):
                    pending = _published(pending)
            if migration is not None and ckpt_root is not None and migration.due(m):
                pending = _published(pending)
                m, saved, migrated = _migration_point(migration, m, ckpt_root, trainer, source)
            history.append(m)
            if rank0 and metrics_file is not None:
                with append_file(metrics_file) as f:
                    f.write(json.dumps(m.to_dict()) + "\n")
            if rank0 and routing_file is not None and m.routing:
                with append_file(routing_file) as f:
                    f.write("".join(json.dumps({"step": m.step, **row}) + "\n" for row in m.routing))
            if scalars is not None:
                scalars.add(m)
            if progress is not None:
                progress.update(m)
            if not math.isfinite(m.loss):  # the same on every rank (the loss is reduced): stop before saving it
                pending = _published(pending)
                raise Diverged(m.step, m.loss, latest_checkpoint(ckpt_root) if ckpt_root is not None else None)
            if rank0:
                for line in event_lines(m, late):
                    _say(progress, line)
                late = late + 1 if m.fallback else 0
            stop = preemption.agreed()
            if stop == signal.SIGINT:  # no checkpoint is started after Ctrl-C (one in flight is finished)
                pending = _published(pending)
                raise Interrupted(m.step, latest_checkpoint(ckpt_root) if ckpt_root is not None else None)
            every = config.checkpoint_every
            due = (every and m.step % every == 0) or m.step == config.max_steps or stop
            if migrated is not None:
                assert saved is not None  # the migration point saved the checkpoint it names
                raise Migrating(m.step, saved, migrated)
            if ckpt_root is not None and due and saved is None:
                with wall.phase("checkpoints"):
                    pending = _published(pending)
                    if background is not None and not stop and m.step < config.max_steps:
                        pending = start_checkpoint(ckpt_root, m.step, trainer, source.state_dict(), background)
                    else:
                        saved = save_checkpoint(ckpt_root, m.step, trainer, source.state_dict())
            if stop and trainer.step_index < config.max_steps:  # at the last step the run is done anyway
                raise Preempted(m.step, saved)
        with wall.phase("checkpoints"):
            pending = _published(pending)  # the source ran out after a step that began one
    except RuntimeError as e:  # torch's DistBackendError included
        named = rank_error(e, heartbeat)
        if named is not None:
            raise named from e
        raise
    finally:
        heartbeat.close()
        preemption.restore()
        if scalars is not None:
            scalars.close()
        if progress is not None:
            progress.close()
        if hasattr(source, "close"):  # e.g. AdaptiveSource's background scheduler
            source.close()
        if held and out is not None:
            release_run_folder(out)
    return history


def _published(pending: PendingCheckpoint | None) -> PendingCheckpoint | None:
    """Wait for ``pending`` (on every rank) and publish it; what is in flight then: nothing."""
    if pending is not None:
        pending.finish()
    return None


def _migration_point(migration: Any, m: StepMetrics, ckpt_root: Path, trainer: Trainer, source: StepSource
                     ) -> tuple[StepMetrics, Path, dict | None]:
    """Checkpoint (timed), rank 0's decision for every rank; (metrics with its event, checkpoint, the
    event when migrating else None)."""
    import dataclasses
    import time

    t0 = time.perf_counter()
    saved = save_checkpoint(ckpt_root, m.step, trainer, source.state_dict())
    save_s = time.perf_counter() - t0
    event = _on_rank0(lambda: migration.decide(m, save_s), None)
    if dist.get_world_size() > 1:
        box: list = [event]
        dist.broadcast_object_list(box, src=0, group=cpu_group())
        event = box[0]
    m = dataclasses.replace(m, events=tuple(m.events) + (event,))
    return m, saved, event if event["event"] == "migrated" else None


class Migrating(Exception):
    """The run stopped after step ``step`` to continue on a new plan (``event``: the ``migrated`` metrics
    event); ``checkpoint`` is the one to resume from."""

    def __init__(self, step: int, checkpoint: Path, event: dict) -> None:
        super().__init__(f"migrating after step {step}")
        self.step, self.checkpoint, self.event = step, checkpoint, event


class Interrupted(Exception):
    """The run stopped on SIGINT (Ctrl-C) after step ``step``, starting no checkpoint; ``checkpoint`` is
    the newest one on disk (None: none yet), the one a resume starts from."""

    def __init__(self, step: int, checkpoint: Path | None) -> None:
        super().__init__(f"interrupted after step {step}")
        self.step, self.checkpoint = step, checkpoint

    def notice(self, resume: str) -> str:
        """The one line a launcher prints: where the run stopped and the command that resumes it."""
        if self.checkpoint is None:
            return f"interrupted after step {self.step}; no checkpoint yet, so a resume starts over: {resume}"
        return f"interrupted after step {self.step}; resume from {self.checkpoint}: {resume}"


class Diverged(Exception):
    """Step ``step``'s loss was not finite; the run stopped before writing any checkpoint of it
    (``checkpoint``: the newest on disk, None when there is none)."""

    def __init__(self, step: int, loss: float, checkpoint: Path | None) -> None:
        super().__init__(f"loss {loss} at step {step}")
        self.step, self.loss, self.checkpoint = step, loss, checkpoint

    def notice(self, resume: str) -> str:
        kept = f"{self.checkpoint} is intact" if self.checkpoint else "no checkpoint was written"
        return (f"step {self.step}: the loss is {self.loss}, so the run stopped before saving it; {kept}; lower --lr "
                f"or raise --warmup, then: {resume}")


class Preempted(Exception):
    """The run stopped early on SIGTERM, after step ``step``; ``checkpoint`` is the one written then."""

    def __init__(self, step: int, checkpoint: Path | None) -> None:
        super().__init__(f"stopped by SIGTERM after step {step}")
        self.step, self.checkpoint = step, checkpoint

    def notice(self) -> str:
        """The line a launcher prints: where the run stopped and how to go on."""
        where = f"checkpoint {self.checkpoint} written" if self.checkpoint else "no checkpoint (no --out)"
        return f"stopped by SIGTERM after step {self.step}; {where}; run the same command again to resume"


def _open_run_folder(out: Path, resume: bool, launched: bool) -> tuple[bool, list[tuple[int, str]]]:
    """Rank 0: lock ``out`` unless the run's launcher holds it (``launched``), refuse to start over a
    previous run, read the metrics to keep; (whether this process holds the lock, those metrics)."""
    held = not launched and bool(hold_run_folder(out))
    try:
        check_run_entries(out)  # hold_run_folder checks too, but the launcher's hold was taken a while ago
        if not resume:  # what the command recorded for this attempt (its tokenizer, its plan) is no earlier run
            start_over(out, overwrite=False, ours=ATTEMPT_RECORDS)
        return held, read_metrics(out / METRICS) if resume else []
    except BaseException:
        if held and out is not None:
            release_run_folder(out)
        raise


def _note_dtype_change(kept: list[str], dtype: str) -> None:
    """Say so when a run resumes in another compute dtype than its last kept step ran in.

    Allowed on purpose: checkpoints hold fp32 weights and optimizer states whatever the dtype
    (docs/precision.md), so the switch loses nothing; each metrics line records its step's dtype
    (lines written before that field existed ran in fp32).
    """
    if not kept:
        return
    last = json.loads(kept[-1])
    before = last.get("dtype", "fp32")
    if before != dtype:
        from flexmesh.console import plain_console

        plain_console(stderr=True).print(f"resuming after step {last['step']} in {dtype}; the steps so far ran in "
                                   f"{before} (metrics.jsonl records each step's dtype)", highlight=False)


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank (every rank calls it at the same point)."""
    box = torch.tensor([int(flag)], dtype=torch.int32)
    if dist.get_world_size() > 1:
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=cpu_group())
    return bool(box.item())


def _on_rank0(fn: Callable[[], Any], elsewhere: Any) -> Any:
    """``fn()`` on rank 0, ``elsewhere`` on the others; rank 0's FlexmeshError is raised on every rank
    (the others would otherwise wait for rank 0 at the next collective)."""
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except FlexmeshError as e:
            error = e
    if dist.get_world_size() > 1:
        box: list = [error]
        dist.broadcast_object_list(box, src=0, group=cpu_group())
        error = box[0]
    if error is not None:
        raise error
    return result if dist.get_rank() == 0 else elsewhere


class _Preemption:
    """Notes SIGTERM and SIGINT instead of dying at once, so the step in flight finishes.

    SIGTERM (preemption) ends the run with a checkpoint of that step; SIGINT (Ctrl-C) ends it
    without starting one (a checkpoint already being written completes: the handler only takes
    note). Only the main thread may install handlers; elsewhere both signals keep their defaults.
    """

    CODES = {signal.SIGTERM: 1, signal.SIGINT: 2}  # the larger wins when ranks got different ones

    def __init__(self) -> None:
        self.requested = 0
        self._installed = threading.current_thread() is threading.main_thread()
        self._previous = {s: signal.signal(s, self._note) for s in self.CODES} if self._installed else {}

    def _note(self, signum: int, frame: object) -> None:
        self.requested = max(self.requested, self.CODES[signal.Signals(signum)])

    def agreed(self) -> signal.Signals | None:
        """The signal any rank got (SIGINT over SIGTERM), else None; every rank calls it at the same
        point of each step."""
        flag = torch.tensor([self.requested], dtype=torch.int32)
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=cpu_group())
        code = int(flag.item())
        return next((s for s, c in self.CODES.items() if c == code), None)

    def restore(self) -> None:
        for s, previous in self._previous.items():
            # None: the previous handler was not set from Python; the default is the closest
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}


def event_lines(m: StepMetrics, late_before: int) -> list[str]:
    """What the console says after step ``m`` (one line each; metrics.jsonl has the details): its
    straggler, re-plan and migration events, and a fallback schedule when the primary one starts
    being late (``late_before``: fallback steps just before this one) or is on time again."""
    lines = []
    for e in m.events:
        kind, ranks = e.get("event", "?"), ", ".join(str(r) for r in e.get("ranks", []))
        gain = f"predicted {e['predicted_gain']:.2f}x" if "predicted_gain" in e else ""
        lines.append(f"step {m.step}: " + {
            "straggler_detected": f"rank(s) {ranks} slower than scheduled (measured speeds {e.get('speeds')})",
            "straggler_recovered": f"rank(s) {ranks} back to speed",
            "speed_changed": f"rank(s) {ranks} changed speed (measured {e.get('speeds')})",
            "speed_noise": f"rank(s) {ranks} off their scheduled speed (measured {e.get('speeds')}) by no more "
                           f"than this machine's noise (step to step +-{100 * e.get('band', 0):.0f}%, load "
                           f"{e.get('load')} on {e.get('cores')} cores): not judged slow",
            "replanned": f"schedules re-planned for speeds {e.get('speeds')}, {gain}",
            "replan_declined": f"schedules kept ({gain}, below the threshold)",
            "migrated": f"migrating to {e.get('plan')} ({gain})",
            "migration_declined": f"layout kept: {e.get('reason')}",
        }.get(kind, kind))
    if m.fallback and not late_before:
        lines.append(f"step {m.step}: the {m.requested_policy} schedule was late; ran the {m.policy} fallback "
                     "(--adaptive; it says so again when schedules are on time)")
    elif late_before and not m.fallback:
        lines.append(f"step {m.step}: {m.policy} schedules on time again after {late_before} fallback step(s)")
    return lines


def _say(progress: _Progress | None, line: str) -> None:
    """One line on stderr, above the progress bar when there is one."""
    if progress is not None:
        progress.say(line)
        return
    from flexmesh.console import plain_console

    plain_console(stderr=True, soft_wrap=True).print(line, highlight=False, markup=False)


def progress_text(m: StepMetrics) -> str:
    """The live line's figures after step ``m``: loss, throughput, step time, the learning rate (each
    LoRA task's where they differ), the experts' balance (a mixture of experts) and the policy.

    >>> from flexmesh.runtime.train.config import StepMetrics
    >>> m = StepMetrics(step=3, loss=2.5, grad_norm=1.0, lr=1e-4, tokens=100, label_tokens=90, padded_tokens=100,
    ...                 microbatches=1, step_time_s=0.5, tokens_per_s=200.0, peak_memory_gib=None, policy="fixed",
    ...                 tasks=("chat", "code"), task_lr=(1e-4, 3e-4), expert_imbalance=1.25)
    >>> progress_text(m)
    'loss 2.5000  200 tok/s  500 ms/step  lr chat 1.00e-04 code 3.00e-04  experts max/mean 1.25  fixed'
    """
    if m.task_lr and len(set(m.task_lr)) > 1:
        lr = "lr " + " ".join(f"{name} {x:.2e}" for name, x in zip(m.tasks, m.task_lr, strict=False))
    else:
        lr = f"lr {m.lr:.2e}"
    experts = f"  experts max/mean {m.expert_imbalance:.2f}" if m.expert_imbalance is not None else ""
    return (f"loss {m.loss:.4f}  {m.tokens_per_s:,.0f} tok/s  {m.step_time_s * 1e3:.0f} ms/step  {lr}{experts}  "
            f"{m.policy}{' (fallback)' if m.fallback else ''}")


class _Progress:
    """A live one-line progress bar with loss, tokens/s and step time (rich)."""

    def __init__(self, total: int, done: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        from flexmesh.console import plain_console

        self._bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("{task.description}", markup=False), TimeRemainingColumn(),
                             console=plain_console(), transient=False)
        self._task = self._bar.add_task("", total=total, completed=done)
        self._bar.start()

    def update(self, m: StepMetrics) -> None:
        self._bar.update(self._task, completed=m.step, description=progress_text(m))

    def say(self, line: str) -> None:
        self._bar.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def close(self) -> None:
        self._bar.stop()
