"""Three LoRA tasks, one 8x longer than the others, trained together on this machine with per-step
dispatch: predicted step against measured.

What a user does: ``flexmesh profile hardware`` and ``flexmesh profile model`` (this machine's own
profiles), ``flexmesh plan --tasks jobs.toml --cluster 2xlocal`` (layouts adapters train on, priced
for a frozen base: flexmesh.cost.training.adapters), then ``flexmesh train --tasks jobs.toml --nproc 2 --policy
balanced``: every step the scheduler deals the three tasks' documents over the two data ranks by the
cost model. Each step's prediction is the trainer's (``predicted_step_time_s`` in metrics.jsonl: the
step simulator on the schedule that ran); the measured step is ``step_time_s``. Profiles are taken
into a fresh cache folder; the first step is left out (warm-up). In-sample in the sense that the
profiles were taken on this machine by this run.

    OMP_NUM_THREADS=1 python -m bench.lora_measured          # records "lora_measured" in bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from bench.local_device import flexmesh

# The code these figures depend on (`python -m bench.status` diffs it against each record's commit): it
# runs `flexmesh` commands, so the whole package.
DEPENDS_ON = ("flexmesh", "bench/local_device.py")

TARGET = 0.30  # the median |predicted - measured| / measured this project holds CPU predictions to
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly boxing and "
         "pack my box with five dozen liquor jugs sphinx of black quartz judge my vow").split()


def write_task(folder: Path, docs: int, words: int, seed: int) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for i in range(docs):
        n = int(words * rng.uniform(0.6, 1.4))
        (folder / f"d{i:03d}.txt").write_text(" ".join(rng.choice(WORDS, n)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-record", action="store_true", help="print only: leave bench/RESULTS.md alone")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="flexmesh-lora-"))
    env = dict(os.environ, FLEXMESH_CACHE=str(tmp / "cache"), OMP_NUM_THREADS="1")
    write_task(tmp / "chat", 64, 60, 0)
    write_task(tmp / "qa", 64, 60, 1)
    write_task(tmp / "code", 32, 480, 2)  # 8x longer
    job = tmp / "jobs.toml"
    job.write_text("\n".join(
        f'[[task]]\nname = "{n}"\ncorpus = "{n}"\nrank = {r}\nalpha = {2 * r}\ntargets = {json.dumps(t)}\nbatch = {b}\n'
        for n, r, t, b in (("chat", 8, ["q_proj", "v_proj"], 6),
                           ("qa", 16, ["q_proj", "k_proj", "v_proj", "o_proj"], 6),
                           ("code", 8, ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], 4))))
    load = os.getloadavg()[0]
    flexmesh("profile", "hardware", "--quick", "--nproc", "2", "--out", str(tmp / "hw.json"), "--no-progress", env=env)
    flexmesh("profile", "model", "--model", "tiny", "--quick", "--nproc", "2", "--out", str(tmp / "mp.json"),
             "--no-progress", env=env)
    plan = tmp / "plan.json"
    flexmesh("plan", "--model", "tiny", "--cluster", "2xlocal", "--tasks", str(job), "--seq-len", "1024",
             "--global-batch", "16", "--out", str(plan), env=env)
    run = tmp / "run"
    flexmesh("train", "--plan", str(plan), "--tasks", str(job), "--max-steps", str(args.steps), "--out", str(run),
             "--nproc", "2", "--no-progress", "--policy", "balanced", "--straggler-threshold", "0.99",
             "--seq-len", "1024", env=env)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "task_loss" in r]
    timed = [r for r in steps[1:] if r.get("predicted_step_time_s")]
    measured = statistics.median(r["step_time_s"] for r in timed)
    predicted = statistics.median(r["predicted_step_time_s"] for r in timed)
    error = statistics.median(abs(r["predicted_step_time_s"] - r["step_time_s"]) / r["step_time_s"] for r in timed)
    after = os.getloadavg()[0]
    tokens = [statistics.mean(r["task_tokens"][i] for r in steps) for i in range(3)]
    from bench._results import markdown_table, record
    from flexmesh.layout.plan import load_plan

    table = [[r["step"], f"{r['step_time_s']:.3f}", f"{r['predicted_step_time_s']:.3f}",
              f"{(r['predicted_step_time_s'] - r['step_time_s']) / r['step_time_s']:+.1%}",
              " / ".join(f"{x:.3f}" for x in r["task_loss"])] for r in timed]
    md = [f"`tiny` (fp32), frozen, on 2 processes of this machine (2 cores, gloo, OMP_NUM_THREADS=1); 3 tasks "
          f"(chat rank 8, qa rank 16, code rank 8 with 8x longer documents), label tokens per step "
          f"{', '.join(f'{t:,.0f}' for t in tokens)}; plan `{load_plan(plan).layout}` for "
          f"`2xlocal` with --tasks, policy balanced (each step's documents dealt over the 2 data ranks); "
          f"profiles taken by this run (`--quick`).", "",
          *markdown_table(["step", "measured s", "predicted s", "error", "task loss chat / qa / code"], table), "",
          f"- median measured {measured:.3f} s, predicted {predicted:.3f} s, median |error| {error:.1%} "
          f"(<= {TARGET:.0%}: {'PASS' if error <= TARGET else 'FAIL'})",
          f"- load average {load:.1f} before, {after:.1f} after (2 cores)",
          "Reproduce: `OMP_NUM_THREADS=1 python -m bench.lora_measured`"]
    print("\n".join(md))
    if not args.no_record:
        record("lora_measured", "\n".join(md), headline=f"step predicted within {error:.1%} (median; measured "
               f"{measured:.3f} s, predicted {predicted:.3f} s)")


if __name__ == "__main__":
    main()
