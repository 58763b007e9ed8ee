"""Calibration: profile this machine, then predict and measure step time and activation memory per plan.

1. ``flexmesh profile hardware --quick`` and ``flexmesh profile model --model tiny --quick``, each with
   ``--nproc W`` for every world size W used below (so the contention of W processes on this
   machine's cores is in the numbers, the layer is timed under real tp / Ulysses / ring groups of
   every layout that divides W, and the overlap of communication with compute is measured).
2. For every plan in ``PLANS`` (the ``tiny`` model: 4 layers, hidden 256; fp32 on CPU; world 2 or 4;
   data, ZeRO-3, tensor, pipeline, Ulysses, ring, mixes, recomputation on and off), the cost model
   built from those profiles predicts the step time and the per-device activation memory
   (``CostModel.evaluate``: activations plus the last stage's logits); the runtime then trains the
   plan for ``--steps`` steps on global
   batches of equal-length documents (the shape the plan was evaluated for) and measures the median
   step time after one warm-up step and the peak bytes autograd saved for backward on any rank
   (``flexmesh.runtime.observe.memory.SavedActivationMeter``, reported by the trainer).
3. Prints predicted against measured and the median absolute errors (targets: <= 15% step time,
   <= 10% activation memory); records the table in the "calibrate" section of bench/RESULTS.md.

    python -m bench.calibrate            # full run, records RESULTS.md
    python -m bench.calibrate --quick    # 3 steps, 4 plans, prints only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flexmesh.runtime.launch import child_env, run_torchrun  # noqa: E402  (after the path: `python bench/calibrate.py` works)

# The code these figures depend on (`python -m bench.status` diffs it against each record's commit): it
# runs `flexmesh` commands, so the whole package.
DEPENDS_ON = ("flexmesh",)

MODEL = "tiny"
# name -> (world, per-layer strategy, pipeline degree)
PLANS = {
    "dp2": (2, "tp1-dp2z0", 1),
    "dp2 + recompute": (2, "tp1-dp2z0-ac", 1),
    "zero3 dp2": (2, "tp1-dp2z3", 1),
    "tp2 (sp)": (2, "tp2-dp1z0", 1),
    "pp2 1f1b": (2, "tp1-dp1z0", 2),
    "ulysses2": (2, "tp1-u2-dp1z0", 1),
    "ring2": (2, "tp1-r2-dp1z0", 1),
    "ring2 + recompute": (2, "tp1-r2-dp1z0-ac", 1),
    "tp2 x dp2 zero3 + recompute": (4, "tp2-dp2z3-ac", 1),
    "ulysses2 x dp2 zero2": (4, "tp1-u2-dp2z2", 1),
    "pp2 x dp2 1f1b": (4, "tp1-dp2z2", 2),
    "pp2 1f1b short micro-batches": (2, "tp1-dp1z0", 2),
}
QUICK = ("dp2", "tp2 (sp)", "ulysses2", "pp2 1f1b")
# (seq_len, global_batch) of plans that do not run the command line's: 32 micro-batches of 128 tokens,
# where the framework's cost per pipeline chunk (the model profile's `pipeline`) is a visible share
SHAPES = {"pp2 1f1b short micro-batches": (128, 32)}


def shape(name: str, seq_len: int, global_batch: int) -> tuple[int, int]:
    return SHAPES.get(name, (seq_len, global_batch))


def make_plan(world: int, strategy: str, pp: int, seq_len: int, global_batch: int):
    """A plan of one sequence per replica per micro-batch: ``global_batch / dp`` micro-batches."""
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    s = LayerStrategy.parse(strategy)
    per = 4 // pp
    stages = tuple(StagePlan(i * per, (i + 1) * per, (s,) * per) for i in range(pp))
    return Plan.uniform(model=MODEL, cluster=f"{world}xA100-80GB", world_size=world, pp=pp, pipeline_schedule="1f1b",
                num_microbatches=global_batch // s.dp, seq_len=seq_len, global_batch=global_batch, stages=stages)


def cost_model(world: int, profiles: Path, stage_cost: bool = True):
    """The cost model of this world's profiles (``stage_cost=False``: without the model profile's
    framework seconds per pipeline chunk, to show what that term does)."""
    from flexmesh.profile import cost_model_from_profiles, load_profile
    from flexmesh.spec.model import parse_model

    model = load_profile(profiles / f"model_{world}.json", "model")
    if not stage_cost:
        model.pipeline = {}
    return cost_model_from_profiles(parse_model(MODEL), hardware=profiles / f"hardware_{world}.json",
                                    model=model, world=world)


def steps_for(plan, cost, steps: int, seed: int = 0) -> list:
    """``steps`` global batches of equal-length random documents, dealt by ``fixed`` with the plan's cp."""
    from dataclasses import replace

    import numpy as np

    from flexmesh.layout.mesh import layout_from_plan
    from flexmesh.schedule.context import ScheduleContext
    from flexmesh.schedule.registry import make_schedule

    lay = layout_from_plan(plan)
    ctx = ScheduleContext(cost=cost, base=replace(plan.layer_strategies()[0], cp=1, cp_kind="none", dp=1),
                          num_ranks=lay.data_ranks, pp=plan.pp, pipeline_schedule=plan.pipeline_schedule,
                          cp_kind=lay.cp_kind if lay.cp > 1 else "ulysses")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        docs = [rng.integers(1, cost.model.vocab, size=plan.seq_len) for _ in range(plan.global_batch)]
        out.append((docs, make_schedule("fixed", [plan.seq_len] * plan.global_batch, ctx, cp=lay.cp,
                                        context=plan.seq_len)))
    return out


def worker(out: Path, names: list[str], profiles: Path, steps: int, seq_len: int, global_batch: int) -> None:
    """Under torchrun: train every named plan of this world size; rank 0 writes measured figures."""
    import torch
    import torch.distributed as dist

    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.train.config import TrainConfig
    from flexmesh.runtime.train.trainer import Trainer
    from flexmesh.spec.model import parse_model

    torch.set_num_threads(1)
    init_distributed(timeout_s=300)
    world = dist.get_world_size()
    cost = cost_model(world, profiles)
    results = {}
    for name in names:
        w, strategy, pp = PLANS[name]
        plan = make_plan(w, strategy, pp, *shape(name, seq_len, global_batch))
        trainer = Trainer(plan, parse_model(MODEL), TrainConfig(max_steps=steps, progress=False))
        times, act = [], []
        for docs, schedule in steps_for(plan, cost, steps):
            m = trainer.step(docs, schedule)
            times.append(m.step_time_s)
            act.append(max(m.activation_peak_bytes))
        results[name] = {"step_time_s": statistics.median(times[1:]), "activation_bytes": max(act),
                         "step_times_s": times}
        del trainer
        dist.barrier()
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def profile(world: int, profiles: Path, console) -> None:
    for kind, extra in (("hardware", []), ("model", ["--model", MODEL])):
        out = profiles / f"{kind}_{world}.json"
        console.print(f"profiling {kind} with {world} processes -> {out.name}", highlight=False)
        cmd = [sys.executable, "-m", "flexmesh", "profile", kind, *extra, "--quick", "--nproc", str(world),
               "--out", str(out), "--no-progress"]
        proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"profiling failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--workdir", help="keep profiles and measurements here (default: a temporary folder)")
    ap.add_argument("--predict-only", action="store_true",
                    help="reuse the profiles and measurements in --workdir; only predict again "
                         "(prints, records nothing)")
    ap.add_argument("--quick", action="store_true", help="3 steps, 4 plans, no RESULTS.md update")
    args = ap.parse_args()
    steps = 3 if args.quick else args.steps
    names = list(QUICK if args.quick else PLANS)

    from rich.console import Console
    from rich.table import Table

    from flexmesh.report import median_abs_error

    console = Console(width=max(Console().width, 140))
    worlds = sorted({PLANS[n][0] for n in names})
    if args.predict_only and not args.workdir:
        raise SystemExit("--predict-only needs --workdir (where an earlier run kept its profiles and measurements)")
    with tempfile.TemporaryDirectory() as tmp:
        profiles = Path(args.workdir or tmp)
        profiles.mkdir(parents=True, exist_ok=True)
        measured: dict = {}
        for w in worlds:
            res = profiles / f"measured_{w}.json"
            if not args.predict_only:
                profile(w, profiles, console)
                mine = [n for n in names if PLANS[n][0] == w]
                console.print(f"training {len(mine)} plans at world {w}: {', '.join(mine)}", highlight=False)
                worker_argv = [str(Path(__file__).resolve()), "worker", str(res), ",".join(mine), str(profiles),
                               str(steps), str(args.seq_len), str(args.global_batch)]
                proc = run_torchrun(w, worker_argv, env=child_env(), capture_output=True, text=True, timeout=1800)
                if proc.returncode != 0:
                    raise SystemExit(f"world-{w} run failed:\n{proc.stderr[-4000:]}")
            measured.update(json.loads(res.read_text()))
        rows, without = [], []
        for name in names:
            w, strategy, pp = PLANS[name]
            plan = make_plan(w, strategy, pp, *shape(name, args.seq_len, args.global_batch))
            ev = cost_model(w, profiles).evaluate(plan)
            if pp > 1:
                t = cost_model(w, profiles, stage_cost=False).evaluate(plan).step_time
                meas = measured[name]["step_time_s"]
                without.append(f"{name}: {t:.3f} s ({(t - meas) / meas:+.1%}) without it, {ev.step_time:.3f} s "
                               f"({(ev.step_time - meas) / meas:+.1%}) with it")
            # What autograd keeps for backward: the layers' activations and, on the last stage, the logits.
            act = max(m["activations"] + m["logits"] for m in ev.memory)
            got = measured[name]
            rows.append((name, w, strategy, ev.step_time, got["step_time_s"], act, got["activation_bytes"]))

    err_t = median_abs_error([r[3] for r in rows], [r[4] for r in rows])
    err_m = median_abs_error([r[5] for r in rows], [r[6] for r in rows])
    table = Table(title=f"{MODEL} (fp32 CPU), {args.global_batch} x {args.seq_len}-token documents per step, "
                        f"predicted from this machine's profiles vs measured")
    cols = ("plan", "world", "strategy x 4 layers", "step s pred", "step s meas", "error", "act MiB pred",
            "act MiB meas", "error")
    for c in cols:
        table.add_column(c, justify="left" if c in ("plan", cols[2]) else "right", no_wrap=True)
    md_rows = []
    for name, w, layout, tp, tm, ap_, am in rows:
        cells = (name, str(w), layout, f"{tp:.3f}", f"{tm:.3f}", f"{(tp - tm) / tm:+.1%}", f"{ap_ / 2**20:.1f}",
                 f"{am / 2**20:.1f}", f"{(ap_ - am) / am:+.1%}")
        table.add_row(*cells)
        md_rows.append(cells)
    console.print(table)
    summary = (f"median |error|: step time {err_t:.1%} (target <= 15%: {'PASS' if err_t <= 0.15 else 'FAIL'}), "
               f"activation memory {err_m:.1%} (target <= 10%: {'PASS' if err_m <= 0.10 else 'FAIL'}) over "
               f"{len(rows)} plans")
    console.print(summary, highlight=False)
    stage_line = ("Pipeline plans priced with and without the model profile's framework seconds per chunk "
                  f"(`pipeline.stage_fixed_s`): {'; '.join(without)}.") if without else ""
    console.print(stage_line, highlight=False)
    if not (args.quick or args.predict_only):  # a record is of one run that measured what it predicts
        from bench._results import markdown_table, record

        md = [f"Profiles: `flexmesh profile hardware --quick` and `flexmesh profile model --model {MODEL} --quick`, "
              f"each with `--nproc W` for W in {worlds}, on this machine ({os.cpu_count()} cores, OMP_NUM_THREADS=1). "
              f"Each plan trained {steps} steps of {args.global_batch} random-token documents of {args.seq_len} "
              f"tokens (`{'`, `'.join(SHAPES)}`: {', '.join(f'{b} of {n}' for n, b in SHAPES.values())}); "
              "measured step time = median after the first step; measured activation memory = peak bytes "
              "saved for backward on any rank (SavedActivationMeter).", "",
              *markdown_table(cols, md_rows), "", f"**{summary}**", "", stage_line]
        record("calibrate", "\n".join(md), headline=f"median error over {len(rows)} plans: step time {err_t:.1%}, "
               f"activation memory {err_m:.1%}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        _, _, out, names, profiles, steps, seq_len, gb = sys.argv
        worker(Path(out), names.split(","), Path(profiles), int(steps), int(seq_len), int(gb))
    else:
        main()
