"""The training loop: feed a Trainer steps from a source until ``max_steps``, resuming, logging and
checkpointing on the way (see :func:`fit`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch.distributed as dist

from flexmesh.layout.step import StepSchedule
from flexmesh.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from flexmesh.runtime.config import StepMetrics, TrainConfig
from flexmesh.runtime.trainer import Trainer


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


def fit(trainer: Trainer, source: StepSource, config: TrainConfig) -> list[StepMetrics]:
    """Run steps until ``config.max_steps``: resume, log metrics.jsonl, show progress, checkpoint.

    Rank 0 appends one JSON object per step to ``<out_dir>/metrics.jsonl`` (fields in
    docs/metrics.md); on resume, lines of steps after the checkpoint are dropped first so the file
    never holds a step twice. Checkpoints go to ``<out_dir>/checkpoints`` every
    ``checkpoint_every`` steps and at the end.
    """
    out = Path(config.out_dir) if config.out_dir else None
    ckpt_root = out / "checkpoints" if out else None
    rank0 = dist.get_rank() == 0
    if ckpt_root is not None and config.resume:
        found = latest_checkpoint(ckpt_root)
        if found is not None:
            source.load_state_dict(load_checkpoint(found, trainer))
    metrics_file = out / "metrics.jsonl" if out else None
    if rank0 and metrics_file is not None:
        out.mkdir(parents=True, exist_ok=True)
        kept = []
        if metrics_file.exists():
            kept = [ln for ln in metrics_file.read_text().splitlines()
                    if ln.strip() and json.loads(ln)["step"] <= trainer.step_index]
        metrics_file.write_text("".join(ln + "\n" for ln in kept))
    history: list[StepMetrics] = []
    progress = _Progress(config.max_steps, trainer.step_index) if rank0 and config.progress else None
    try:
        while trainer.step_index < config.max_steps:
            try:
                docs, schedule = next(source)
            except StopIteration:
                break
            m = trainer.step(docs, schedule)
            history.append(m)
            if rank0 and metrics_file is not None:
                with metrics_file.open("a") as f:
                    f.write(json.dumps(m.to_dict()) + "\n")
            if progress is not None:
                progress.update(m)
            every = config.checkpoint_every
            due = (every and m.step % every == 0) or m.step == config.max_steps
            if ckpt_root is not None and due:
                save_checkpoint(ckpt_root, m.step, trainer, source.state_dict())
    finally:
        if progress is not None:
            progress.close()
        if hasattr(source, "close"):  # e.g. AdaptiveSource's background scheduler
            source.close()
    return history


class _Progress:
    """A live one-line progress bar with loss, tokens/s and step time (rich)."""

    def __init__(self, total: int, done: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                             TimeRemainingColumn(), transient=False)
        self._task = self._bar.add_task("", total=total, completed=done)
        self._bar.start()

    def update(self, m: StepMetrics) -> None:
        self._bar.update(self._task, completed=m.step, description=(
            f"loss {m.loss:.4f}  {m.tokens_per_s:,.0f} tok/s  {m.step_time_s * 1e3:.0f} ms/step  lr {m.lr:.2e}  "
            f"{m.policy}{' (fallback)' if m.fallback else ''}"))

    def close(self) -> None:
        self._bar.stop()
