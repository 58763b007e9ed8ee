"""``flexmesh profile engine``: measure a local engine's iterations into an engine profile
(flexmesh.profile.engine; docs/serving-engines.md). Registered by flexmesh.commands.profile."""

from __future__ import annotations

import argparse
import sys

from flexmesh.commands.args import new_file, positive_int
from flexmesh.commands.engine_args import add_engine_args, engine_config


def add_engine_parser(kinds) -> argparse.ArgumentParser:
    p = kinds.add_parser("engine", help="a serving engine's iteration times (prefill chunks, decode batches, overhead)",
                         description="Start local engines (transformers' continuous batching, as `flexmesh serve run` "
                                     "starts them), run prefill chunks, decode and mixed batches on them, serve "
                                     "synthetic requests through the router, time every iteration and fit them, and "
                                     "time a request's way from the router into an engine's batch; the simulator "
                                     "prices this machine by the profile.")
    p.add_argument("--quick", action="store_true", help="a small sweep (about half a minute)")
    p.add_argument("--out", type=new_file, help="profile file to write, atomically (default engine-<model>.json)")
    p.add_argument("--samples", type=new_file, help="also write every iteration measured, one JSON object a line "
                                                    "(batch, wall and CPU seconds, engine, sweep scenario or serving "
                                                    "load), to compare forms of the fit offline")
    p.add_argument("--no-progress", action="store_true", help="no progress line")
    p.add_argument("--engines", type=positive_int, default=2,
                   help="engine processes swept at once: as many as will serve side by side, so that their "
                        "contention is in the profile (serve run's default: 2)")
    add_engine_args(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from flexmesh.commands.engine_args import need_aiohttp
    from flexmesh.files import check_file_target
    from flexmesh.profile.engine import profile_engine

    need_aiohttp()
    cfg = engine_config(args)
    out = args.out or f"engine-{cfg.model.replace('/', '_')}.json"
    check_file_target(out)
    if args.samples:
        check_file_target(args.samples)

    def progress(done: int, total: int, what: str) -> None:
        if not args.no_progress:
            print(f"\r[{done}/{total}] {what:<24}", end="" if done < total else "\n", file=sys.stderr, flush=True)

    if args.engine != "transformers":  # a production engine: measured through its streamed tokens
        prof = _profile_external(args, cfg, progress)
    else:
        prof = profile_engine(cfg, quick=args.quick, engines=args.engines, progress=progress,
                              samples_out=args.samples)
    prof.save(out)
    _summary(prof, out)
    return 0


def _profile_external(args, cfg, progress):
    import asyncio
    import tempfile
    from pathlib import Path

    from flexmesh.commands.serve_run import external_engines
    from flexmesh.errors import ServeError
    from flexmesh.profile.streamed import profile_external

    if args.samples:
        raise ServeError(f"--samples writes flexmesh's engine's iterations; {args.engine} logs none (its profile "
                         "holds the median of each batch measured)")
    cfgs, card, folder, note = external_engines(args, cfg)
    logs = Path(tempfile.mkdtemp(prefix="flexmesh-profile-"))
    print(f"{note}; logs {logs}", file=sys.stderr, flush=True)
    return asyncio.run(profile_external(cfgs, card, str(folder), cfg, args.quick, logs, progress))


def _summary(prof, out: str) -> None:
    from rich.table import Table

    from flexmesh.console import plain_console
    from flexmesh.profile.iteration import TERMS

    con = plain_console()
    t = Table(title=f"engine profile of {prof.engine['model']} ({len(prof.samples)} distinct batches, "
                    f"{prof.produced_by['sweep']['iterations']} iterations, {prof.produced_by['processes']} engines "
                    "at once)")
    t.add_column("term")
    t.add_column("coefficient", justify="right")
    units = {"c0_s": ("per-iteration overhead", 1e3, "ms"), "per_request_s": ("per request", 1e6, "us"),
             "per_token_s": ("per new token", 1e6, "us"), "per_kv_token_s": ("per KV token", 1e9, "ns"),
             "per_batch_token_x_kv_token_s": ("per batch new x KV token", 1e12, "ps"),
             "per_request_token_x_kv_token_s": ("per request new x KV token", 1e12, "ps")}
    for term in TERMS:
        label, scale, unit = units[term]
        t.add_row(label, f"{prof.fit[term] * scale:,.3f} {unit}")
    con.print(t)
    share = prof.produced_by["sweep"].get("cpu_share")
    if share is not None:
        con.print(f"each engine had {share:.0%} of a core while it iterated (its CPU time over the iterations' "
                  "wall time; other work on the machine lowers it; the samples are CPU time, which it does not "
                  "slow)", highlight=False)
    served = prof.produced_by["sweep"].get("serving") or []
    if served:
        con.print("served behind the router at " + ", ".join(f"{s['rate']:g}/s (load {s['load']:g})" for s in served)
                  + "; their iterations are samples too", highlight=False)
    if prof.produced_by.get("measured") == "streamed tokens":  # a production engine (flexmesh.profile.streamed)
        con.print(f"admission (a request sent -> its first token, less its prefill iteration): "
                  f"{prof.admission_s * 1e3:.2f} ms, fitted to {prof.produced_by['sweep']['first_tokens']} lone "
                  "prompts; measured through streamed tokens: the first iteration after idling and the host's shared "
                  "cores are inside the samples, not terms of their own", highlight=False)
        e = prof.error
        con.print(f"in-sample error of the fit over the measured batches: median {e['median']:.1%}, p90 "
                  f"{e['p90']:.1%}, max {e['max']:.1%}", highlight=False)
        con.print(f"wrote {out}", highlight=False)
        return
    con.print(f"admission (the router receiving a request -> the engine's first iteration holding it): "
              f"{prof.admission_s * 1e3:.2f} ms, median of {prof.produced_by['sweep'].get('admissions', 0)}",
              highlight=False)
    con.print(f"the first iteration after an engine idled: {prof.after_idle:+.0%} over the fit (cold caches; the "
              "simulator prices it so)", highlight=False)
    con.print(f"a busy engine's HTTP thread beside its loop: {prof.intake_s * 1e3:.2f} ms per request taken in, "
              f"{prof.answer_s * 1e3:.2f} ms per request answered (the loop waits; the simulator charges each to the "
              "next iteration)", highlight=False)
    con.print(f"the router's and the client's process on the engines' {prof.host_cores} cores: "
              f"{prof.host_request_s * 1e3:.2f} ms CPU per request, {prof.host_token_s * 1e6:.1f} us per prompt token "
              f"and {prof.host_output_s * 1e6:.1f} us per output token (the simulator charges them to the engines "
              "while they fill every core)", highlight=False)
    e = prof.error
    con.print(f"in-sample error of the fit over the measured batches: median {e['median']:.1%}, p90 {e['p90']:.1%}, "
              f"max {e['max']:.1%}", highlight=False)
    for way, h in (prof.produced_by["sweep"].get("held_out") or {}).items():
        con.print(f"held out ({way.replace('->', ' fit, priced against the ')} iterations): median {h['median']:.1%}, "
                  f"p90 {h['p90']:.1%}, CPU seconds {h['busy']:.2f}x measured", highlight=False)
    con.print(f"wrote {out}", highlight=False)
