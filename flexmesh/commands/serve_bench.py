"""``flexmesh serve bench``: a trace window replayed open loop against real engines at given rates, measured
TTFT, TPOT and E2E percentiles (docs/serving-engines.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from flexmesh.commands.args import folder, nonneg_float, nonneg_int, positive_float, positive_int
from flexmesh.commands.engine_args import add_engine_args, add_fleet_args, engine_config, need_aiohttp
from flexmesh.errors import ServeError
from flexmesh.files import make_folder, write_atomic


def add_parser(kinds) -> argparse.ArgumentParser:
    p = kinds.add_parser("bench", help="replay a trace window against engines at given rates (open loop)",
                         description="Replay a trace window against real engines at each rate, open loop (arrivals "
                                     "on schedule whatever the answers), and report TTFT, TPOT and E2E percentiles.")
    p.add_argument("--trace", default="azure-conv", help="azure-conv, azure-code, mooncake or a trace file")
    p.add_argument("--rate", required=True, help="requests per second, one or several: 2,4,8")
    p.add_argument("--arrivals", choices=("trace", "poisson"), default="trace",
                   help="the trace's own arrival times scaled to each rate, or Poisson arrivals at it")
    p.add_argument("--start", type=nonneg_float, default=0.0, help="where the window starts in the trace (seconds)")
    p.add_argument("--requests", type=positive_int, default=100, help="requests in the window")
    p.add_argument("--context", type=positive_int,
                   help="scale the trace's lengths to fit this many tokens (default: the model's context)")
    p.add_argument("--arrival-seed", type=nonneg_int, default=0, help="seed of Poisson arrivals")
    p.add_argument("--url", help="a running `flexmesh serve run` (default: start --engines here for the bench)")
    p.add_argument("--out", type=folder, help="folder for requests-<rate>.jsonl, iterations and summary.json")
    add_fleet_args(p, engines_default=2)
    add_engine_args(p)
    p.set_defaults(func=bench)
    return p


def _rates(text: str) -> list[float]:
    try:
        return [positive_float(x) for x in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise ServeError(f"--rate {text!r}: each rate {e}; e.g. --rate 2,4,8") from None


def bench(args: argparse.Namespace) -> int:
    from flexmesh.data.requests import at_rate, load_trace, scale_to_context, window, with_arrivals
    from flexmesh.serve.engine.replay import model_card, replay_rates

    need_aiohttp()
    rates = _rates(args.rate)
    cfg = engine_config(args)
    trace = load_trace(args.trace)
    out = Path(args.out) if args.out else None
    if out is not None:
        make_folder(out)

    async def main():
        async def replays(url: str, engine_urls: list[str]):
            context = args.context or int((await model_card(url))["max_model_len"])
            win = window(scale_to_context(trace, context), args.start, first=args.requests)
            loads = [(r, at_rate(win, r) if args.arrivals == "trace" else with_arrivals(win, r, seed=args.arrival_seed))
                     for r in rates]
            print(f"{args.trace}: {len(win)} requests from {args.start:g} s, lengths scaled to {context} tokens; "
                  f"rates {', '.join(f'{r:g}' for r in rates)}/s ({args.arrivals} arrivals)", file=sys.stderr)
            return await replay_rates(url, loads, engine_urls, request_timeout_s=args.request_timeout)

        if args.url:
            return await replays(args.url.rstrip("/"), [])
        from flexmesh.serve.engine.fleet import running_fleet

        logs = out / "logs" if out is not None else Path(tempfile.mkdtemp(prefix="flexmesh-bench-"))
        print(f"starting {args.engines} engine(s) of {cfg.model} (logs: {logs}) ...", file=sys.stderr, flush=True)
        async with running_fleet(cfg, args.engines, logs, route=args.route, max_outstanding=args.max_outstanding,
                                 request_timeout_s=args.request_timeout) as (url, engines):
            return await replays(url, [e.url for e in engines])

    runs = asyncio.run(main())
    _report(runs, out)
    return 0 if all(not r.replay.failed for r in runs) else 1


def _report(runs, out: Path | None) -> None:
    from rich.table import Table

    from flexmesh.console import plain_console
    from flexmesh.serve.metrics import percentiles, summarize

    t = Table(title="measured, open loop (ms; TPOT excludes the first token)")
    for col in ("rate/s", "done", "failed", "TTFT p50", "p90", "TPOT p50", "p90", "E2E p50", "p90", "req/s", "lag p99"):
        t.add_column(col, justify="right")
    summary = []
    for run in runs:
        rep = run.replay
        s = summarize(rep.records) if rep.records else None
        lag = percentiles(rep.send_lag_s)["p99"] if rep.send_lag_s else float("nan")
        cells = ["-"] * 7
        if s is not None:
            cells = [f"{d[q] * 1e3:,.0f}" if d is not s.tpot else f"{d[q] * 1e3:,.1f}"
                     for d in (s.ttft, s.tpot, s.e2e) for q in ("p50", "p90")] + [f"{s.requests_per_s:.2f}"]
        t.add_row(f"{run.rate:g}", str(len(rep.records)), str(len(rep.failed)), *cells, f"{lag * 1e3:.0f}")
        summary.append({"rate": run.rate, "summary": s.to_json() if s else None, "failed": rep.failed,
                        "send_lag_p99_s": lag})
        if out is not None:
            rep.write(out / f"requests-{run.rate:g}.jsonl")
            if run.iterations:
                write_atomic(out / f"iterations-{run.rate:g}.json", json.dumps(run.iterations), root=out)
    con = plain_console()
    con.print(t)
    for run in runs:
        for rid, why in list(run.replay.failed.items())[:3]:
            con.print(f"rate {run.rate:g}: request {rid} failed: {why}", highlight=False)
    if out is not None:
        write_atomic(out / "summary.json", json.dumps(summary, indent=1, default=str) + "\n", root=out)
        con.print(f"wrote {out}", highlight=False)
