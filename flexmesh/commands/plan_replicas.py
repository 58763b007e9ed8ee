"""``flexmesh plan --tasks FILE --replicas``: a mix of replica layouts for LoRA tasks, as a plan of replica
groups (flexmesh.search.replicas).

Each task's lengths come from its job-file ``lengths`` (a shipped set or a file), else from
``--lengths`` (default wikipedia); sequences longer than ``--seq-len`` are truncated to it. Steps of
every task's batch are drawn (seeded): 4 to plan the mix on, 8 others to score it and every single
layout that holds ``--seq-len`` on, with the same dispatch and cost model. Layouts keep to pp 1 (what
adapters train on); ``--out`` writes the mix as a plan that ``flexmesh train --tasks`` runs.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import numpy as np
from rich.console import JustifyMethod
from rich.table import Table

from flexmesh.console import plain_console
from flexmesh.errors import PlanError
from flexmesh.job import Job
from flexmesh.layout.plan import Plan

PLAN_STEPS, SCORED_STEPS = 4, 8


def replica_command(job: Job, lengths: str | None, as_json: bool, out_path: str | None = None,
                    record: Callable[[Plan], Plan] = lambda plan: plan) -> int:
    """The mix of replica layouts for ``job``'s LoRA tasks against every single layout, printed (or JSON);
    the mix as a plan of replica groups (``record`` adds what the plan records of the command line)
    written to ``out_path`` where one is given."""
    from flexmesh.data.lengths import load_lengths
    from flexmesh.search.replicas import Pricer, mix_plan, plan_mix, replica_types, single_layouts, step_time

    tasks, cost = job.parts.tasks, job.cost
    if tasks is None or cost is None:
        raise PlanError("--replicas plans replicas for LoRA tasks: give --tasks FILE")
    world, longest = cost.cluster.world_size, job.seq_len
    sets = [np.minimum(load_lengths(t.lengths or lengths or "wikipedia"), longest) for t in tasks]
    batches = job.task_batches
    rng = np.random.default_rng(0)
    steps = [[int(x) for x in np.concatenate([rng.choice(s, b) for s, b in zip(sets, batches, strict=True)])]
             for _ in range(PLAN_STEPS + SCORED_STEPS)]
    t0 = time.perf_counter()
    best, _ = plan_mix(cost, world, steps[:PLAN_STEPS], types=replica_types(cost, world, pp_options=(1,)),
                       seq_len=longest)
    plan = record(mix_plan(best, cost, steps[:PLAN_STEPS], longest, sum(batches)))
    seconds = time.perf_counter() - t0
    pricer, scored = Pricer(cost), steps[PLAN_STEPS:]

    def mean(replicas: list) -> float:
        return statistics.mean(step_time(s, replicas, pricer) for s in scored)

    singles = single_layouts(cost, world, longest, scored, pricer)
    mix_s = mean(best.replicas)
    if out_path:
        plan.save(out_path)
    if as_json:
        print(json.dumps({"mix": [{"layout": t.label, "replicas": n, "devices": t.devices, "max_tokens": t.capacity}
                                  for t, n in best.counts], "step_s": mix_s,
                          "single": [{"layout": t.label, "replicas": world // t.devices, "step_s": s}
                                     for s, t in singles[:5]], "plan_seconds": seconds,
                          "plan": plan.to_dict()}, indent=2))
        return 0
    out = plain_console()
    table = Table(title=f"replicas for {len(tasks)} LoRA tasks on {world} devices (planned in {seconds:.1f} s, "
                        f"scored on {SCORED_STEPS} steps of {sum(batches)} sequences)")
    columns: tuple[tuple[str, JustifyMethod], ...] = (("setting", "left"), ("replicas", "left"),
                                                      ("mean step s", "right"), ("mix saves", "right"))
    for col, just in columns:
        table.add_column(col, justify=just, overflow="fold")
    table.add_row("mix", best.label, f"{mix_s:.4g}", "-")
    for s, t in singles[:3]:
        table.add_row("single layout", f"{world // t.devices}x {t.label}", f"{s:.4g}", f"{1 - mix_s / s:.1%}")
    out.print(table)
    out.print(f"as replica groups:\n{plan.layout}", highlight=False)
    out.print("each step, the longest sequence first goes to the replica that finishes it earliest; "
              "`flexmesh train --tasks FILE --plan PLAN` runs the plan (docs/adapters.md)", highlight=False)
    if out_path:
        out.print(f"wrote the plan to {out_path}", highlight=False)
    return 0
