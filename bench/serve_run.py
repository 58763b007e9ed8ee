"""Real engines behind flexmesh's router, its policies measured beside the simulator: 3 engine processes of the tiny
model, a window of the Azure 2023 conversation trace (lengths scaled to the model's context) replayed open loop.

1. **Queues** at a rate past the knee (1.5x the requests per second the fleet serves with every engine busy, measured
   first with 60 requests sent at once, so the machine's load is in it): FCFS, then SJF and TIE with oracle lengths, TIE
   with the noisy and the prompt-model predictors (the router holds each engine's requests beyond ``max_running`` in the
   policy's order). Target: TIE (oracle) <= 0.8 x FCFS's mean per-token latency (E2E / output tokens), and the
   simulator's predicted gain (FCFS / TIE) within 25% of the measured one. The simulator is the engines' twin
   (:mod:`flexmesh.serve.engine.twin`), its iterations priced by a fit to the engines' own iterations of the FCFS replay
   (their wall times, contention included), scaled so that fit's busy time is theirs: the FCFS run calibrates, TIE and
   the others are predicted.
2. **Test-time scaling**: every request samples N = 8 branches and needs M = 2 (each branch's length drawn from
   the window's output lengths). Targets: >= 2x fewer decode tokens than running all eight to the end, measured
   (the router's records); the simulator within 10% of the measured decode tokens.
3. **A failure**: one of three engines SIGKILLed a third of the way into a replay. Targets: 0 requests lost;
   the recovery time reported (from the kill to the first token of the last request it held, re-sent elsewhere)
   with the detection time (kill to the router's ``engine-lost``).
4. **Bad input**, each one line and exit 2, none hanging: a plan for GPUs this machine lacks, a port in use, a
   malformed trace, an engine that fails to start.

Timings on a shared machine are noisy: the load average before and after is recorded beside the numbers.

    OMP_NUM_THREADS=1 python -m bench.serve_run            # records "serve_run" in bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GAIN_TARGET, GAIN_BOUND, BRANCH_SAVING, BRANCH_BOUND = 0.8, 0.25, 2.0, 0.10
RATE_PAST_KNEE = 1.5  # the queue replays' rate, times what the fleet serves when every engine is busy
# The code this bench's figures depend on (it runs flexmesh commands for the bad-input checks: the whole package).
DEPENDS_ON = ("flexmesh",)
ENGINES = 3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=150, help="requests in the queue replays' window")
    ap.add_argument("--rate", type=float, help="requests per second of the queue replays (default: RATE_PAST_KNEE x "
                    "the requests per second the fleet served with 60 requests sent at once)")
    ap.add_argument("--max-running", type=int, default=8, help="requests each engine runs at once (the router "
                    "holds the rest)")
    ap.add_argument("--quick", action="store_true", help="smaller windows (a smoke run)")
    ap.add_argument("--out", help="folder for the records, events and the engines' logs")
    ap.add_argument("--no-record", action="store_true", help="print only: leave bench/RESULTS.md alone")
    args = ap.parse_args()

    from bench._results import markdown_table, record
    from flexmesh.data.requests import at_rate, load_trace, scale_to_context, window, with_branches
    from flexmesh.serve.engine.config import EngineConfig
    from flexmesh.serve.engine.fleet import router_on, start_engines, stop_engines
    from flexmesh.serve.engine.replay import replay
    from flexmesh.serve.lengths import NoisyOracle, Oracle, PromptModel
    from flexmesh.serve.metrics import read_records, summarize

    out = Path(args.out or tempfile.mkdtemp(prefix="bench-serve-run-"))
    out.mkdir(parents=True, exist_ok=True)
    n = 60 if args.quick else args.requests
    cfg = EngineConfig(model="tiny", num_blocks=2048, page_size=16, max_batch_tokens=256,
                       max_requests_per_batch=args.max_running)
    context = 4096
    trace = scale_to_context(load_trace("azure-conv"), context)
    win = window(trace, 0.0, first=n)
    fit_on = window(trace, 1800.0, first=2000)  # the prompt model learns from a later half hour of the trace
    predictors = {"oracle": Oracle(), "noisy": NoisyOracle(0.5), "prompt": PromptModel.fit(fit_on)}
    load_before = os.getloadavg()
    lines: list[str] = []

    async def measure():
        engines = await start_engines(cfg, ENGINES, out / "logs")
        urls = [e.url for e in engines]
        base = dict(context=context, max_running=args.max_running, kv_tokens=cfg.kv_tokens,
                    health_interval_s=1.0, health_timeout_s=10.0)
        try:
            async def run(name, workload, queue="fcfs", predictor=None, kill_at=None):
                records, events = out / f"requests-{name}.jsonl", out / f"events-{name}.jsonl"
                async with router_on(urls, 0, records, events, queue=queue, predictor=predictor,
                                     route="round-robin", **base) as url:
                    router = url.router
                    killed = None
                    if kill_at is not None:
                        async def killer():
                            nonlocal killed
                            await asyncio.sleep(kill_at)
                            engines[1].proc.send_signal(signal.SIGKILL)
                            killed = router.clock()
                        asyncio.ensure_future(killer())
                    its0 = [await _count(u) for u in urls]
                    rep = await replay(url, list(workload.requests), vocab=4096, request_timeout_s=900,
                                       drain_timeout_s=900)
                    its = [await _iterations(u, b) for u, b in zip(urls, its0)] if kill_at is None else []
                    (out / f"iterations-{name}.json").write_text(json.dumps(its))
                    await asyncio.sleep(0.5)  # the branches' records wait for their cancelled siblings
                    return rep, read_records(records), list(router.events), killed, its

            results = {}
            # Calibration: a short replay below the knee fits the twin and places the rate.
            rate = args.rate
            if rate is None:  # what the fleet turns around now, all its engines busy (the machine's load included)
                rep, _, _, _, _ = await run("capacity", at_rate(window(trace, 0.0, first=60), 60.0))
                rate = round(RATE_PAST_KNEE * summarize(rep.records).requests_per_s, 2)
            print(f"queue replays: {len(win)} requests at {rate:g}/s", flush=True)
            load = at_rate(win, rate)
            results["fcfs"] = await run("fcfs", load)
            results["sjf"] = await run("sjf", load, "sjf", predictors["oracle"])
            for name, pred in predictors.items():
                results[f"tie-{name}"] = await run(f"tie-{name}", load, "tie", pred)
            branched = with_branches(window(trace, 0.0, first=20 if args.quick else 40), 8, 2)
            results["branches"] = await run("branches", at_rate(branched, 1.0))
            fail = at_rate(window(trace, 0.0, first=n), rate)
            results["failure"] = await run("failure", fail, kill_at=fail.duration_s / 3)
            return rate, load, branched, fail, results
        finally:
            await stop_engines(engines)

    rate, load, branched, fail, results = asyncio.run(measure())
    load_mid = os.getloadavg()

    # 1. Queues: measured, and the twin calibrated on the FCFS replay's iterations.
    from flexmesh.serve.engine.twin import twin_fleet

    timing = _calibrated(results["fcfs"][4])
    twin = twin_fleet(cfg, ENGINES, timing, args.max_running)
    rows, per_token, predicted = [], {}, {}
    for name, (rep, _, _, _, _) in results.items():
        if name in ("branches", "failure"):
            continue
        queue, _, pred = name.partition("-")
        s = summarize(rep.records)
        p = summarize(twin.run(load, queue=queue, predictor=predictors.get(pred or "oracle")).records)
        per_token[name], predicted[name] = s.per_token["mean"], p.per_token["mean"]
        rows.append([name, len(rep.records), len(rep.failed),
                     f"{s.ttft['p50'] * 1e3:,.0f} / {p.ttft['p50'] * 1e3:,.0f}",
                     f"{s.e2e['p50']:.2f} / {p.e2e['p50']:.2f}",
                     f"{s.per_token['mean'] * 1e3:,.1f} / {p.per_token['mean'] * 1e3:,.1f}",
                     f"{per_token[name] / per_token.get('fcfs', per_token[name]):.2f} / "
                     f"{predicted[name] / predicted.get('fcfs', predicted[name]):.2f}"])
    ratio = per_token["tie-oracle"] / per_token["fcfs"]
    gain_meas, gain_pred = per_token["fcfs"] / per_token["tie-oracle"], predicted["fcfs"] / predicted["tie-oracle"]
    gain_err = abs(gain_pred / gain_meas - 1)
    lines += [f"Tiny model, {ENGINES} engine processes (one thread each; EngineConfig `{cfg.to_json()}`) behind "
              f"the router, each sent at most {args.max_running} requests at once; {len(load)} requests of the "
              f"Azure 2023 conversation trace scaled to {context} tokens, the trace's arrivals scaled to "
              f"{rate:g} req/s. Load average (1 min) {load_before[0]:.1f} before, {load_mid[0]:.1f} after, on "
              f"{os.cpu_count()} cores: other work shares the machine and every timing carries its noise.", "",
              *markdown_table(["queue-predictor", "done", "failed", "TTFT p50 ms (measured / simulated)",
                               "E2E p50 s", "per-token ms (mean)", "per-token / FCFS's"], rows), "",
              f"- TIE (oracle) / FCFS mean per-token latency = {ratio:.2f} measured (target <= {GAIN_TARGET}): "
              f"{'PASS' if ratio <= GAIN_TARGET else 'FAIL'}",
              f"- gain FCFS / TIE: {gain_meas:.2f}x measured, {gain_pred:.2f}x simulated, error {gain_err:.0%} "
              f"(bound {GAIN_BOUND:.0%}): {'PASS' if gain_err <= GAIN_BOUND else 'FAIL'}",
              f"- noisy (sigma 0.5) and prompt-model predictors: TIE / FCFS = "
              f"{per_token['tie-noisy'] / per_token['fcfs']:.2f} and {per_token['tie-prompt'] / per_token['fcfs']:.2f}"
              f" measured ({predicted['tie-noisy'] / predicted['fcfs']:.2f} and "
              f"{predicted['tie-prompt'] / predicted['fcfs']:.2f} simulated); SJF (oracle) "
              f"{per_token['sjf'] / per_token['fcfs']:.2f}", ""]

    # 2. Branches.
    rep, recs, _, _, _ = results["branches"]
    everything = sum(sum(r.branch_lengths()) for r in branched.requests)
    spent = sum(r.decode_tokens or 0 for r in recs)
    # The router's cancellation reaches an engine while it runs one more iteration: cancel_lag 1.
    sim_spent = summarize(twin.run(at_rate(branched, 1.0), cancel_lag=1).records).decode_tokens
    saving, b_err = everything / max(spent, 1), abs(sim_spent / max(spent, 1) - 1)
    lines += [f"Test-time scaling: {len(branched)} requests x 8 branches, 2 needed, at 1 req/s: {len(recs)} answered, "
              f"{len(rep.failed)} failed.", "",
              f"- decode tokens: {everything:,} running all eight to the end, {spent:,} measured: {saving:.2f}x fewer "
              f"(target >= {BRANCH_SAVING:g}x): "
              f"{'PASS' if saving >= BRANCH_SAVING and len(recs) == len(branched) else 'FAIL'}",
              f"- simulated {sim_spent:,}, {b_err:.1%} from measured (bound {BRANCH_BOUND:.0%}): "
              f"{'PASS' if b_err <= BRANCH_BOUND else 'FAIL'}", ""]

    # 3. The failure.
    rep, recs, events, killed, _ = results["failure"]
    lost_ev = next((e for e in events if e["event"] == "engine-lost"), None)
    resent = {e["id"] for e in events if e["event"] == "resent"}
    by_id = {r.id: r for r in recs}
    lost_requests = len(fail) - len(recs)
    if killed is not None and lost_ev is not None:
        detect = lost_ev["t"] - killed
        recovery = max((by_id[i].first_token_s for i in resent if i in by_id), default=lost_ev["t"]) - killed
        what = (f"detected {detect:.2f} s after the kill ({lost_ev['why']}); {len(resent)} requests re-sent "
                f"({lost_ev['sent']} it was running, {lost_ev['queued']} queued for it); recovery (kill to the first "
                f"token of the last of them) {recovery:.2f} s")
    else:
        recovery = float("nan")
        what = "the engine's loss was not seen"
    lines += [f"Failure: {len(fail)} requests at {rate:.2f} req/s over 3 engines, engine 1 SIGKILLed at "
              f"{killed if killed is None else round(killed, 2)} s; {what}.", "",
              f"- requests lost: {lost_requests} of {len(fail)} (failed answers: {len(rep.failed)}) (target 0): "
              f"{'PASS' if lost_requests == 0 and not rep.failed and lost_ev is not None else 'FAIL'}",
              f"- recovery time reported: {recovery:.2f} s", ""]

    # 4. Bad input.
    checks = _bad_input(out)
    ok = all(c[1] for c in checks)
    lines += ["Bad input (each: exit 2, one line, seconds taken):", "",
              *markdown_table(["input", "one line", "s", "the line"], [[n, "yes" if good else "NO", f"{s:.1f}",
                                                                      line[:110]] for n, good, s, line in checks]), "",
              f"- every bad input one line, nothing hanging: {'PASS' if ok else 'FAIL'}"]
    load_after = os.getloadavg()
    lines.append(f"\nLoad average (1 min) at the end: {load_after[0]:.1f}. Records and events: `{out}`.")
    text = "\n".join(lines)
    print(text)
    (out / "summary.md").write_text(text + "\n")
    if not args.no_record:
        record("serve_run", text, headline=f"TIE/FCFS per-token {ratio:.2f} (sim gain {gain_pred:.2f}x vs "
               f"{gain_meas:.2f}x), branches {saving:.1f}x fewer decode tokens (sim {b_err:.0%} off), "
               f"{lost_requests} lost, recovery {recovery:.1f} s; load {load_before[0]:.1f}")
    return 0


async def _count(url: str) -> int:
    from aiohttp import ClientSession

    from flexmesh.serve.engine.fleet import iteration_count

    async with ClientSession() as s:
        return await iteration_count(s, url)


async def _iterations(url: str, since: int) -> list[dict]:
    from aiohttp import ClientSession

    from flexmesh.serve.engine.fleet import fetch_iterations

    async with ClientSession() as s:
        return await fetch_iterations(s, url, since)


def _calibrated(its: list[list[dict]]):
    """The engines' iterations of a replay as a timing (flexmesh.profile.iteration.replay_profile)."""
    from flexmesh.profile.iteration import ProfiledIterationTiming, replay_profile

    return ProfiledIterationTiming(replay_profile(its))


def _bad_input(out: Path) -> list[tuple[str, bool, float, str]]:
    """(what, one line and exit 2, seconds, the line) of each bad input, through the command line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    plan = out / "gpu-plan.json"
    plan.write_text(json.dumps(_GPU_PLAN))
    bad_trace = out / "bad.csv"
    bad_trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,12,7\n0.5,twelve,3\n")
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    cases = [("a plan for GPUs this machine lacks", ["serve", "run", "--plan", str(plan), "--port", "0"]),
             ("a port in use", ["serve", "run", "--engines", "1", "--port", str(port)]),
             ("a malformed trace", ["serve", "bench", "--trace", str(bad_trace), "--rate", "1", "--engines", "1"]),
             ("an engine that fails to start", ["serve", "run", "--engines", "1", "--port", "0", "--kv-blocks",
                                                "100000000000"])]  # a KV cache no memory holds
    got = []
    try:
        for what, cmd in cases:
            t0 = time.perf_counter()
            try:
                r = subprocess.run([sys.executable, "-m", "flexmesh", *cmd], capture_output=True, text=True, env=env,
                                   timeout=300, cwd=out)
                lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("starting ")]
                good = r.returncode == 2 and len(lines) == 1
                line = lines[0] if lines else r.stderr.strip()[:200]
            except subprocess.TimeoutExpired:
                good, line = False, "hung: no answer in 300 s"
            got.append((what, good, time.perf_counter() - t0, line))
    finally:
        holder.close()
    return got


_GPU_PLAN = {
    "version": 1, "kind": "flexmesh serving plan", "models": ["llama3.1-8b"], "cluster": "2xH100",
    "slo": {"ttft_s": 2.0, "tpot_s": 0.1, "attainment": 0.9},
    "buckets": {"prompt_edges": [], "output_edges": [],
                "buckets": [{"share": 1.0, "prompt_mean": 400, "output_mean": 200, "prompt_high": 900,
                             "output_high": 420, "longest": 1700}]},
    "groups": [{"model": 0, "group": 0, "device": "H100-80GB", "replicas": 2, "tp": 1, "role": "aggregated",
                "engine": {"max_seqs": 256, "max_batched_tokens": 2048}, "entry": [1.0]}],
    "routing": "weights", "prices": {"H100-80GB": 6.88}, "predicted": {}}


if __name__ == "__main__":
    raise SystemExit(main())
