"""``flexmesh serve bench``: a trace window replayed open loop against real engines at given rates, measured TTFT,
TPOT, E2E and per-token latency beside what the simulator predicts for the same requests on this machine's engine
profile (docs/serving-engines.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from flexmesh.commands.args import folder, nonneg_float, nonneg_int, positive_float, positive_int
from flexmesh.commands.engine_args import add_engine_args, add_fleet_args, need_aiohttp
from flexmesh.errors import ServeError
from flexmesh.files import make_folder, write_atomic


def add_parser(kinds) -> argparse.ArgumentParser:
    p = kinds.add_parser("bench", help="replay a trace window against engines at given rates (open loop); measured "
                         "beside predicted",
                         description="Replay a trace window against real engines at each rate, open loop (arrivals "
                                     "on schedule whatever the answers), and report TTFT, TPOT, E2E and per-token "
                                     "latency measured beside what the simulator predicts for the same requests.")
    p.add_argument("--trace", default="azure-conv", help="azure-conv, azure-code, mooncake or a trace file")
    p.add_argument("--rate", required=True, help="requests per second, one or several: 2,4,8")
    p.add_argument("--arrivals", choices=("trace", "poisson"), default="trace",
                   help="the trace's own arrival times scaled to each rate, or Poisson arrivals at it")
    p.add_argument("--start", type=nonneg_float, default=0.0, help="where the window starts in the trace (seconds)")
    p.add_argument("--requests", type=positive_int, default=100, help="requests in the window")
    p.add_argument("--context", type=positive_int,
                   help="scale the trace's lengths to fit this many tokens (default: the model's context)")
    p.add_argument("--branches", metavar="N:M", help="test-time scaling: every request samples N branches and needs "
                   "M (each branch's length drawn from the window's output lengths)")
    p.add_argument("--arrival-seed", type=nonneg_int, default=0, help="seed of Poisson arrivals")
    p.add_argument("--profile", help="this machine's engine profile (flexmesh profile engine --out) pricing the "
                   "prediction (default: fitted to the engines' own iterations at the first rate, by wall time)")
    p.add_argument("--url", help="a running `flexmesh serve run` (default: start the engines here for the bench)")
    p.add_argument("--out", type=folder, help="folder for requests-<rate>.jsonl, iterations and summary.json")
    p.add_argument("--plan", metavar="PLAN", help="start a serving plan's replicas (as serve run --plan)")
    p.add_argument("--map-to-cpu", action="store_true", help="as serve run: a plan's GPUs as CPU engines here")
    add_fleet_args(p)
    add_engine_args(p)
    p.set_defaults(func=bench)
    return p


# The longest one replay may take (its last arrival), and how often a replay says how it goes
MAX_REPLAY_S = 3600.0
PROGRESS_EVERY_S = 10.0


def _rates(text: str) -> list[float]:
    try:
        return [positive_float(x) for x in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise ServeError(f"--rate {text!r}: each rate {e}; e.g. --rate 2,4,8") from None


def _branches(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    n, sep, m = text.partition(":")
    if not (sep and n.isdigit() and m.isdigit() and 1 <= int(m) <= int(n)):
        raise ServeError(f"--branches {text!r} is not N:M with 1 <= M <= N; e.g. --branches 8:2")
    return int(n), int(m)


def bench(args: argparse.Namespace) -> int:
    from flexmesh.commands.serve_run import fleet_model, resolve_fleet, silent_engines
    from flexmesh.data.requests import at_rate, load_trace, scale_to_context, window, with_arrivals, with_branches
    from flexmesh.profile.iteration import load_engine_profile
    from flexmesh.serve.engine.replay import model_card, replay_rates

    need_aiohttp()
    rates = _rates(args.rate)
    branches = _branches(args.branches)
    cfgs, route, opts, notes = resolve_fleet(args)
    if isinstance(cfgs[0], str):  # engines running elsewhere: a replay needs them now
        silent = silent_engines(cfgs)
        if silent:
            raise ServeError(f"no engine answers at {silent[0]}; start it, or fix the URL")
    trace = load_trace(args.trace)
    # refused before any engine starts: a profile that cannot be read, a context that holds no request
    profile = load_engine_profile(args.profile) if args.profile else None
    if args.context:
        scale_to_context(trace, args.context)
    arrivals = args.arrivals if trace.timed else "poisson"  # a trace without arrival times: drawn at each rate
    out = Path(args.out) if args.out else None
    if out is not None:
        make_folder(out)
    for n in notes:
        print(n, file=sys.stderr)
    for note in trace.notes:
        print(f"note: {note}", file=sys.stderr)
    # Refused before any engine starts: a replay that would take longer than MAX_REPLAY_S (a rate of 1e-6)
    first = window(trace, args.start, first=args.requests)
    for r in rates:
        span = (at_rate(first, r) if arrivals == "trace" else with_arrivals(first, r, seed=args.arrival_seed)
                ).requests[-1].arrival_s
        if span > MAX_REPLAY_S:
            raise ServeError(f"at {r:g} req/s the window's {len(first)} requests arrive over {span / 3600:,.1f} h, "
                             f"more than the {MAX_REPLAY_S / 3600:g} h one replay may take; raise --rate or give "
                             "fewer --requests")
    loads: list = []
    told = {"at": time.monotonic()}

    def progress(done: int, total: int) -> None:  # never silent longer than PROGRESS_EVERY_S
        now = time.monotonic()
        if now - told["at"] >= PROGRESS_EVERY_S or done == total:
            told["at"] = now
            print(f"replaying: {done:,} of {total:,} requests answered or failed", file=sys.stderr, flush=True)

    async def main():
        async def replays(url: str, engine_urls: list[str]):
            context = args.context or int((await model_card(url))["max_model_len"])
            win = window(scale_to_context(trace, context), args.start, first=args.requests)
            if branches is not None:
                win = with_branches(win, *branches)
            loads.extend((r, at_rate(win, r) if arrivals == "trace"
                          else with_arrivals(win, r, seed=args.arrival_seed)) for r in rates)
            print(f"{args.trace}: {len(win)} requests from {args.start:g} s, lengths scaled to {context} tokens; "
                  f"rates {', '.join(f'{r:g}' for r in rates)}/s ({arrivals} arrivals)", file=sys.stderr)
            return await replay_rates(url, loads, engine_urls, progress=progress,
                                      request_timeout_s=args.request_timeout)

        if args.url:
            return await replays(args.url.rstrip("/"), [])
        from flexmesh.serve.engine.processes import running_fleet

        logs = out / "logs" if out is not None else Path(tempfile.mkdtemp(prefix="flexmesh-bench-"))
        print(f"fronting {len(cfgs)} engine(s) at {', '.join(cfgs)}" if isinstance(cfgs[0], str) else
              f"starting {len(cfgs)} engine(s) of {fleet_model(cfgs, opts, args)} (logs: {logs}) ...",
              file=sys.stderr, flush=True)
        async with running_fleet(cfgs, len(cfgs), logs, route=route, max_outstanding=args.max_outstanding,
                                 request_timeout_s=args.request_timeout, **opts) as (url, engines):
            return await replays(url, [e.url for e in engines if not e.external])  # vLLM keeps no iteration log

    runs = asyncio.run(main())
    predicted = _predict(args, cfgs, route, opts, runs, loads, profile)
    _report(runs, predicted, out)
    return 0 if all(not r.replay.failed for r in runs) else 1


def _predict(args, cfgs, route, opts, runs, loads, profile=None) -> list | None:  # noqa: ANN001
    """The simulator's summary of each replay (None when no timing is to be had: a --url run without
    ``profile``, --profile's)."""
    from flexmesh.profile.iteration import ProfiledIterationTiming, replay_profile
    from flexmesh.serve.engine.config import EngineConfig
    from flexmesh.serve.engine.twin import twin_fleet
    from flexmesh.serve.metrics import summarize

    kind = "transformers"
    if not all(isinstance(c, EngineConfig) for c in cfgs):  # vLLM / SGLang: the knobs they were started with
        configs = [getattr(c, "config", None) for c in cfgs]
        if profile is None or not all(isinstance(c, EngineConfig) for c in configs):
            return None  # they log no iterations to fit, and a plan's replicas are sized by their engine
        cfgs, kind = configs, cfgs[0].kind
    if profile is not None:
        timing = ProfiledIterationTiming(profile)
    else:
        its = runs[0].iterations if runs else []
        if sum(len(per) for per in its) < 20:
            return None
        timing = ProfiledIterationTiming(replay_profile(its))
    twin = twin_fleet(cfgs, len(cfgs), timing, opts.get("max_running"), engine=kind)
    sim = dict(router=route, queue=opts["queue"], predictor=opts.get("predictor"), weights=opts.get("weights"),
               routing=opts.get("table"), cancel_lag=1)  # the router's cancellations land an iteration later
    return [summarize(twin.run(w, **sim).records) for _, w in loads]


def _report(runs, predicted, out: Path | None) -> None:
    from rich.table import Table

    from flexmesh.console import plain_console
    from flexmesh.serve.metrics import percentiles, summarize

    t = Table(title="measured / predicted, open loop (ms; TPOT excludes the first token; per-token = E2E / "
                    "output tokens)")
    for col in ("rate/s", "done", "failed", "TTFT p50", "p90", "TPOT p50", "p90", "E2E p50", "per-token mean",
                "decode tok", "lag p99"):
        t.add_column(col, justify="right")
    summary = []
    for i, run in enumerate(runs):
        rep = run.replay
        s = summarize(rep.records) if rep.records else None
        p = predicted[i] if predicted else None
        lag = percentiles(rep.send_lag_s)["p99"] if rep.send_lag_s else float("nan")

        def pair(get, digits: int = 0, s=s, p=p) -> str:
            a = f"{get(s) * 1e3:,.{digits}f}" if s is not None else "-"
            return a if p is None else f"{a} / {get(p) * 1e3:,.{digits}f}"

        cells = [pair(lambda x: x.ttft["p50"]), pair(lambda x: x.ttft["p90"]), pair(lambda x: x.tpot["p50"], 1),
                 pair(lambda x: x.tpot["p90"], 1), pair(lambda x: x.e2e["p50"]),
                 pair(lambda x: x.per_token["mean"], 1),
                 (f"{s.decode_tokens:,}" if s else "-") + (f" / {p.decode_tokens:,}" if p else "")]
        t.add_row(f"{run.rate:g}", str(len(rep.records)), str(len(rep.failed)), *cells, f"{lag * 1e3:.0f}")
        summary.append({"rate": run.rate, "summary": s.to_json() if s else None,
                        "predicted": p.to_json() if p else None, "failed": rep.failed, "send_lag_p99_s": lag})
        if out is not None:
            rep.write(out / f"requests-{run.rate:g}.jsonl")
            if run.iterations:
                write_atomic(out / f"iterations-{run.rate:g}.json", json.dumps(run.iterations), root=out)
    con = plain_console()
    con.print(t)
    if predicted is None:
        con.print("predicted: none (give --profile FILE from flexmesh profile engine, of the same engine and knobs)",
                  highlight=False)
    for run in runs:
        for rid, why in list(run.replay.failed.items())[:3]:
            con.print(f"rate {run.rate:g}: request {rid} failed: {why}", highlight=False)
    if out is not None:
        write_atomic(out / "summary.json", json.dumps(summary, indent=1, default=str) + "\n", root=out)
        con.print(f"wrote {out}", highlight=False)
