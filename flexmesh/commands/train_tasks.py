"""``flexmesh train --tasks``: the job file a LoRA run trains, and the table of its tasks at the end
(docs/adapters.md)."""

from __future__ import annotations

import argparse

from flexmesh.errors import PlanError


def run_tasks(args: argparse.Namespace, spec):
    """The LoRA tasks of ``--tasks`` (checked against the model), None without."""
    from flexmesh.commands.args import job_tasks

    tasks = job_tasks(args, spec)
    if tasks is None:
        if args.corpus is None:
            raise PlanError("give --corpus (a folder of documents, a .jsonl file or 'stdlib'), or --tasks FILE")
        return None
    for t in tasks:
        if not t.corpus:
            raise PlanError(f"task {t.name!r} of {args.tasks} has no corpus (its lengths only plan); give it one")
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
