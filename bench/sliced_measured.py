"""Measured: a pipeline of 2 stages training documents cut into slices, against the same batches whole.

1. ``flexmesh profile hardware --quick`` and ``flexmesh profile model --model tiny --quick`` with
   ``--nproc 2`` (bench.calibrate's profiles), so the cost model prices this machine.
2. The ``tiny`` model on a pp 2 pipeline (1F1B, 2 layers per stage, fp32 on CPU, 2 processes,
   OMP_NUM_THREADS=1: no more processes than cores), ``--steps`` global batches of random-token
   documents whose lengths are drawn from the shipped ProLong length set, cut at ``--seq-len``.
   Every batch runs under four schedules of the same documents:
   - ``chunked, sliced``: long documents cut into slices of equal time (flexmesh.schedule.chunking)
     of the policy's first candidate slice time (lower bound / 2 pp), the slices of a document in
     consecutive micro-batches beside short ones, run in the unit order
     (flexmesh.layout.pipeline_order) with the earlier slices' keys and values carried;
   - ``chunked``: the policy as ``flexmesh train`` runs it, choosing slice time and whether to cut
     by the step's price;
   - ``chunked, whole``: the same policy with cutting off (``cut_documents=False``);
   - ``fixed``: the plan's micro-batches packed first-fit, no cutting.
3. Per schedule: measured median step time (after the first step), the simulator's prediction for
   the schedules that ran (flexmesh.sim.timeline.simulate_step on the profiles' cost model), the
   error, the documents cut per step, micro-batches per step, the measured peak of saved
   activations on either stage against the prediction (flexmesh.sim.memory: the in-flight sets of the
   step's order, the profile's bytes per token and its fit of what a carried piece keeps) with the
   median error over steps, and the largest loss difference from the ``fixed`` run over all steps
   (the correctness contract: the same batch gives the same loss under every schedule).

    python -m bench.sliced_measured                 # records the "sliced_measured" section
    python -m bench.sliced_measured --quick         # 3 steps, prints only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.calibrate import MODEL, cost_model, profile  # noqa: E402  (after the path)
from flexmesh.runtime.launch import child_env, run_torchrun  # noqa: E402

# The code these figures depend on (`python -m bench.status` diffs it against each record's commit): it
# runs `flexmesh` commands, so the whole package.
DEPENDS_ON = ("flexmesh", "bench/calibrate.py")

WORLD = 2
RUNS = ("chunked, sliced", "chunked", "chunked, whole", "fixed")


def make_plan(seq_len: int, global_batch: int):
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    s = LayerStrategy.parse("tp1-dp1z0")
    return Plan.uniform(model=MODEL, cluster=f"{WORLD}xA100-80GB", world_size=WORLD, pp=2, pipeline_schedule="1f1b",
                        num_microbatches=4, seq_len=seq_len, global_batch=global_batch,
                        stages=(StagePlan(0, 2, (s, s)), StagePlan(2, 4, (s, s))))


def batches(seq_len: int, global_batch: int, steps: int, vocab: int, seed: int = 0) -> list[list]:
    """``steps`` batches of random tokens, lengths drawn from ProLong's distribution, cut at ``seq_len``."""
    import numpy as np

    from flexmesh.data.lengths import load_lengths

    pool = load_lengths("prolong")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lens = np.clip(rng.choice(pool, global_batch), 8, seq_len)
        out.append([rng.integers(1, vocab, int(n)) for n in lens])
    return out


def schedules(plan, cost, docs_per_step: list[list]) -> dict[str, list]:
    """Per run: the StepSchedule of every batch, its simulated step time and its predicted peak of
    saved activations on the fuller stage (flexmesh.sim.memory)."""
    from dataclasses import replace

    import numpy as np

    from flexmesh.schedule.lower_bound import lower_bound
    from flexmesh.schedule.registry import make_schedule
    from flexmesh.schedule.scheduler import schedule_context
    from flexmesh.sim.memory import stage_activation_peaks
    from flexmesh.sim.predict import simulated_price, step_time_predictor

    ctx = replace(schedule_context(plan, cost.model, plan.seq_len, cost), price=simulated_price())  # as train
    whole = replace(ctx, cut_documents=False)
    predict = step_time_predictor(ctx)
    out: dict[str, list] = {run: [] for run in RUNS}
    for docs in docs_per_step:
        lens = [len(d) for d in docs]
        tau = lower_bound(np.asarray(lens), ctx) / (2 * ctx.pp)  # the policy's first candidate, always cut
        made = (make_schedule("chunked", lens, ctx, chunk_time=tau), make_schedule("chunked", lens, ctx),
                make_schedule("chunked", lens, whole), make_schedule("fixed", lens, whole))
        for run, s in zip(RUNS, made):
            out[run].append((s, predict(s), float(stage_activation_peaks(ctx, s).max())))
    return out


def worker(out: Path, profiles: Path, steps: int, seq_len: int, global_batch: int) -> None:
    import torch
    import torch.distributed as dist

    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.train.config import TrainConfig
    from flexmesh.runtime.train.trainer import Trainer

    torch.set_num_threads(1)
    init_distributed(timeout_s=600)
    plan, cost = make_plan(seq_len, global_batch), cost_model(WORLD, profiles)
    docs = batches(seq_len, global_batch, steps, cost.model.vocab)
    results = {}
    for run, scheds in schedules(plan, cost, docs).items():
        trainer = Trainer(plan, cost.model, TrainConfig(max_steps=steps, progress=False, meter_every=1))
        rows = []
        for d, (s, pred, act) in zip(docs, scheds):
            m = trainer.step(d, s)
            rows.append({"loss": m.loss, "step_time_s": m.step_time_s, "predicted_s": pred, "act_pred": act,
                         "cut": m.cut_documents, "microbatches": m.microbatches,
                         "act": max(m.activation_peak_bytes or (0,))})
        results[run] = rows
        del trainer
        dist.barrier()
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--workdir", help="keep profiles and measurements here (default: a temporary folder)")
    ap.add_argument("--quick", action="store_true", help="3 steps, prints only")
    args = ap.parse_args()
    steps = 3 if args.quick else args.steps

    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 140))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if not (work / f"model_{WORLD}.json").exists():
            profile(WORLD, work, console)
        res = work / "sliced_measured.json"
        console.print(f"training {len(RUNS)} schedules x {steps} steps on a pp 2 pipeline", highlight=False)
        argv = [str(Path(__file__).resolve()), "worker", str(res), str(work), str(steps), str(args.seq_len),
                str(args.global_batch)]
        proc = run_torchrun(WORLD, argv, env=child_env(), capture_output=True, text=True, timeout=3000)
        if proc.returncode != 0:
            raise SystemExit(f"run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        measured = json.loads(res.read_text())

    ref = [r["loss"] for r in measured["fixed"]]
    cols = ("schedule", "cut/step", "mbs/step", "step pred s", "step meas s", "error", "act pred MiB",
            "act meas MiB", "act error", "max loss diff vs fixed")
    table = Table(title=f"{MODEL} (fp32 CPU), pp 2 (1F1B), {args.global_batch} documents of up to {args.seq_len} "
                        f"tokens per step (ProLong lengths), {steps} steps; predicted from this machine's profiles")
    for c in cols:
        table.add_column(c, justify="left" if c == "schedule" else "right", no_wrap=True)
    md_rows = []
    base = None
    for run in RUNS:
        rows = measured[run]
        timed = rows[1:] if len(rows) > 1 else rows
        pred = statistics.median(r["predicted_s"] for r in timed)
        meas = statistics.median(r["step_time_s"] for r in timed)
        base = meas if run == "fixed" else base
        cells = (run, f"{statistics.mean(r['cut'] for r in rows):.1f}",
                 f"{statistics.mean(r['microbatches'] for r in rows):.1f}", f"{pred:.3f}", f"{meas:.3f}",
                 f"{(pred - meas) / meas:+.1%}", f"{max(r['act_pred'] for r in rows) / 2**20:.1f}",
                 f"{max(r['act'] for r in rows) / 2**20:.1f}",
                 f"{statistics.median((r['act_pred'] - r['act']) / r['act'] for r in rows):+.1%}",
                 f"{max(abs(r['loss'] - x) for r, x in zip(rows, ref)):.1e}")
        table.add_row(*cells)
        md_rows.append(cells)
    console.print(table)
    if not args.quick:
        from bench._results import markdown_table, record

        md = [f"The `{MODEL}` model on a pp 2 pipeline (1F1B, 2 layers per stage, fp32, {WORLD} processes), "
              f"{args.global_batch} random-token documents per step with ProLong's lengths cut at {args.seq_len}. "
              f"Profiles: `flexmesh profile hardware --quick` and `flexmesh profile model --model {MODEL} --quick` "
              f"with `--nproc {WORLD}` on this machine ({os.cpu_count()} cores, OMP_NUM_THREADS=1). The same "
              f"{steps} global batches under each schedule; step times are medians after the first step; "
              "predictions are the step simulator's for the schedules that ran; activation peaks are the "
              "largest over steps and ranks, the error the median over steps.", "",
              *markdown_table(cols, md_rows)]
        record("sliced_measured", "\n".join(md), headline="step predicted against measured: " + ", ".join(
            f"{c[0]} {c[5]}" for c in md_rows))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        _, _, out, profiles, steps, seq_len, gb = sys.argv
        worker(Path(out), Path(profiles), int(steps), int(seq_len), int(gb))
    else:
        main()
