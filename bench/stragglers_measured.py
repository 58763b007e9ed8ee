"""A slow rank on this machine, measured: static against re-planned per-step schedules (2 processes).

On this machine: the ``tiny`` model (4 layers, hidden 256, fp32, CPU), 2 processes (gloo,
OMP_NUM_THREADS=1: one process per core), a replicated ZeRO-2 layout over both ranks, ``--steps`` steps
of ``--global-batch`` Python standard-library sources truncated to ``--max-len`` tokens, the
``balanced`` policy (cost-aware longest-processing-time placement, speed-aware) on groups of one rank
(``--cp 1``), schedules priced by full-sweep profiles of this machine (``--quick``: quick sweeps). Rank
1's compute is **emulated** at ``--factor`` of its speed (``flexmesh train --emulate-speed 1=FACTOR``:
each of its forward and backward computations is stretched by a busy wait to 1/FACTOR of its measured
time), in both runs, from the first step:

- ``static``: ``--no-replan``: speeds are measured and the straggler reported, the schedules stay
  as made for nominal speeds;
- ``adaptive``: the default: after a sustained slowdown (flexmesh.runtime.train.stragglers: 2 steps beyond
  the 25% threshold after a 1-step warm-up) the scheduler's speeds are set to the measured ones, when
  the simulator predicts that pays, and the next step's schedule gives the slow rank less work.

Same plan, corpus, tokenizer and seed: the same batches (checked through each step's tokens) and
initial weights. Figures (flexmesh.report.stragglers.comparison_summary): tokens/s of both runs over
the steps from the first one run on a re-planned schedule to the end, steps until recovery (steps
run on the old schedule, warm-up included), and the simulator's predicted step time against the
measured one on those steps of the adaptive run (median |error|), two ways: as the trainer predicts
a step (``paced_step_time_s``: the simulator with every rank at its speed against the profile as
measured on the steps before, flexmesh.runtime.train.stragglers), and with the profile as taken (the
schedule's own prediction, at the relative speeds it was scheduled for), which is off by however
much this shared machine's speed has drifted since profiling. Targets: adaptive >= 1.25x static
after recovery, recovery within 5 steps, the trainer's prediction within 15% of the measured step
time. Records the section "stragglers_measured" of bench/RESULTS.md with the commit and the load average
(not with ``--quick``); the machine is shared, so only figures from a quiet machine count.

    python -m bench.stragglers_measured                  # 12 steps of 16 documents <= 512 tokens, about 2 minutes
                                                     # plus about 6 minutes of profiling
    python -m bench.stragglers_measured --quick          # 6 steps of 8 documents <= 256 tokens; prints only
    python -m bench.stragglers_measured --profiles DIR   # reuse hardware.json and model.json in DIR
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.adaptive import MODEL, machine_profiles  # noqa: E402  (after the path: `python bench/stragglers_measured.py` works)

# The code these figures depend on (`python -m bench.status` diffs it against each record's commit): it
# runs `flexmesh` commands, so the whole package.
DEPENDS_ON = ("flexmesh", "bench/adaptive.py")

NPROC = 2
TARGETS = {"speedup": 1.25, "recovery_steps": 5, "simulator_error": 0.15}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--factor", type=float, default=0.5, help="rank 1's emulated speed (default 0.5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profiles", help="folder holding hardware.json and model.json to reuse instead of profiling")
    ap.add_argument("--keep", metavar="DIR", help="keep the profiles, plan and both runs' metrics.jsonl in DIR")
    ap.add_argument("--no-record", action="store_true", help="print only: leave bench/RESULTS.md alone")
    ap.add_argument("--quick", action="store_true", help="6 steps of 8 documents <= 256 tokens; prints only")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.global_batch, args.max_len = 6, 8, 256

    from rich.console import Console

    from flexmesh.report.runs import training_plan
    from flexmesh.report.stragglers import comparison_summary, run_comparison

    console = Console(width=max(Console().width, 140))
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(args.keep) if args.keep else Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        hw, mp, priced_by = machine_profiles(Path(args.profiles) if args.profiles else tmp, NPROC, args.quick, console)
        plan_path = tmp / "plan.json"
        training_plan(NPROC, args.max_len, args.global_batch, MODEL).save(plan_path)
        flags = ["--policy", "balanced", "--cp", "1", "--hardware-profile", str(hw), "--model-profile", str(mp)]
        metrics = run_comparison(tmp / "runs", plan_path, steps=args.steps, global_batch=args.global_batch,
                                 seq_len=args.max_len, seed=args.seed, slow={1: args.factor}, extra=flags)
        if args.keep:
            from flexmesh.report.stragglers import speed_png

            console.print(f"plot: {speed_png(metrics, tmp / 'speed.png')}", highlight=False)
    d = comparison_summary(metrics)
    report(console, args, d, metrics, load, priced_by)


def report(console, args, d: dict, metrics: dict, load: tuple[float, ...], priced_by: str) -> None:
    from rich.table import Table

    def verdict(ok: bool | None) -> str:
        return "-" if ok is None else ("PASS" if ok else "FAIL")

    recovery = d["steps_until_recovery"]
    err, raw = d["paced_error"], d["predicted_error"]
    checks = [
        ("adaptive / static tokens/s after recovery", f"{d['speedup']:.3f}x", f">= {TARGETS['speedup']}x",
         verdict(d["speedup"] >= TARGETS["speedup"])),
        ("steps until recovery", "never" if recovery is None else str(recovery),
         f"<= {TARGETS['recovery_steps']}", verdict(recovery is not None and recovery <= TARGETS["recovery_steps"])),
        ("simulator vs measured step time, as the trainer predicts it (each rank at its speed measured on the "
         "steps before; median absolute error)", "-" if err is None else f"{err:.1%}",
         f"<= {TARGETS['simulator_error']:.0%}", verdict(None if err is None else err <= TARGETS["simulator_error"])),
        ("the same with the profile as taken (the schedule's own prediction, no pace)",
         "-" if raw is None else f"{raw:.1%}", "-", "-"),
    ]
    cols = ("run", f"tokens/s, steps {d['recovery_step'] or 2}-{args.steps}", "mean step (s)", "predicted step (s)")
    rows = [("static", f"{d['static_tokens_per_s']:,.0f}", f"{d['static_step_s']:.3f}", "-"),
            ("adaptive", f"{d['adaptive_tokens_per_s']:,.0f}", f"{d['adaptive_step_s']:.3f}",
             "-" if d["predicted_step_s"] is None else f"{d['predicted_step_s']:.3f}")]
    table = Table(title=f"{MODEL} on {NPROC} processes, rank 1 emulated at {args.factor:g}x; {args.steps} steps of "
                        f"{args.global_batch} documents <= {args.max_len} tokens")
    for c in cols:
        table.add_column(c, justify="left" if c == "run" else "right")
    for r in rows:
        table.add_row(*r)
    console.print(table)
    check_table = Table(title="targets")
    for c in ("figure", "measured", "target", ""):
        check_table.add_column(c)
    for c in checks:
        check_table.add_row(*c)
    console.print(check_table)
    events = [f"after step {s}: {e['event']} " + ", ".join(f"{k} {e[k]}" for k in ("ranks", "speeds", "predicted_gain")
                                                            if k in e) for s, e in d["events"]]
    per_step = ["step " + str(r["step"]) + ": measured speeds " + str(r["speed"]) + ", scheduled for "
                + str(r["assumed_speed"]) for r in metrics["adaptive"]]
    pace = "-" if d["pace"] is None else f"{d['pace']:.2f}"
    lines = [*events, *per_step,
             f"pace (the fastest rank's profiled work over its measured compute, median over the steps): {pace}; "
             "the schedules' own predictions price the profile as taken, so they are off by about this factor on "
             "every rank (flexmesh.runtime.train.stragglers)",
             f"load average {load[0]:.1f} before the runs, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores); "
             "the machine is shared: re-take these figures on a quiet machine before relying on them",
             "rank 1's slowness is EMULATED (--emulate-speed: busy waits stretching its forwards and backwards), "
             "not a slower device"]
    for line in lines:
        console.print(line, highlight=False)
    if args.quick or args.no_record:
        console.print("nothing recorded (--quick or --no-record)", highlight=False)
        return
    from bench._results import markdown_table, record

    md = [f"`{MODEL}` (4 layers, hidden 256, fp32) on {NPROC} processes of this machine ({os.cpu_count()} cores, gloo, "
          f"OMP_NUM_THREADS=1), replicated ZeRO-2 layout, `balanced` policy on one-rank groups, schedules priced by "
          f"{priced_by}; {args.steps} steps of {args.global_batch} Python standard-library "
          f"sources truncated to {args.max_len} tokens, the same batches and initial weights for both runs. Rank 1 "
          f"is emulated at {args.factor:g}x speed in both (`--emulate-speed 1={args.factor:g}`); `static` runs with "
          "`--no-replan`, `adaptive` re-plans. Throughput over the steps from the first re-planned one to the end.",
          "", *markdown_table(cols, rows), "", *markdown_table(("figure", "measured", "target", ""), checks), "",
          *[f"- {line}" for line in lines]]
    record("stragglers_measured", "\n".join(md), headline=f"{checks[0][0]} {checks[0][1]}, {checks[1][0]} "
           f"{checks[1][1]}")


if __name__ == "__main__":
    main()
