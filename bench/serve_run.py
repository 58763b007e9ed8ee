"""Real engines behind flexmesh's router, its policies measured beside the simulator: 3 engine processes of the tiny
model, windows of the Azure 2023 conversation trace (lengths scaled to a 2048-token context) replayed open loop.

1. **Queues** at a rate past the knee (1.5x the requests per second the fleet serves with every engine busy, measured
   first with 60 requests sent at once, so the machine's load is in it): FCFS and TIE with oracle lengths on each of
   ``--repeats`` consecutive windows of the trace (the spread over them reported), then on the first window SJF
   (oracle) and TIE with the noisy and the prompt-model predictors (the router holds each engine's requests beyond
   ``max_running`` in the policy's order). Targets: TIE (oracle) <= 0.8 x FCFS's mean per-token latency (E2E / output
   tokens; the mean over the windows of each window's ratio), and the simulator's predicted gain (FCFS / TIE, mean
   over the windows) within 25% of the measured one. The simulator is the engines' twin
   (:mod:`flexmesh.serve.engine.twin`), its iterations priced by a fit to the engines' own iterations of the FCFS
   replays (their wall times, contention included), scaled so that fit's busy time is theirs: the FCFS runs
   calibrate, TIE and the others are predicted.
2. **Test-time scaling**: every request samples N = 8 branches and needs M = 2 (each branch's length drawn from
   the window's output lengths). Targets: >= 2x fewer decode tokens than running all eight to the end, measured
   (the router's records); the simulator within 10% of the measured decode tokens.
3. **A failure**: one of three engines SIGKILLed a third of the way into a replay of the first window at the queue
   replays' rate (FCFS). Targets: 0 requests lost (every one answered); the recovery time reported: from the kill
   until every request the engine held (running on it or queued for it in the router) was re-sent and taken by a
   live engine (the router's ``recovered`` events: when the engine took it), with the detection time (kill to the
   router's ``engine-lost``) and the latency beside the same window's FCFS replay without a failure.
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
import statistics
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
CONTEXT = 2048  # the trace's lengths scaled to it (prompts ~130 tokens, outputs ~30 on average)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=80, help="requests in each queue replay's window")
    ap.add_argument("--repeats", type=int, default=3, help="windows FCFS and TIE (oracle) are replayed on")
    ap.add_argument("--rate", type=float, help="requests per second of the queue replays (default: RATE_PAST_KNEE x "
                    "the requests per second the fleet served with 60 requests sent at once)")
    ap.add_argument("--max-running", type=int, default=8, help="requests each engine runs at once (the router "
                    "holds the rest)")
    ap.add_argument("--quick", action="store_true", help="smaller windows, at most 2 repeats (a smoke run)")
    ap.add_argument("--out", help="folder for the records, events and the engines' logs")
    ap.add_argument("--no-record", action="store_true", help="print only: leave bench/RESULTS.md alone")
    args = ap.parse_args()

    from bench._results import markdown_table, record
    from flexmesh.data.requests import at_rate, load_trace, scale_to_context, window, with_branches
    from flexmesh.serve.engine.config import EngineConfig
    from flexmesh.serve.engine.processes import router_on, start_engines, stop_engines
    from flexmesh.serve.engine.replay import replay
    from flexmesh.serve.lengths import NoisyOracle, Oracle, PromptModel
    from flexmesh.serve.metrics import percentiles, read_records, summarize

    t_start = time.perf_counter()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-serve-run-"))
    out.mkdir(parents=True, exist_ok=True)
    n = min(args.requests, 40) if args.quick else args.requests
    repeats = max(1, min(args.repeats, 2) if args.quick else args.repeats)
    cfg = EngineConfig(model="tiny", num_blocks=2048, page_size=16, max_batch_tokens=256,
                       max_requests_per_batch=args.max_running)
    trace = scale_to_context(load_trace("azure-conv"), CONTEXT)
    windows = [window(trace, trace.requests[k * n].arrival_s, first=n) for k in range(repeats)]
    fit_on = window(trace, 1800.0, first=2000)  # the prompt model learns from a later half hour of the trace
    predictors = {"oracle": Oracle(), "noisy": NoisyOracle(0.5), "prompt": PromptModel.fit(fit_on)}
    load_before = os.getloadavg()
    lines: list[str] = []

    def said(what: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f} s] {what}", flush=True)

    async def measure():
        engines = await start_engines(cfg, ENGINES, out / "logs")
        urls = [e.url for e in engines]
        said(f"{ENGINES} engines ready")
        base = dict(context=CONTEXT, max_running=args.max_running, kv_tokens=cfg.kv_tokens,
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
                    said(f"{name}: {len(rep.records)} answered, {len(rep.failed)} failed")
                    return rep, read_records(records), list(router.events), killed, its

            results = {}
            rate = args.rate
            if rate is None:  # what the fleet turns around now, all its engines busy (the machine's load included)
                rep, _, _, _, _ = await run("capacity", at_rate(window(trace, 0.0, first=60), 60.0))
                rate = round(RATE_PAST_KNEE * summarize(rep.records).requests_per_s, 2)
            said(f"queue replays: {repeats} window(s) of {n} requests at {rate:g}/s")
            loads = [at_rate(w, rate) for w in windows]
            for k, load in enumerate(loads):
                results[f"fcfs@{k}"] = await run(f"fcfs@{k}", load)
                results[f"tie-oracle@{k}"] = await run(f"tie-oracle@{k}", load, "tie", predictors["oracle"])
            results["sjf@0"] = await run("sjf@0", loads[0], "sjf", predictors["oracle"])
            for name in ("noisy", "prompt"):
                results[f"tie-{name}@0"] = await run(f"tie-{name}@0", loads[0], "tie", predictors[name])
            branched = with_branches(window(trace, 0.0, first=10 if args.quick else 40), 8, 2)
            results["branches"] = await run("branches", at_rate(branched, 1.0))
            results["failure"] = await run("failure", loads[0], kill_at=loads[0].duration_s / 3)
            return rate, loads, branched, results
        finally:
            await stop_engines(engines)

    rate, loads, branched, results = asyncio.run(measure())
    load_mid = os.getloadavg()

    # 1. Queues: measured, and the twin calibrated on the FCFS replays' iterations.
    from flexmesh.serve.engine.twin import twin_fleet

    timing = _calibrated([per for k in range(repeats) for per in results[f"fcfs@{k}"][4]])
    twin = twin_fleet(cfg, ENGINES, timing, args.max_running)
    per_token, predicted = {}, {}
    for name, (rep, _, _, _, _) in results.items():
        if name in ("branches", "failure"):
            continue
        policy, k = name.split("@")
        queue, _, pred = policy.partition("-")
        p = twin.run(loads[int(k)], queue=queue, predictor=predictors.get(pred or "oracle")).records
        per_token[name] = summarize(rep.records).per_token["mean"]
        predicted[name] = summarize(p).per_token["mean"]
    ratios = [per_token[f"tie-oracle@{k}"] / per_token[f"fcfs@{k}"] for k in range(repeats)]
    gains_meas = [1 / r for r in ratios]
    gains_pred = [predicted[f"fcfs@{k}"] / predicted[f"tie-oracle@{k}"] for k in range(repeats)]
    ratio, gain_meas, gain_pred = (statistics.fmean(x) for x in (ratios, gains_meas, gains_pred))
    gain_err = abs(gain_pred / gain_meas - 1)
    spread = f" (windows {min(ratios):.2f} to {max(ratios):.2f})" if repeats > 1 else ""
    rows = []
    for k in range(repeats):
        f, t = f"fcfs@{k}", f"tie-oracle@{k}"
        rows.append([str(k), f"{per_token[f] * 1e3:,.1f} / {predicted[f] * 1e3:,.1f}",
                     f"{per_token[t] * 1e3:,.1f} / {predicted[t] * 1e3:,.1f}", f"{ratios[k]:.2f}",
                     f"{gains_meas[k]:.2f}x / {gains_pred[k]:.2f}x"])
    others = []
    for name in ("fcfs@0", "sjf@0", "tie-oracle@0", "tie-noisy@0", "tie-prompt@0"):
        rep = results[name][0]
        s = summarize(rep.records)
        others.append([name.split("@")[0], len(rep.records), len(rep.failed), f"{s.ttft['p50'] * 1e3:,.0f}",
                       f"{s.e2e['p50']:.2f} / {s.e2e['p99']:.2f}",
                       f"{per_token[name] * 1e3:,.1f} / {predicted[name] * 1e3:,.1f}",
                       f"{per_token[name] / per_token['fcfs@0']:.2f} / {predicted[name] / predicted['fcfs@0']:.2f}"])
    lines += [f"Tiny model, {ENGINES} engine processes (one thread each; EngineConfig `{cfg.to_json()}`) behind "
              f"the router, each sent at most {args.max_running} requests at once; {repeats} consecutive window(s) of "
              f"{n} requests of the Azure 2023 conversation trace scaled to {CONTEXT} tokens, each window's arrivals "
              f"scaled to {rate:g} req/s ({RATE_PAST_KNEE:g}x the fleet's measured capacity). Load average (1 min) "
              f"{load_before[0]:.1f} before, {load_mid[0]:.1f} after the replays, on {os.cpu_count()} cores: other "
              "work shares the machine and every timing carries its noise.", "",
              "Mean per-token latency (E2E / output tokens), measured / simulated, per window:", "",
              *markdown_table(["window", "FCFS ms", "TIE (oracle) ms", "TIE / FCFS measured",
                               "gain FCFS / TIE measured / simulated"], rows), "",
              "Every policy on window 0 (measured; per-token also simulated):", "",
              *markdown_table(["queue-predictor", "done", "failed", "TTFT p50 ms", "E2E p50 / p99 s",
                               "per-token ms (measured / simulated)", "per-token / FCFS's (measured / simulated)"],
                              others), "",
              f"- TIE (oracle) / FCFS mean per-token latency = {ratio:.2f} measured, mean of {repeats} window(s)"
              f"{spread} (target <= {GAIN_TARGET}): {'PASS' if ratio <= GAIN_TARGET else 'FAIL'}",
              f"- gain FCFS / TIE: {gain_meas:.2f}x measured, {gain_pred:.2f}x simulated (means over the windows), "
              f"error {gain_err:.0%} (bound {GAIN_BOUND:.0%}): {'PASS' if gain_err <= GAIN_BOUND else 'FAIL'}",
              f"- noisy (sigma 0.5) and prompt-model predictors (window 0): TIE / FCFS = "
              f"{per_token['tie-noisy@0'] / per_token['fcfs@0']:.2f} and "
              f"{per_token['tie-prompt@0'] / per_token['fcfs@0']:.2f} measured "
              f"({predicted['tie-noisy@0'] / predicted['fcfs@0']:.2f} and "
              f"{predicted['tie-prompt@0'] / predicted['fcfs@0']:.2f} simulated); SJF (oracle) "
              f"{per_token['sjf@0'] / per_token['fcfs@0']:.2f}", ""]

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

    # 3. The failure, beside the same window's FCFS replay.
    rep, recs, events, killed, _ = results["failure"]
    fail = loads[0]
    lost_ev = next((e for e in events if e["event"] == "engine-lost"), None)
    rerouted = next((e for e in events if e["event"] == "rerouted"), None)
    resent = {e["id"] for e in events if e["event"] == "resent"}
    accepted = {e["id"]: e["accepted_s"] for e in events if e["event"] == "recovered" and e["accepted_s"] is not None}
    lost_requests = len(fail) - len(recs)
    recovery = float("nan")
    if killed is not None and lost_ev is not None:
        detect = lost_ev["t"] - killed
        taken = [accepted[i] for i in resent if i in accepted]
        if resent and len(taken) == len(resent):
            recovery = max(taken) - killed
        what = (f"the router saw it {detect:.2f} s after the kill ({lost_ev['why']}); routing rebuilt over engines "
                f"{rerouted['engines'] if rerouted else '?'}; {len(resent)} requests re-sent ({lost_ev['sent']} it was "
                f"running, {lost_ev['queued']} queued for it), {len(taken)} of them taken by a live engine, the last "
                f"{recovery:.2f} s after the kill")
    else:
        what = "the engine's loss was not seen"
    base_rep = results["fcfs@0"][0]
    e2e_b, e2e_f = (percentiles([r.e2e_s for r in x]) for x in (base_rep.records, recs))
    pt_b, pt_f = (percentiles([r.per_token_s for r in x]) for x in (base_rep.records, recs))
    impact = [[what_, f"{b['p50']:.2f} / {b['p99']:.2f}", f"{f['p50']:.2f} / {f['p99']:.2f}",
               f"{f['p50'] / b['p50']:.2f}x / {f['p99'] / b['p99']:.2f}x"]
              for what_, b, f in (("E2E s", e2e_b, e2e_f), ("per-token ms", _ms(pt_b), _ms(pt_f)))]
    ok = lost_requests == 0 and not rep.failed and lost_ev is not None and recovery == recovery
    lines += [f"Failure: window 0 ({len(fail)} requests) at {rate:g} req/s over {ENGINES} engines (FCFS), engine 1 "
              f"SIGKILLed at {killed if killed is None else round(killed, 2)} s; {what}.", "",
              *markdown_table(["latency p50 / p99", "no failure (FCFS, window 0)", "engine 1 killed", "killed / none"],
                              impact), "",
              f"- requests lost: {lost_requests} of {len(fail)} (failed answers: {len(rep.failed)}) (target 0): "
              f"{'PASS' if ok else 'FAIL'}",
              f"- recovery time (kill to the last re-sent request taken by a live engine): {recovery:.2f} s", ""]

    # 4. Bad input.
    checks = _bad_input(out)
    good_all = all(c[1] for c in checks)
    lines += ["Bad input (each: exit 2, one line, seconds taken):", "",
              # the run's folder is this machine's: named OUT in the record
              *markdown_table(["input", "one line", "s", "the line"],
                              [[w, "yes" if good else "NO", f"{s:.1f}", line.replace(str(out), "OUT")[:110]]
                               for w, good, s, line in checks]), "",
              f"- every bad input one line, nothing hanging: {'PASS' if good_all else 'FAIL'}"]
    load_after = os.getloadavg()
    lines.append(f"\nLoad average (1 min) at the end: {load_after[0]:.1f}; the bench took "
                 f"{(time.perf_counter() - t_start) / 60:.1f} min.")
    text = "\n".join(lines)
    print(text)
    print(f"records and events: {out}")
    (out / "summary.md").write_text(text + "\n")
    if not args.no_record:
        record("serve_run", text, headline=f"TIE/FCFS per-token {ratio:.2f} over {repeats} windows (sim gain "
               f"{gain_pred:.2f}x vs {gain_meas:.2f}x), branches {saving:.1f}x fewer decode tokens (sim {b_err:.0%} "
               f"off), {lost_requests} lost, recovery {recovery:.1f} s; load {load_before[0]:.1f}")
    return 0


def _ms(p: dict) -> dict:
    return {k: v * 1e3 for k, v in p.items()}


async def _count(url: str) -> int:
    from aiohttp import ClientSession

    from flexmesh.serve.engine.processes import iteration_count

    async with ClientSession() as s:
        return await iteration_count(s, url)


async def _iterations(url: str, since: int) -> list[dict]:
    from aiohttp import ClientSession

    from flexmesh.serve.engine.processes import fetch_iterations

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
