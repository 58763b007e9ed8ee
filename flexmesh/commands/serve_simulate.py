"""``flexmesh serve simulate``: requests over time on a fleet of replicas, simulated.

Reads a trace (a shipped one, a file of one's own, or constant lengths), places replicas (tp x pp, role) on
the cluster's device groups, and simulates every request through routing, queueing, continuous batching
with chunked prefill, KV admission and preemption, prefix caching and prefill/decode hand-offs; prints
TTFT, TPOT (first token excluded) and E2E percentiles, SLO attainment, throughput and cost, per rate with
--rates, and the goodput with --goodput. See docs/cli-serve.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from flexmesh.commands.args import (
    DEFAULT_CLUSTER,
    DefaultsHelpFormatter,
    folder,
    fraction,
    nonempty,
    nonneg_int,
    positive_float,
    positive_fraction,
    positive_int,
)
from flexmesh.console import plain_console
from flexmesh.cost.device.hardware import unmeasured_notes
from flexmesh.cost.inference.band import ENDS, bands_label
from flexmesh.cost.inference.overhead import EngineOverhead, parse_overhead
from flexmesh.data.requests import Workload, at_rate, constant_lengths, load_trace, scale_to_context, window
from flexmesh.data.requests import with_arrivals as synthetic
from flexmesh.errors import SpecError
from flexmesh.files import make_folder, write_atomic
from flexmesh.serve.layout.engine import engine_spec
from flexmesh.serve.layout.engine import presets as engine_presets
from flexmesh.serve.layout.plan import ServingPlan, load_plan
from flexmesh.serve.layout.replicas import auto_replicas, parse_replicas, place
from flexmesh.serve.layout.routing import RoutingTable
from flexmesh.serve.layout.slo import SLO, doubts, parse_slo
from flexmesh.serve.lengths import PREDICTORS, LengthPredictor, make_predictor
from flexmesh.serve.metrics import Goodput, Summary, summarize, write_records
from flexmesh.serve.plan.check import check_plan
from flexmesh.serve.plan.score import plan_workload
from flexmesh.serve.queues import QUEUES
from flexmesh.serve.router import ROUTERS
from flexmesh.serve.simulator import Fleet, RunOptions, SimResult
from flexmesh.serve.study import RatePoint, find_goodput, fleet_price, sweep
from flexmesh.spec.cluster import MixedCluster, parse_mixed_cluster
from flexmesh.spec.model import ModelSpec, parse_model
from flexmesh.spec.prices import gpu_prices, parse_price_overrides

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

# Llama-3.1-8B: the shapes of `plan`'s default model (Llama-3-8B) with a context of 131,072 tokens, which every
# request of the shipped traces fits.
SERVE_MODEL = "llama3.1-8b"
# The most requests one run simulates (a bound on the work a typo can ask for).
MAX_REQUESTS = 10_000_000
# Runs of more requests than this in all are announced, with a progress bar on a terminal (about a minute of work
# on a busy core: bench/RESULTS.md serve_sim).
LONG_RUN_REQUESTS = 100_000
# A run's progress: a bar on a terminal once it has run this long, a line this often elsewhere
BAR_AFTER_S, PROGRESS_EVERY_S = 2.0, 10.0
# The most runs a goodput search makes: its start, up to 12 doublings or halvings, then about 6 bisections to 2%.
GOODPUT_RUNS = 19
ARRIVALS = ("trace", "poisson", "gamma")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("simulate", help="simulate requests over time on a fleet of replicas",
                       description=__doc__.split("\n\n")[1], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", type=nonempty,
                   help=f"model preset, gpt:L:H:A, or a Hugging Face config.json (default: {SERVE_MODEL})")
    p.add_argument("--cluster", type=nonempty, help="NODESxPERNODExDEVICE, groups joined by '+' "
                   f"(1x8xH100+2x8xA100-40GB), or a cluster file (default: {DEFAULT_CLUSTER})")
    p.add_argument("--plan", metavar="PLAN", help="simulate a serving plan file (flexmesh serve plan --out): its "
                   "models, cluster, replicas, engine knobs and routing; its workload, SLO and rate unless given")
    p.add_argument("--replicas", help="[COUNTx]tpT[ppP][-ROLE][@GROUP],... e.g. 4xtp2 or 2xtp4-prefill@H100,"
                   "4xtp2-decode@A100-40GB (roles aggregated, prefill, decode; default: every group filled with "
                   "aggregated replicas of the smallest tp whose KV cache holds the longest request)")
    w = p.add_argument_group("workload")
    w.add_argument("--trace", help="azure-conv, azure-code, mooncake, a CSV/JSONL file (docs/traces.md), or "
                   "const:PROMPT:OUTPUT (constant lengths, synthetic arrivals) (default: azure-conv, or the plan's)")
    w.add_argument("--block-tokens", type=positive_int, default=0, metavar="N",
                   help="tokens per prefix block id of a plain trace with prefix_blocks")
    w.add_argument("--window", metavar="START:END", help="only the requests arriving in [START, END) seconds")
    w.add_argument("--requests", type=positive_int, metavar="N", help="at most N requests (synthetic arrivals: "
                   "exactly N, the trace's lengths cycled)")
    w.add_argument("--arrivals", choices=ARRIVALS, help="the trace's own arrival times (scaled to --rate), or "
                   "synthetic Poisson or gamma-burst arrivals at --rate (default: trace; const: poisson)")
    w.add_argument("--rate", type=positive_float, metavar="REQ_PER_S",
                   help="mean request rate (default: the trace's own)")
    w.add_argument("--burstiness", type=positive_float, default=0.5, help="gamma arrivals' shape (1: Poisson; "
                   "below 1: burstier)")
    w.add_argument("--seed", type=nonneg_int, default=0, help="seed of synthetic arrivals")
    w.add_argument("--fit-context", action="store_true",
                   help="scale every request's lengths by one factor so the longest fits the model's context")
    e = p.add_argument_group("engine (default: current vLLM's, its knobs for each device)")
    e.add_argument("--engine", metavar="NAME|FILE", help="the engine the replicas run: a preset (" +
                   ", ".join(engine_presets()) + ") or a .toml/.json description (docs/engines.md) "
                   "(default: vllm, or the plan's)")
    e.add_argument("--max-seqs", type=positive_int, help="requests in a batch at most (vLLM max_num_seqs)")
    e.add_argument("--max-batched-tokens", type=positive_int,
                   help="tokens an iteration computes at most (vLLM max_num_batched_tokens)")
    e.add_argument("--kv-block-tokens", type=positive_int, help="tokens per KV block (vLLM block_size; 16)")
    e.add_argument("--memory-fraction", type=fraction, help="device memory the engine may use (vLLM "
                   "gpu_memory_utilization; 0.9)")
    e.add_argument("--kv-blocks", type=positive_int, metavar="N", help="KV blocks per replica as given (vLLM "
                   "num_gpu_blocks_override; default: what the memory fraction leaves)")
    e.add_argument("--no-prefix-cache", action="store_true", help="no prefix caching")
    e.add_argument("--prefix-cache-blocks", type=nonneg_int, metavar="N",
                   help="idle cached KV blocks kept at most (default: as KV memory allows)")
    e.add_argument("--engine-overhead", metavar="PRESET|MS[,MS]", help="per-iteration engine overhead in place of "
                   "the engine's: a preset or FIXED_MS[,PER_REQUEST_MS]")
    r = p.add_argument_group("routing")
    r.add_argument("--router", choices=ROUTERS, help="how requests are spread over replicas (default: round-robin; a "
                   "plan's own, by length bucket, with --plan)")
    r.add_argument("--weights", help="the weights router's weights, one per replica taking new requests (2,1,1)")
    r.add_argument("--queue", choices=QUEUES, default="fcfs", help="each replica's queue policy: first come first "
                   "served, shortest (predicted) job first, or TIE's expected length + tail")
    r.add_argument("--predictor", choices=PREDICTORS, default="oracle",
                   help="output lengths the sjf and tie queues and the long-to-kv router read: the trace's own, the "
                   "trace's with log-normal noise, or a model on prompt lengths fitted to the rest of the trace")
    r.add_argument("--predictor-noise", type=positive_float, default=0.5, metavar="SIGMA",
                   help="the noisy predictor's error (standard deviation of its log-length)")
    s = p.add_argument_group("SLOs, rates, cost")
    s.add_argument("--slo", help="bounds every request should meet: ttft=TIME,tpot=TIME,e2e=TIME (s or ms) "
                   "(default: none, or the plan's)")
    s.add_argument("--attainment", type=positive_fraction,
                   help="fraction of requests that must meet the SLO (goodput's target; default: 0.9, or the plan's)")
    s.add_argument("--rates", help="also simulate at these rates (req/s, comma-separated): the knee")
    s.add_argument("--goodput", action="store_true", help="find the highest rate meeting --slo at --attainment "
                   "(bisection)")
    s.add_argument("--prices", metavar="FILE", help="GPU prices (TOML/JSON, as flexmesh/spec/presets/prices.toml)")
    s.add_argument("--price", metavar="DEVICE=USD,...", help="GPU prices per GPU-hour, overriding the presets")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print JSON instead of tables")
    o.add_argument("--out", type=folder, metavar="DIR", help="write requests.jsonl, summary.json and plots here")
    p.set_defaults(func=run)
    return p


@dataclass(frozen=True)
class SimulateJob:
    """The command line resolved: everything a simulation needs, checked."""

    model: ModelSpec
    cluster: MixedCluster
    fleet: Fleet
    workload: Workload  # at the main rate
    workload_at: Callable[[float], Workload]
    rate: float
    rates: tuple[float, ...]
    slo: SLO | None
    target: float
    goodput: bool
    router: str
    weights: tuple[float, ...] | None
    queue: str
    dollars_per_hour: float | None
    price_note: str
    overhead: EngineOverhead
    routing: RoutingTable | None = None  # the plan router's table (--plan)
    predictor: LengthPredictor | None = None  # for length-aware queues and routers


def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or not all(v > 0 and math.isfinite(v) for v in values):
        raise SpecError(f"{what} {text!r} is not a comma-separated list of positive numbers (e.g. 2,4,8)")
    return values


def _workload(args: argparse.Namespace, model: ModelSpec) -> tuple[Workload, Callable[[float], Workload], float]:
    """The base workload, the workload at a rate, and the main rate."""
    const = args.trace.startswith("const:")
    if const:
        parts = args.trace.split(":")
        if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts[1:]):
            raise SpecError(f"trace {args.trace!r} is not const:PROMPT:OUTPUT (whole numbers of tokens, e.g. "
                            "const:1000:200)")
        base = constant_lengths(int(parts[1]), int(parts[2]))
    else:
        base = load_trace(args.trace, args.block_tokens)
        for note in base.notes:
            print(f"note: {note}", file=sys.stderr)
    if args.window:
        start, sep, end = args.window.partition(":")
        try:
            lo, hi = float(start or 0), float(end) if end else math.inf
        except ValueError:
            sep = ""
        if not sep:
            raise SpecError(f"--window {args.window!r} is not START:END in seconds (e.g. 0:600)")
        base = window(base, lo, hi)
    if args.fit_context:
        base = scale_to_context(base, model.max_position)
    untimed = const or not base.timed
    arrivals = args.arrivals or ("poisson" if untimed else "trace")
    if arrivals == "trace":
        if untimed:
            what = "constant lengths have" if const else f"the trace {base.name!r} has"
            raise SpecError(f"{what} no arrival times of their own; give --arrivals poisson or gamma and --rate")
        if args.requests:
            base = window(base, first=args.requests)
        rate = args.rate or base.rate
        if not rate > 0:
            raise SpecError(f"the trace {base.name!r} has no arrival rate (one request, or all at once); give "
                            "--arrivals poisson and --rate")
        return base, (lambda r: at_rate(base, r)), rate
    n = args.requests or len(base)
    if n > MAX_REQUESTS:
        raise SpecError(f"--requests {n:,} is more than the {MAX_REQUESTS:,} one run simulates")
    rate = args.rate or base.rate
    if not rate > 0:
        raise SpecError("synthetic arrivals need a rate: give --rate REQ_PER_S" + (
            "" if const or base.timed else f" (the trace {base.name!r} has no arrival times)"))
    shape = 1.0 if arrivals == "poisson" else args.burstiness
    return base, (lambda r: synthetic(base, r, args.seed, shape, n)), rate


def _from_plan(args: argparse.Namespace) -> ServingPlan:
    """The plan of --plan, checked; the flags it answers filled in from it where not given."""
    if args.model or args.cluster or args.replicas:
        raise SpecError("--plan gives the models, the cluster and the replicas; drop --model, --cluster and --replicas")
    plan = load_plan(args.plan)
    check_plan(plan)
    w = plan.workload
    if args.trace is None:
        if "buckets" in w:
            raise SpecError(f"{args.plan} was planned on length buckets, not a trace; give --trace")
        args.trace = w.get("trace") or "azure-conv"
        args.window = args.window or w.get("window")
        args.requests = args.requests or w.get("requests")
        args.fit_context = args.fit_context or bool(w.get("fit_context"))
    if args.rate is None:
        args.rate = plan.predicted.get("goodput") or plan.predicted.get("rate") or None
    return plan


def resolve(args: argparse.Namespace) -> SimulateJob:
    """The job the flags describe (one-line errors for what cannot be)."""
    plan = _from_plan(args) if args.plan else None
    args.trace = args.trace or "azure-conv"
    model = plan.model_specs()[0] if plan is not None else parse_model(args.model or SERVE_MODEL)
    cluster = plan.mixed_cluster() if plan is not None else parse_mixed_cluster(args.cluster or DEFAULT_CLUSTER)
    base, workload_at, rate = _workload(args, model)
    if plan is not None:
        workload_at = plan_workload(plan, workload_at)
    workload = workload_at(rate) if (args.rate or args.arrivals not in (None, "trace") or plan is not None) else base
    if len(workload) > MAX_REQUESTS:
        raise SpecError(f"{len(workload):,} requests are more than the {MAX_REQUESTS:,} one run simulates; "
                        "give --window or --requests")
    overhead = parse_overhead(args.engine_overhead) if args.engine_overhead else None
    routing = None
    if plan is not None:
        if args.engine:
            plan = replace(plan, engine=engine_spec(args.engine))
        fleet, routing = Fleet.from_plan(plan, overhead)
    else:
        engine = engine_spec(args.engine)
        knobs = {g: engine.knobs(c.device, model.max_position, max_seqs=args.max_seqs,
                                 max_batched_tokens=args.max_batched_tokens, block_tokens=args.kv_block_tokens,
                                 memory_fraction=args.memory_fraction,
                                 prefix_caching=False if args.no_prefix_cache else None,
                                 prefix_cache_blocks=args.prefix_cache_blocks, kv_blocks=args.kv_blocks)
                 for g, c in enumerate(cluster.groups)}
        specs = (parse_replicas(args.replicas, cluster) if args.replicas
                 else auto_replicas(model, cluster, knobs, workload.max_total_tokens))
        fleet = Fleet(model, cluster, place(specs, cluster), knobs, overhead, engine=engine)
    router = args.router or ("plan" if plan is not None else "round-robin")
    if router == "plan" and routing is None:
        raise SpecError("--router plan routes by a serving plan's buckets; give --plan PLAN")
    slo = parse_slo(args.slo) if args.slo else (plan.slo if plan is not None else None)
    for doubt in doubts(slo) if slo is not None else ():
        print(f"note: {doubt}", file=sys.stderr)
    target = args.attainment if args.attainment is not None else (plan.attainment if plan is not None else 0.9)
    if args.goodput and slo is None:
        raise SpecError("--goodput needs --slo (e.g. --slo ttft=2s,tpot=100ms)")
    weights = _floats(args.weights, "--weights") if args.weights else None
    if router == "weights" and weights is None:
        raise SpecError("--router weights needs --weights, one per replica taking new requests (e.g. 2,1,1)")
    if weights is not None and router != "weights":
        raise SpecError(f"--weights weighs the weights router; the router here is {router}: add --router weights, or "
                        "drop --weights")
    overrides = {**(plan.prices if plan is not None else {}),
                 **(parse_price_overrides(args.price) if args.price else {})}
    prices = gpu_prices(args.prices, overrides or None)
    if plan is not None:  # the plan's own prices say where they came from
        given = parse_price_overrides(args.price) if args.price else {}
        prices.update({d: replace(prices[d], source=f"as {args.plan} gives it") for d in plan.prices if d not in given})
    usd, missing = fleet_price(fleet.gpus, prices)
    note = (f"no price for {', '.join(missing)} (give --price DEVICE=USD)" if missing else
            "; ".join(f"{d}: ${prices[d].usd_per_hour:.4g}/GPU-h ({prices[d].source})" for d in fleet.gpus))
    rates = _floats(args.rates, "--rates") if args.rates else ()
    fleet.check(workload, routing if router == "plan" else None)
    predictor = None
    if args.queue != "fcfs" or router == "long-to-kv":
        ids = {r.id for r in workload.requests}
        rest = Workload(tuple(r for r in base.requests if r.id not in ids) or base.requests, base.name)
        predictor = make_predictor(args.predictor, rest, args.predictor_noise)
    return SimulateJob(model, cluster, fleet, workload, workload_at, rate, rates, slo, target, args.goodput,
                       router, weights, args.queue, usd, note, fleet.engine.overhead, routing, predictor)


def run(args: argparse.Namespace) -> int:
    job = resolve(args)
    console = plain_console(stderr=True)
    runs = 1 + len(ENDS) + len(job.rates) + (GOODPUT_RUNS if job.goodput else 0)
    total = len(job.workload) * runs
    if total >= LONG_RUN_REQUESTS:
        console.print(f"simulating {len(job.workload):,} requests x {runs if not job.goodput else f'up to {runs}'} "
                      f"runs; progress below" if console.is_terminal else
                      f"simulating {len(job.workload):,} requests x {'up to ' if job.goodput else ''}{runs} runs")
    opts = RunOptions(router=job.router, weights=job.weights, queue=job.queue, routing=job.routing,
                      predictor=job.predictor)
    with _progress(console, total >= LONG_RUN_REQUESTS) as tick:
        main = job.fleet.run(job.workload, opts, tick)
        band = {end: summarize(job.fleet.at_band(end).run(job.workload, opts, tick).records, job.slo,
                               job.dollars_per_hour) for end in ENDS}
        points = [RatePoint(job.rate, summarize(main.records, job.slo, job.dollars_per_hour))]
        points += [pt for pt, _ in sweep(job.fleet, job.workload_at, job.rates, job.slo, job.dollars_per_hour, tick,
                                         opts)]
        good: Goodput | None = None
        if job.goodput:
            assert job.slo is not None
            good, tried = find_goodput(job.fleet, job.workload_at, job.slo, job.target, job.rate,
                                       job.dollars_per_hour, tick, options=opts)
            points += tried
    first: dict[float, RatePoint] = {}  # a rate run twice (the goodput search starts at the main rate): its first run
    for p in points:
        first.setdefault(p.rate, p)
    points = list(first.values())
    doc = _document(job, main, points, good, band)
    if args.out:
        _write(Path(args.out), job, main, points, good, doc)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print(plain_console(), job, main, points, good, band)
    return 0


class _progress:
    """Progress over simulated requests, for any run that takes long: on a terminal a bar once it has run
    :data:`BAR_AFTER_S` (every long run, a big workload's from the start); elsewhere a line every
    :data:`PROGRESS_EVERY_S`, so no run is silent longer than that (a budget of a few tokens makes a small
    workload long)."""

    def __init__(self, console: Console, show: bool):
        self.console, self.terminal, self.eager = console, console.is_terminal, show
        self.bar: Any = None  # a rich Progress, once shown
        self.started = self.said = self.run_started = time.monotonic()
        self.done = 0

    def __enter__(self) -> Callable[[int, int], None]:
        def tick(done: int, total: int) -> None:
            now = time.monotonic()
            if self.terminal:
                if self.bar is None and (self.eager or now - self.started >= BAR_AFTER_S):
                    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

                    self.bar = Progress("{task.description}", BarColumn(), MofNCompleteColumn(),
                                        TimeRemainingColumn(), console=self.console, transient=True)
                    self.bar.__enter__()
                    self.task = self.bar.add_task("requests", total=None)
                if self.bar is not None:
                    self.bar.update(self.task, completed=done, total=total)
            else:
                if done < self.done:  # the next run (a rate sweep, the goodput search) began
                    self.run_started = now
                self.done = done
                if now - self.said >= PROGRESS_EVERY_S:
                    self.said = now
                    took = now - self.run_started
                    left = f", about {took * (total - done) / done:.0f} s left in it" if 0 < done < total else ""
                    self.console.print(f"simulating: {done:,} of {total:,} requests of this run done{left}; "
                                       f"{now - self.started:.0f} s so far", highlight=False)

        return tick

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


def _summary_json(s: Summary) -> dict:
    return {k: v for k, v in s.to_json().items() if k != "extra"}


def _unmeasured(job: SimulateJob) -> list[str]:
    """What the simulation prices from another part's measurements or none: kernels, tensor-parallel all-reduces."""
    return unmeasured_notes((g.device for g in job.cluster.groups), ((r.device, r.spec.tp) for r in job.fleet.replicas),
                            job.fleet.engine.all_reduce)


def _document(job: SimulateJob, main: SimResult, points: list[RatePoint], good: Goodput | None,
              band: dict[str, Summary]) -> dict:
    g = good
    return {
        "model": job.model.name, "models": [m.name for m in job.fleet.models], "cluster": job.cluster.label,
        "workload": {"name": job.workload.name, "requests": len(job.workload), "rate": job.rate,
                     "source": job.workload.source},
        "engine": job.fleet.engine.to_dict(),
        "engine_overhead": {"fixed_s": job.overhead.fixed_s, "per_request_s": job.overhead.per_request_s,
                            "source": job.overhead.source},
        "unmeasured": _unmeasured(job),
        "band": {"parts": {d: b.to_dict() for d, b in job.fleet.bands().items()},
                 **{end: _summary_json(s) for end, s in band.items()}},
        "replicas": [{"index": r.index, "replica": r.label, "device": r.device, "group": r.group, "role": r.role,
                      "kv_blocks": r.kv_blocks, "kv_tokens": r.kv_tokens, "kv_capacity": r.kv_explain,
                      "iterations": r.iterations, "busy_fraction": r.busy_fraction, "preemptions": r.preemptions,
                      "prefix_hit_rate": r.prefix_hit_rate} for r in main.replicas],
        "gpus": main.gpus, "dollars_per_hour": job.dollars_per_hour, "prices": job.price_note,
        "runs": [{"rate": p.rate, **_summary_json(p.summary)} for p in points],
        "goodput": None if g is None else {"rate": g.rate, "target": g.target, "bounded": g.bounded,
                                           "slo": str(job.slo), "points": [list(x) for x in g.points]},
        "simulator": {"events": main.events, "wall_s": main.wall_s}, "notes": list(main.notes),
    }


def _write(out: Path, job: SimulateJob, main: SimResult, points: list[RatePoint], good: Goodput | None,
           doc: dict) -> None:
    from flexmesh.report.serving import knee_png, timeline_png  # matplotlib: imported where it plots

    make_folder(out)
    write_records(out / "requests.jsonl", main.records)
    write_atomic(out / "summary.json", json.dumps(doc, indent=1) + "\n")
    title = f"{job.model.name} on {job.cluster.label}, {job.workload.name}"
    timeline_png(main.replicas, out / "timeline.png", title=title)
    if len({p.rate for p in points}) > 1:
        knee_png([(p.rate, p.summary) for p in points], out / "knee.png", job.target if job.slo else None,
                 good.rate if good is not None and good.rate > 0 else None, title)


def _ms(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x * 1e3:,.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def _band_line(job: SimulateJob, band: dict[str, Summary]) -> str:
    """The main run's figures at the fast and slow ends of its parts' price bands (docs/serving.md)."""
    lo, hi = band["low"], band["high"]
    met = f"SLO met {hi.attainment:.1%} to {lo.attainment:.1%}, " if job.slo is not None else ""
    return (f"price band ({bands_label(job.fleet.bands())}): {met}TTFT p50 {_ms(lo.ttft['p50'])} to "
            f"{_ms(hi.ttft['p50'])} ms, TPOT p50 {_ms(lo.tpot['p50'])} to {_ms(hi.tpot['p50'])} ms")


def _print(console: Console, job: SimulateJob, main: SimResult, points: list[RatePoint], good: Goodput | None,
           band: dict[str, Summary]) -> None:
    console.print(f"{', '.join(m.name for m in job.fleet.models)} on {job.cluster.label}; {job.workload.name} "
                  f"({len(job.workload):,} requests); "
                  f"router {job.router}, queue {job.queue}")
    console.print(f"engine {job.fleet.engine.label()}; overhead {job.overhead.fixed_s * 1e3:.3g} ms + "
                  f"{job.overhead.per_request_s * 1e3:.3g} ms per request ({job.overhead.source})")
    for note in _unmeasured(job):
        console.print(f"note: {note}")
    t = Table(title="replicas", title_justify="left")
    for c in ("#", "replica", "device", "KV tokens", "busy", "iterations", "preempted", "prefix hit"):
        t.add_column(c, justify="left" if c in ("replica", "device") else "right")
    for r in main.replicas:
        t.add_row(str(r.index), r.label, r.device, f"{r.kv_tokens:,}", f"{r.busy_fraction:.0%}", f"{r.iterations:,}",
                  str(r.preemptions), "-" if r.prefix_hit_rate is None else f"{r.prefix_hit_rate:.1%}")
    console.print(t)
    t = Table(title="requests (TPOT excludes the first token)", title_justify="left")
    cols = ["req/s", "TTFT ms p50/p90/p99", "TPOT ms p50/p90/p99", "E2E s p50/p99", "out tok/s"]
    cols += ["SLO met"] if job.slo is not None else []
    for c in cols + ["$/M out", "$/M tok"]:
        t.add_column(c, justify="right", overflow="fold")  # a narrow terminal folds a cell, never cuts it
    for p in sorted(points, key=lambda x: x.rate):
        s = p.summary
        row = [f"{p.rate:.3g}", " / ".join(_ms(s.ttft[q]) for q in ("p50", "p90", "p99")),
               " / ".join(_ms(s.tpot[q]) for q in ("p50", "p90", "p99")), f"{s.e2e['p50']:.2f} / {s.e2e['p99']:.2f}",
               f"{s.output_tokens_per_s:,.0f}"]
        if job.slo is not None:
            row.append(f"{s.attainment:.1%}")
        row += ["-" if s.dollars_per_m_output is None else f"{s.dollars_per_m_output:.3g}",
                "-" if s.dollars_per_m_tokens is None else f"{s.dollars_per_m_tokens:.3g}"]
        t.add_row(*row)
    console.print(t)
    console.print(_band_line(job, band))
    usd = "-" if job.dollars_per_hour is None else f"${job.dollars_per_hour:,.2f}/h"
    console.print(f"fleet: {', '.join(f'{n} {d}' for d, n in main.gpus.items())}, {usd}; {job.price_note}")
    if job.slo is not None:
        console.print(f"SLO: {job.slo}, attainment target {job.target:.0%}")
    if good is not None:
        bound = "" if good.bounded else " (every rate tried met it: at least this)"
        console.print(f"goodput: {good.rate:.4g} req/s{bound}, {len(good.points)} rates simulated")
    for note in main.notes:
        console.print(f"note: {note}")
    console.print(f"simulated {len(main.records):,} requests in {main.wall_s:.2f} s "
                  f"({len(main.records) / max(main.wall_s, 1e-9) * 60:,.0f} requests a minute)")

