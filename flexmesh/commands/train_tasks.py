"""``flexmesh train --tasks``: the job file a LoRA run trains, and the table of its tasks at the end
(docs/adapters.md)."""

from __future__ import annotations

from flexmesh.commands.args import tasks_of
from flexmesh.errors import PlanError
from flexmesh.spec.model import ModelSpec
from flexmesh.spec.tasks import TaskSet


def run_tasks(path: str | None, corpus: str | None, spec: ModelSpec) -> TaskSet | None:
    """The LoRA tasks of ``--tasks`` (the job file at ``path``, checked against the model), None without;
    a run needs ``--corpus`` without tasks, and a corpus in every task with them."""
    tasks = tasks_of(path, spec)
    if tasks is None:
        if corpus is None:
            raise PlanError("give --corpus (a folder of documents, a .jsonl file or 'stdlib'), --domains PATH, or "
                            "--tasks FILE")
        return None
    for t in tasks:
        if not t.corpus:
            raise PlanError(f"task {t.name!r} of {path} has no corpus (its lengths only plan); give it one")
    return tasks


def task_table(history) -> None:  # noqa: ANN001 - StepMetrics of this run
    """Per LoRA task: its loss at its first and latest step of this run, its steps and label tokens."""
    from rich.table import Table

    from flexmesh.console import plain_console

    table = Table(title="tasks")
    for col in ("task", "first loss", "latest loss", "steps", "label tokens"):
        table.add_column(col, justify="left" if col == "task" else "right")
    for i, name in enumerate(history[-1].tasks):
        trained = [m for m in history if m.task_tokens and m.task_tokens[i]]
        if not trained:
            table.add_row(name, "-", "-", "0", "0")
            continue
        table.add_row(name, f"{trained[0].task_loss[i]:.4f}", f"{trained[-1].task_loss[i]:.4f}", str(len(trained)),
                      f"{sum(m.task_tokens[i] for m in trained):,}")
    plain_console().print(table)
