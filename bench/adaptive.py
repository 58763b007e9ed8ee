"""Adaptive per-step schedules, measured on 2 processes: tokens/s against the best baseline, and the simulator.

On this machine: the ``tiny`` model (4 layers, hidden 256, fp32, CPU), ``--nproc 2`` processes (gloo,
OMP_NUM_THREADS=1, flexmesh.runtime.launch.child_env's default, forced: one process per core), a replicated
ZeRO-2 layout over both ranks, ``--steps`` steps of ``--global-batch`` documents truncated to
``--max-len`` tokens. Every run trains with ``flexmesh train`` on the same batches (same corpus,
tokenizer, seed and loader, checked through each run's tokens per step) from the same initial weights.

Workload: real documents, the Python standard library's sources under the project's BPE of the
model's vocabulary, laid out in a .jsonl corpus so that the trainer's seeded loader deals these
batches: odd steps hold one long document (a file of at least ``--max-len`` tokens, truncated to
it), even steps two, every step short ones (at most ``--max-len`` / 100 tokens, so its longest
document is 100x its shortest or more: printed and asserted) and ``--medium`` documents of 1/16 to
1/2 of ``--max-len`` (default none). One long document leaves a rank idle under a static context-
parallel degree of 1; two fill both ranks, and a static degree of 2 pays its communication for
nothing. How much a per-step choice can gain over the best static degree is what degree 2 costs
beyond degree 1 on two-long-document steps. Measured on this machine when this default was chosen,
that was about 0.15 s a step at both 2048 and 4096 tokens (section adaptive: 0.93-1.02 s at degree 1
against 1.08-1.11 s at degree 2; adaptive-4096: 2.30-2.35 s against 2.45-2.62 s), so it weighs twice
as much in the shorter steps of ``--max-len 2048`` (the default): there the per-step best baseline,
each step at the fastest baseline run's time on it, was 1.13x the best baseline, at 4096 only
1.065x, and the adaptive runs at 4096 measured 1.025-1.051x over three runs. Each run prints that
headroom next to the adaptive runs and records lengths other than the default in their own section
(``adaptive-4096``).

Runs: the baselines (what people run), each swept over its static context-parallel degree (1 and 2
with 2 ranks), its best setting kept: ``fixed`` (best-fit-decreasing packing to the token budget, no
padding), ``balanced`` (cost-aware), ``wlb`` (WLB-LLM packing; the runtime runs it without its
outlier queue: flexmesh.schedule.scheduler.Scheduler passes ``queue=0``). ``padded`` runs only where
``flexmesh train`` offers it (flexmesh.schedule.registry.RUNTIME_POLICIES); otherwise the simulator's
figure for it on the same batches is printed. The adaptive policies choose group sizes per step:
``hdp``, ``milp`` and ``chunked`` (each where ``flexmesh train`` offers it). ``milp`` runs without
``--adaptive``: every step runs its own schedule, computed in the background during the previous step.

Schedules are priced by profiles of this machine (``flexmesh profile hardware|model``, full sweeps, with
the same number of processes; ``--quick`` profiles with the quick sweeps); each step's predicted time is
the step simulator's for the schedule that ran, as the trainer logs it (``predicted_step_time_s``,
docs/metrics.md). Per run: measured tokens/s (the first step left out as warm-up), the speedup over the
best baseline (by measured tokens/s), the predicted speedup over that same baseline run (the simulator's
step times of the same schedules, same steps), the median step-time error, measured imbalance (busy
time, max / mean over ranks), scheduler time and fallbacks; then mean step times by step kind. Targets:
the best adaptive run >= 1.05x the best baseline, and its predicted speedup within 0.05 of the measured
one. Records the section "adaptive" of bench/RESULTS.md with the commit (not with ``--quick``).

Why one process per core: with 4 processes on 2 cores a rank that waits for the others hands its
core to a busy one, so an imbalanced step costs almost nothing and balancing shows no gain. The runs
go one after another, so on a shared machine a change of load between them reads as a speedup: the
load average before and after is recorded; only figures from a quiet machine count. Two runs of the
same schedules differed by up to 6% in tokens/s on this machine, more than the margins judged here,
so every run trains ``--repeats`` times (default 3), in rounds, and each step counts its median.

    python -m bench.adaptive                  # full run: 12 steps of 8 documents <= 2048 tokens, 9 runs
                                              # x 3 repeats; about 8 minutes on 2 quiet cores, plus about
                                              # 6 minutes of model profiling
    python -m bench.adaptive --max-len 4096   # longer documents, less headroom (section adaptive-4096)
    python -m bench.adaptive --quick          # 3 steps of 6 documents <= 1024 tokens, baselines: fixed
                                              # only; prints only
    python -m bench.adaptive --profiles DIR   # reuse hardware.json and model.json in DIR (profiled
                                              # into DIR when missing)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flexmesh.runtime.launch import child_env  # noqa: E402  (after the path: `python bench/adaptive.py` works)

# The code these figures depend on (`python -m bench.status` diffs it against each record's commit): it
# runs `flexmesh` commands, so the whole package.
DEPENDS_ON = ("flexmesh",)

MODEL = "tiny"
MAX_LEN = 2048  # default longest document (tokens); why, in the module text
LONG_PER_STEP = (1, 2)  # long documents per step, cycled: one leaves a rank idle at degree 1, two fill both
HIDES = ("With 4 processes on 2 cores a waiting rank hands its core to a busy one, so imbalance costs almost "
         "nothing there; this bench runs one process per core.")


def flexmesh(argv: list[str]) -> None:
    env = dict(child_env(), OMP_NUM_THREADS="1")  # one intra-op thread: one process per core
    proc = subprocess.run([sys.executable, "-m", "flexmesh", *argv], env=env, capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"flexmesh {' '.join(argv)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def machine_profiles(folder: Path, nproc: int, quick: bool, console) -> tuple[Path, Path, str]:
    """hardware.json and model.json of this machine and MODEL in ``folder``, profiled with ``nproc``
    processes where missing: the full sweeps unless ``quick``. The quick model sweep stops at rows of
    2048 tokens and times each row twice; its fit, stretched to rows of twice that, mispriced them by
    10-15%. The text says which, for the record: reused from ``folder`` or taken by this run."""
    folder.mkdir(parents=True, exist_ok=True)
    hw, mp = folder / "hardware.json", folder / "model.json"
    if hw.is_file() and mp.is_file():
        console.print(f"reusing the profiles in {folder}", highlight=False)
        return hw, mp, f"the profiles reused from {folder}"
    console.print(f"profiling this machine and {MODEL} with {nproc} processes", highlight=False)
    sweep = ["--quick"] if quick else []
    flexmesh(["profile", "hardware", *sweep, "--nproc", str(nproc), "--out", str(hw), "--no-progress"])
    flexmesh(["profile", "model", "--model", MODEL, *sweep, "--nproc", str(nproc), "--out", str(mp), "--no-progress"])
    return hw, mp, f"{'quick' if quick else 'full'}-sweep profiles of this machine taken by this run"


def workload(tmp: Path, steps: int, global_batch: int, max_len: int, seed: int, medium: int = 0
             ) -> tuple[Path, Path, list[np.ndarray], list[int]]:
    """Write the corpus (.jsonl) and tokenizer the runs train with; return them, each step's document
    lengths as the trainer's loader deals them (checked by reading them back), and long documents per step."""
    from flexmesh.data.corpus import stdlib_corpus
    from flexmesh.data.loader import DocumentLoader, load_corpus_tokens
    from flexmesh.spec.model import parse_model

    corpus = stdlib_corpus()
    store, tok = load_corpus_tokens(corpus, vocab_size=parse_model(MODEL).vocab)  # the project's BPE, cached
    texts, lengths = corpus.texts(), store.lengths
    pools = {"long": np.flatnonzero(lengths >= max_len),
             "mid": np.flatnonzero((lengths >= max_len // 16) & (lengths < max_len // 2)),
             "short": np.flatnonzero((lengths >= 2) & (lengths <= max_len // 100))}
    longs = [LONG_PER_STEP[k % len(LONG_PER_STEP)] for k in range(steps)]
    need = {"long": sum(longs), "mid": steps * medium, "short": steps * (global_batch - medium) - sum(longs)}
    if global_batch - medium - max(LONG_PER_STEP) < 1:
        raise SystemExit(f"--global-batch {global_batch} is too small: each step needs up to {max(LONG_PER_STEP)} "
                         f"long, {medium} medium and at least one short document")
    rng = np.random.default_rng(seed)
    drawn = {k: list(rng.choice(pools[k], need[k], replace=need[k] > len(pools[k]))) for k in pools}
    per_step = []
    for k in range(steps):
        docs = [drawn["long"].pop() for _ in range(longs[k])] + [drawn["mid"].pop() for _ in range(medium)]
        docs += [drawn["short"].pop() for _ in range(global_batch - len(docs))]
        per_step.append([int(d) for d in rng.permutation(docs)])
    # Where each step's documents must sit in the corpus: read the loader's order off documents that
    # carry their own index.
    n = steps * global_batch
    order = DocumentLoader([np.full(2, i) for i in range(n)], global_batch=global_batch, max_len=2, seed=seed)
    slot = [0] * n
    for k in range(steps):
        for i, d in zip((int(x[0]) for x in next(order)), per_step[k]):
            slot[i] = d
    jsonl, tok_path = tmp / "corpus.jsonl", tmp / "tokenizer.json"
    jsonl.write_text("".join(json.dumps({"text": texts[d]}) + "\n" for d in slot))
    tok.save(str(tok_path))
    # Read the batches back the way `flexmesh train` will (same tokenizer, loader, seed).
    tokens, _ = load_corpus_tokens(jsonl, tok_path, cache_dir=tmp / "cache")
    loader = DocumentLoader(tokens, global_batch=global_batch, max_len=max_len, seed=seed)
    batches = [np.array([len(d) for d in next(loader)]) for _ in range(steps)]
    for k, b in enumerate(batches):
        want = np.minimum(lengths[per_step[k]], max_len)
        assert sorted(b.tolist()) == sorted(want.tolist()), f"step {k + 1}: loader deals {b}, expected {want}"
    return jsonl, tok_path, batches, longs


def run_table(nproc: int, offered: set[str], quick: bool = False) -> dict[str, tuple[str, list[str]]]:
    """label -> (kind, extra `flexmesh train` flags): every baseline at every static degree, then adaptive
    (with ``quick``, of the baselines only ``fixed``)."""
    degrees = [c for c in (1, 2, 4, 8) if c <= nproc]
    baselines = ("fixed",) if quick else ("fixed", "padded", "balanced", "wlb")
    runs = {f"{p} (cp={c})": ("baseline", ["--policy", p, "--cp", str(c)])
            for p in baselines if p in offered for c in degrees}
    runs.update({p: ("adaptive", ["--policy", p]) for p in ("hdp", "milp", "chunked") if p in offered})
    return runs


def summarise(rows: list[dict]) -> dict:
    """Measured figures (flexmesh.report.demo.run_summary) and the simulator's, first step left out."""
    from flexmesh.report.demo import run_summary

    d = run_summary(rows)
    timed = rows[1:] if len(rows) > 1 else rows
    pred = [r.get("predicted_step_time_s") for r in timed]
    d["predicted_tokens_per_s"] = (sum(r["tokens"] for r in timed) / sum(pred)) if all(pred) else None
    d["predicted_step_time_s"] = float(np.mean(pred)) if all(pred) else None
    d["scheduler_ms"] = 1e3 * float(np.mean([r.get("scheduler_s") or 0.0 for r in timed]))
    d["scheduler_ms_max"] = 1e3 * max(r.get("scheduler_s") or 0.0 for r in rows)
    return d


def median_rows(repeats: list[list[dict]]) -> list[dict]:
    """Per step, the metrics row of the repeat whose step time is the median (the lower middle one
    of an even count): the same schedules, so only the clock differs between repeats."""
    out = []
    for step_rows in zip(*repeats, strict=True):
        ranked = sorted(step_rows, key=lambda r: r["step_time_s"])
        out.append(ranked[(len(ranked) - 1) // 2])
    return out


def simulated_only(policy: str, batches: list[np.ndarray], scheduler_args: tuple, degrees: list[int]) -> tuple:
    """(predicted tokens/s, setting) of a policy `flexmesh train` does not run, simulated on the same batches
    (first step left out) and context as the runs; (None, why) when the simulator cannot schedule it."""
    from flexmesh.errors import FlexmeshError
    from flexmesh.schedule.scheduler import Scheduler
    from flexmesh.sim.compare import run_policy

    plan, spec, max_len, seed, cost = scheduler_args
    ctx = Scheduler(plan, spec, policy, max_len, seed, cost=cost).context
    options = [{"cp": c, "context": max_len} for c in degrees] if policy == "padded" else [{}]
    out = []
    for opt in options:
        try:
            r = run_policy(policy, batches[1:], ctx, seed=seed, options=opt)
        except FlexmeshError as e:
            return None, str(e)
        out.append((r.tokens_per_s, f"cp={opt['cp']}" if "cp" in opt else "its own groups"))
    return max(out, key=lambda x: x[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--nproc", type=int, default=2, help="processes (default 2: one per core of this machine)")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=MAX_LEN)
    ap.add_argument("--medium", type=int, default=0,
                    help="medium documents (1/16 to 1/2 of --max-len) per step besides the long and short ones")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profiles", help="folder holding hardware.json and model.json to reuse instead of profiling")
    ap.add_argument("--keep", metavar="DIR", help="keep the corpus, profiles and every run's metrics.jsonl in DIR")
    ap.add_argument("--repeats", type=int, default=3,
                    help="train every run this many times, in rounds; each step's median counts (default 3)")
    ap.add_argument("--no-record", action="store_true", help="print only: leave bench/RESULTS.md alone")
    ap.add_argument("--quick", action="store_true",
                    help="3 steps of 6 documents of at most 1024 tokens, fixed only, one repeat; prints only")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.global_batch, args.max_len, args.repeats = 3, 6, 1024, 1
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2: the first step is a warm-up")

    from rich.console import Console

    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy
    from flexmesh.schedule.registry import RUNTIME_POLICIES
    from flexmesh.spec.model import parse_model

    console = Console(width=max(Console().width, 150))
    n = args.nproc
    offered = {str(p) for p in RUNTIME_POLICIES}
    runs = run_table(n, offered, args.quick)
    load = os.getloadavg()  # recorded: timings on a shared machine are only as good as its quiet
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(args.keep) if args.keep else Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        corpus, tok, batches, longs = workload(tmp, args.steps, args.global_batch, args.max_len, args.seed,
                                               args.medium)
        ratios = np.array([b.max() / b.min() for b in batches])
        for k, b in enumerate(batches):
            console.print(f"step {k + 1}: {len(b)} documents, {b.sum():,} tokens, longest {b.max()}, shortest "
                          f"{b.min()}, max/min {ratios[k]:.0f}x", highlight=False)
        assert (ratios >= 100).all(), f"every step must hold documents 100x apart; got {ratios}"
        hw, mp, priced_by = machine_profiles(Path(args.profiles) if args.profiles else tmp, n, args.quick, console)
        spec = parse_model(MODEL)
        s = LayerStrategy.parse(f"tp1-dp{n}z2")
        if args.global_batch % n:
            raise SystemExit(f"--global-batch {args.global_batch} must divide by the {n} processes")
        # micro-batches of one --max-len sequence per rank: a budget of --max-len tokens (Plan.microbatch_tokens)
        plan = Plan.uniform(model=MODEL, cluster=f"{n}xcpu", world_size=n, pp=1, pipeline_schedule="1f1b",
                    num_microbatches=args.global_batch // n, seq_len=args.max_len, global_batch=args.global_batch,
                    stages=(StagePlan(0, spec.num_layers, (s,) * spec.num_layers),), cost_source="profile")
        plan_path = tmp / "plan.json"
        plan.save(plan_path)
        repeats: dict[str, list[list[dict]]] = {label: [] for label in runs}
        for k in range(args.repeats):  # rounds: every run once per round, so a change of load hits all alike
            for i, (label, (_, extra)) in enumerate(runs.items()):
                out = tmp / f"run{i}" / f"repeat{k}"
                shutil.rmtree(out, ignore_errors=True)  # a kept folder's earlier run of this bench
                flexmesh(["train", "--plan", str(plan_path), "--corpus", str(corpus), "--tokenizer", str(tok),
                          "--cache-dir", str(tmp / "cache"), "--max-steps", str(args.steps), "--global-batch",
                          str(args.global_batch), "--max-len", str(args.max_len), "--out", str(out), "--nproc",
                          str(n), "--no-resume", "--no-progress", "--seed", str(args.seed), "--hardware-profile",
                          str(hw), "--model-profile", str(mp), *extra])
                rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
                got = [r["tokens"] for r in rows]
                assert got == [int(b.sum()) for b in batches], f"{label} trained other batches: tokens per step {got}"
                repeats[label].append(rows)
                console.print(f"round {k + 1}/{args.repeats}, trained {label}: "
                              f"{summarise(rows)['tokens_per_s']:,.0f} tokens/s", highlight=False)
        metrics = {label: median_rows(rr) for label, rr in repeats.items()}
        from flexmesh.profile.use import cost_model_from_profiles
        from flexmesh.schedule.scheduler import Scheduler

        cost = cost_model_from_profiles(spec, hardware=str(hw), model=str(mp), world=n, cluster=None)
        missing = {p: simulated_only(p, batches, (plan, spec, args.max_len, args.seed, cost),
                                     [c for c in (1, 2, 4, 8) if c <= n])
                   for p in ("padded", "chunked") if p not in offered}
        # The adaptive policies are deterministic: the same Scheduler gives the groups each step ran.
        groups = {label: " | ".join("+".join(str(g.cp) for g in Scheduler(plan, spec, extra[1], args.max_len,
                                                                          args.seed, cost=cost)(b).groups)
                                    for b in batches)
                  for label, (kind, extra) in runs.items() if kind == "adaptive"}
    report(console, args, runs, metrics, longs, ratios, missing, groups, load, priced_by)


def report(console, args, runs: dict, metrics: dict[str, list[dict]], longs: list[int], ratios: np.ndarray,
           missing: dict[str, tuple], groups: dict[str, str], load: tuple[float, ...], priced_by: str) -> None:
    from rich.table import Table

    from flexmesh.report import median_abs_error

    n = args.nproc
    sums = {k: summarise(v) for k, v in metrics.items()}
    kind = {k: v[0] for k, v in runs.items()}
    base = {k: v for k, v in sums.items() if kind[k] == "baseline"}
    best_base = max(base, key=lambda k: base[k]["tokens_per_s"])
    sim_base = max(base, key=lambda k: base[k]["predicted_tokens_per_s"] or 0.0)
    adaptive = {k: v for k, v in sums.items() if kind[k] == "adaptive"}
    best = max(adaptive, key=lambda k: adaptive[k]["tokens_per_s"])
    m0, p0 = sums[best_base]["tokens_per_s"], sums[best_base]["predicted_tokens_per_s"]

    def pred_speedup(d: dict) -> float | None:
        return d["predicted_tokens_per_s"] / p0 if d["predicted_tokens_per_s"] and p0 else None

    cols = ("run", "kind", "tokens/s", "speedup", "predicted speedup", "step s (meas / pred)",
            "median step error", "imbalance", "scheduler ms (mean / max)", "fallbacks")
    table = Table(title=f"{MODEL} on {n} processes ({os.cpu_count()} cores), {args.global_batch} documents <= "
                        f"{args.max_len} tokens per step, {args.steps} steps; speedups over {best_base}")
    for c in cols:
        table.add_column(c, justify="left" if c in ("run", "kind") else "right")
    md_rows = []
    for label, d in sums.items():
        ps = pred_speedup(d)
        cells = (label, kind[label], f"{d['tokens_per_s']:,.0f}", f"{d['tokens_per_s'] / m0:.3f}x",
                 "-" if ps is None else f"{ps:.3f}x",
                 f"{d['step_time_s']:.2f} / " + ("-" if d["predicted_step_time_s"] is None
                                                 else f"{d['predicted_step_time_s']:.2f}"),
                 "-" if d["predicted_error"] is None else f"{d['predicted_error']:.1%}", f"{d['imbalance']:.3f}",
                 f"{d['scheduler_ms']:.1f} / {d['scheduler_ms_max']:.1f}", str(d["fallbacks"]))
        table.add_row(*cells)
        md_rows.append(cells)
    console.print(table)
    by_kind = Table(title="mean step time by step kind, measured / predicted (s); first step left out")
    kinds = sorted(set(longs))
    by_kind.add_column("run")
    for c in kinds:
        count = sum(x == c for x in longs[1:])
        by_kind.add_column(f"{c} long document{'s' * (c > 1)} ({count} step{'s' * (count != 1)})", justify="right")
    kind_rows = []
    for label, rows in metrics.items():
        cells = []
        for c in kinds:
            sel = [r for r, x in zip(rows[1:], longs[1:]) if x == c]
            pred = [r.get("predicted_step_time_s") or float("nan") for r in sel]
            cells.append(f"{np.mean([r['step_time_s'] for r in sel]):.2f} / {np.mean(pred):.2f}" if sel else "-")
        by_kind.add_row(label, *cells)
        kind_rows.append((label, *cells))
    console.print(by_kind)
    ms, ps = sums[best]["tokens_per_s"] / m0, pred_speedup(sums[best])
    pred = [(r["predicted_step_time_s"], r["step_time_s"]) for v in metrics.values() for r in v[1:]
            if r.get("predicted_step_time_s")]
    err = median_abs_error([p for p, _ in pred], [m for _, m in pred])
    close = "-" if ps is None else ("PASS" if abs(ps - ms) <= 0.05 else "FAIL")
    # Headroom: every step at the fastest baseline run's time on it, measured and (separately) predicted.
    steps = [[metrics[k][i] for k in base] for i in range(1, args.steps)]
    tokens = sum(rs[0]["tokens"] for rs in steps)
    head_m = tokens / sum(min(r["step_time_s"] for r in rs) for rs in steps) / m0
    pred_best = sum(min(r.get("predicted_step_time_s") or np.inf for r in rs) for rs in steps)
    head_p = tokens / pred_best / p0 if p0 else np.nan
    lines = [f"best adaptive ({best}) vs the best baseline ({best_base}): measured {ms:.3f}x tokens/s, predicted "
             + ("-" if ps is None else f"{ps:.3f}x") + f"; targets: measured >= 1.05x "
             f"{'PASS' if ms >= 1.05 else 'FAIL'}, |predicted - measured| <= 0.05 {close}",
             f"headroom, the per-step best baseline (each step at the fastest baseline run's time on it): measured "
             f"{head_m:.3f}x the best baseline (predicted {head_p:.3f}x); the best adaptive run reaches "
             f"{ms / head_m:.3f} of it (a minimum over noisy runs: noise favours it)",
             f"the simulator's own best baseline: {sim_base}"
             + ("" if sim_base == best_base else f" (measured best: {best_base})"),
             f"simulator vs measured step time, all runs: median |error| {err:.1%} over {len(pred)} steps",
             f"load average {load[0]:.1f} before the runs, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)",
             f"document lengths per step, max/min: min {ratios.min():.0f}x, median {np.median(ratios):.0f}x "
             "(every step >= 100x)",
             *[f"{label} groups per step (ranks each): {g}" for label, g in groups.items()],
             *[f"{p}: not run, `flexmesh train` does not offer it at this commit; "
               + (f"the simulator cannot schedule it here: {why}" if tput is None or not p0 else
                  f"simulated on the same batches at its best setting ({why}): predicted speedup {tput / p0:.3f}x")
               for p, (tput, why) in missing.items()],
             "wlb runs without its outlier queue (flexmesh.schedule.scheduler.Scheduler passes queue=0: the loader "
             "does not bring held documents back); schedules are computed in the background during the previous "
             "step; milp runs without --adaptive, so every step runs its own schedule",
             HIDES]
    for line in lines:
        console.print(line, highlight=False)
    if args.quick:
        console.print("--quick: balanced and wlb not run (baselines: fixed only); nothing recorded", highlight=False)
    elif not args.no_record:
        from bench._results import markdown_table, record

        md = [f"`{MODEL}` (4 layers, hidden 256, fp32) on {n} processes of this machine ({os.cpu_count()} cores, "
              f"gloo, OMP_NUM_THREADS=1), replicated ZeRO-2 layout; {args.steps} steps of {args.global_batch} Python "
              f"standard-library sources truncated to {args.max_len} tokens: alternately one and two long documents "
              f"per step, {args.medium} medium, the rest short (every step's longest document >= 100x its "
              "shortest); the same batches and initial weights for every run; baselines swept over their static "
              "context-parallel degree, best kept; schedules priced by "
              + priced_by
              + f"; every run trained {args.repeats} times in rounds, each step's median kept; tokens/s "
              f"and predictions leave out the first step. Speedups are over the best baseline by measured tokens/s "
              f"({best_base}); the predicted speedup is the simulator's step times of the same schedules over that "
              "run's.", "",
              *markdown_table(cols, md_rows), "",
              "Mean step time by step kind, measured / predicted (s):", "",
              *markdown_table([c.header for c in by_kind.columns], kind_rows), "",
              *[f"- {line}" for line in lines]]
        name = "adaptive" if args.max_len == MAX_LEN else f"adaptive-{args.max_len}"
        record(name, "\n".join(md), script="adaptive", headline=lines[0].split(";")[0])


if __name__ == "__main__":
    main()
