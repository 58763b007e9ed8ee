"""Many LoRA tasks on one cluster: a mix of replica layouts with per-step dispatch, against the strongest
single layout and LobRA's published mix, all priced by the same cost model.

LobRA's setting (2509.01193): a Llama-2-7B-shaped model on 16 A100-40GB (2 nodes of 8), 6 fine-tuning
tasks, sequences up to 16K. The tasks' lengths are the project's real length sets standing in for
LobRA's task data: Wikipedia (documents up to 1K, and all), ProLong (up to 4K, and all) and the
WLB-LLM mix (up to 2K, and all), each truncated at 16K; 32 sequences of each task per step.

- mix: flexmesh.search.replicas.plan_mix, planned on 4 sample steps, then scored on 16 other steps
- best single layout: every layout that holds 16K (tp x cp x pp, each recomputation mode), 16 / its
  devices replicas of it, the same dispatch; the fastest on the scored steps (and the fastest without
  context parallelism, the baseline LobRA compares with: TP and PP only)
- LobRA's mix: 6 x TP1 taking sequences <= 2K, 1 x TP2 <= 4K, 1 x TP8 <= 16K, no recomputation
  where the layout holds its band without it (else the fastest mode that does)

GPU-seconds per step = 16 x the mean step (every device is held for the step). Simulated: the cost
model is flexmesh's A100 preset for a frozen base with rank-16 adapters on q, k, v, o
(flexmesh.cost.training.adapters); nothing here ran on a GPU.

    python -m bench.lora_replicas          # records "lora_replicas" in bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# The code these figures depend on (`python -m bench.status` diffs it against each record's commit).
DEPENDS_ON = ("flexmesh/search", "flexmesh/cost", "flexmesh/schedule/dispatch.py", "flexmesh/schedule/packing.py",
              "flexmesh/data", "flexmesh/layout", "flexmesh/spec", "flexmesh/errors.py",
              "flexmesh/files.py", "flexmesh/inputs.py", "flexmesh/units.py")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SAVING_TARGET = 0.40  # >= 40% fewer GPU-seconds than the strongest single layout
DISPATCH_TARGET_S = 0.050  # p95 dispatch time per step
LONGEST = 16384


def task_lengths() -> list[tuple[str, np.ndarray]]:
    from flexmesh.data.lengths import load_lengths

    w, pro, wlb = (load_lengths(n) for n in ("wikipedia", "prolong", "wlbllm"))
    return [("wikipedia<=1K", w[w <= 1024]), ("wikipedia", w), ("prolong<=4K", pro[pro <= 4096]),
            ("prolong", pro), ("wlbllm<=2K", wlb[wlb <= 2048]), ("wlbllm", wlb)]


def steps(tasks: list[tuple[str, np.ndarray]], n: int, per_task: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.concatenate([np.minimum(rng.choice(lengths, per_task), LONGEST) for _, lengths in tasks]).astype(int)
            for _ in range(n)]


def main() -> None:
    from flexmesh.cost import CostModel
    from flexmesh.cost.training.parts import Parts
    from flexmesh.layout.strategy import Recompute
    from flexmesh.search.replicas import Pricer, dispatch, plan_mix, replica_types, single_layouts, step_time
    from flexmesh.spec import parse_cluster, parse_model
    from flexmesh.spec.tasks import Task, TaskSet

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-task", type=int, default=32, help="sequences of each task per step")
    ap.add_argument("--steps", type=int, default=16, help="steps the mixes are scored on")
    ap.add_argument("--no-record", action="store_true", help="print only: leave bench/RESULTS.md alone")
    args = ap.parse_args()
    tasks = task_lengths()
    job = TaskSet(tuple(Task(name=n, rank=16, alpha=32, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
                        for n, _ in tasks))
    cost = CostModel(parse_model("llama2-7b"), parse_cluster("2x8xA100-40GB"), parts=Parts(tasks=job))
    devices = cost.cluster.world_size
    pricer = Pricer(cost)
    sample, scored = steps(tasks, 4, args.per_task, 0), steps(tasks, args.steps, args.per_task, 1)

    t0 = time.perf_counter()
    best, _ = plan_mix(cost, devices, sample)
    plan_s = time.perf_counter() - t0

    def mean_step(replicas) -> float:  # noqa: ANN001
        return statistics.mean(step_time(s, replicas, pricer) for s in scored)

    every = replica_types(cost, devices, prune=False)
    uniform = single_layouts(cost, devices, LONGEST, scored, pricer)
    single_s, single = uniform[0]
    no_cp_s, no_cp = next((s, t) for s, t in uniform if t.cp == 1)

    def lobra(tp: int, band: int):  # noqa: ANN202
        fits = [t for t in every if (t.tp, t.cp, t.pp) == (tp, 1, 1) and t.capacity >= band]
        order = [Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL]
        return min(fits, key=lambda t: order.index(t.recompute)).limited(band)

    published = [lobra(1, 2048)] * 6 + [lobra(2, 4096), lobra(8, LONGEST)]
    mix_s, lobra_s = mean_step(best.replicas), mean_step(published)
    waits = []
    for s in scored:
        t = time.perf_counter()
        dispatch(s, best.replicas, pricer)
        waits.append(time.perf_counter() - t)
    p95 = float(np.quantile(waits, 0.95))
    saving = 1 - mix_s / single_s
    from bench._results import markdown_table, record

    rows = [["mix (planned)", best.label, f"{mix_s:.3f}", f"{devices * mix_s:.1f}", "-"],
            ["best single layout", f"{devices // single.devices}x {single.label}", f"{single_s:.3f}",
             f"{devices * single_s:.1f}", f"{saving:.1%}"],
            ["best single layout without cp", f"{devices // no_cp.devices}x {no_cp.label}", f"{no_cp_s:.3f}",
             f"{devices * no_cp_s:.1f}", f"{1 - mix_s / no_cp_s:.1%}"],
            ["LobRA's published mix", "6x tp1 (<= 2K) + 1x tp2 (<= 4K) + 1x tp8 (<= 16K)", f"{lobra_s:.3f}",
             f"{devices * lobra_s:.1f}", f"{1 - mix_s / lobra_s:.1%}"]]
    runner_ups = "; ".join(f"{devices // t.devices}x {t.label} {s:.3f} s" for s, t in uniform[1:5])
    md = [f"Simulated: `llama2-7b` frozen, 6 tasks of rank-16 adapters on q/k/v/o, 16 A100-40GB (2x8), "
          f"{args.per_task} sequences per task per step (length sets: {', '.join(n for n, _ in tasks)}; at most "
          f"16K). Mix planned on 4 sample steps in {plan_s:.1f} s, every row scored on {args.steps} other steps "
          "with the same dispatch and cost model.", "",
          *markdown_table(["setting", "replicas", "mean step s", "GPU-s per step", "mix saves"], rows), "",
          f"- mix vs best single layout: {saving:.1%} fewer GPU-seconds (target >= {SAVING_TARGET:.0%}: "
          f"{'PASS' if saving >= SAVING_TARGET else 'FAIL'}); vs LobRA's mix: "
          f"{'no more' if mix_s <= lobra_s else 'MORE'} GPU-seconds ({'PASS' if mix_s <= lobra_s else 'FAIL'})",
          f"- next single layouts: {runner_ups}",
          f"- dispatch per step (longest first, {len(scored[0])} sequences): p95 {p95 * 1e3:.1f} ms (target <= "
          f"{DISPATCH_TARGET_S * 1e3:.0f} ms: {'PASS' if p95 <= DISPATCH_TARGET_S else 'FAIL'})",
          "Reproduce: `python -m bench.lora_replicas`"]
    print("\n".join(md))
    if not args.no_record:
        record("lora_replicas", "\n".join(md), headline=f"planned mix {saving:.1%} fewer GPU-seconds than the best "
               f"single layout, {1 - mix_s / lobra_s:.1%} fewer than LobRA's mix")


if __name__ == "__main__":
    main()
