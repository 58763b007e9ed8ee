"""flexmesh's serving simulator side by side with a peer's, on one shared configuration, held against a
measurement: which is nearer.

The peer is DistServe's simulator, simdistserve (OSDI'24; Apache-2.0, github.com/LLMServe/DistServe, the
``simdistserve/`` folder), in its vLLM mode. Vidur (MLSys'24; ``pip install vidur``, 0.0.26) was the first
choice and cannot run here: 0.0.26 downloads its compute and network profiles from Hugging Face datasets when
it starts (``snapshot_download`` in its ``SklearnExecutionTimePredictor``), nothing downloads here, and the
profiles its GitHub repository keeps under ``data/profiling/`` lack the attention tables (every
``compute/<gpu>/<model>/attention.csv`` there, in every version, is over 4 MiB, beyond what can be brought onto
this machine: Llama-3-8B's on A100 is 9.2 MB), without which its predictor cannot be fitted.

The shared configuration, the one a measurement exists for here (``bench.serve_engine``'s): the tiny
Llama-family model on 2 local engine processes behind flexmesh's router (transformers' continuous batching, fp32
on CPU cores: flexmesh's ``EngineConfig``, a token budget of 256 per iteration with chunked prefill, 256
requests at most, 2048 KV blocks of 16 tokens), 120 requests of the Azure 2023 conversation trace (lengths
scaled to 2048 tokens, the trace's arrivals scaled to each rate) at rates around the knee, replayed open loop.
``--against-record`` takes the measurement from bench/RESULTS.md's ``serve_engine`` record (its window,
engines and rates, measured on a quiet machine) instead of replaying now, for when other work shares the
machine: its wall-clock latencies then hold the waits for a core, which neither simulator models. Both
simulators are priced by the same measurement of the engine, ``flexmesh profile engine`` (batches and the
median CPU seconds the engines' threads spent on them): flexmesh's twin by its own fit of them; simdistserve by
its own cost form (prefill ``a + b * tokens + c * sum(chunk^2)``, decode ``a + b * context tokens + c *
batch``, in ms) fitted to the same samples the way DistServe fits its profiles (least squares on relative
error: ``evaluation/1-fit-time-usage``), its vLLM workers set to the engine's budget (chunked prefill on, 256
tokens per iteration, 256 decodes at most), its own least-loaded dispatch across the engines, and its Ray RPC
delay off (a constant of DistServe's GPU deployment, which the engine's measured iterations already hold; the 1
ms its prefill iterations carry for pipelining stays, as shipped). What the comparison shows: which scheduling
model and iteration cost form, fed the same measurements, lands nearer the engines' latencies. What it cannot
show: either simulator's pricing of a GPU (Vidur's and DistServe's profiles are of A100s and H100s this machine
does not have; issue 54's published-run items hold flexmesh's GPU pricing against published measurements).

Beside it, with no measurement: OPT-13B on one A100-80GB (simdistserve's shipped vLLM profile, which
DistServe fitted to vLLM on that GPU; flexmesh's analytic pricing of the catalogue's A100-80GB), the same
window at three rates, to show how far the two simulators' GPU pricing lies apart where neither is checked.

    OMP_NUM_THREADS=1 python -m bench.serve_peer            # records "serve_peer" in bench/RESULTS.md

simdistserve runs in its own environment, found at ``FLEXMESH_SIMDISTSERVE`` (a DistServe checkout, default
``.venvs/simdistserve/src`` in the repository) with ``FLEXMESH_SIMDISTSERVE_PYTHON`` (a python with simpy and
pandas, default ``.venvs/simdistserve/venv/bin/python``); the bench stops with a one-line message without it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The code this bench's figures depend on: a change there makes its record out of date.
DEPENDS_ON = ("flexmesh/serve", "flexmesh/profile", "flexmesh/cost", "flexmesh/data", "flexmesh/spec",
              "flexmesh/layout", "flexmesh/errors.py", "flexmesh/files.py", "flexmesh/inputs.py", "flexmesh/units.py",
              "flexmesh/console.py", "flexmesh/schedule/dispatch.py", "bench/_simdistserve.py", "bench/serve_engine.py")
RATE_FACTORS = (0.5, 1.0, 1.5)  # the measured rates, times flexmesh's twin's knee
KNEE_FACTOR = 4.0  # the knee: p90 TTFT at this many times its value at a low rate (as bench.serve_engine)
DRIVER = Path(__file__).with_name("_simdistserve.py")
METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E"))
OPT_13B = "gpt:40:5120:40:50272:untied@fp16"  # facebook/opt-13b: 40 layers, hidden 5120, 40 heads, MLP 4x, own head
DECODE_THRESHOLD = 95  # DistServe's split between small- and large-batch decode fits (its fit script's 96 - 1)


def simdistserve_paths() -> tuple[Path, Path] | None:
    """(DistServe checkout, its python) where both exist, else None."""
    home = Path(__file__).resolve().parent.parent / ".venvs" / "simdistserve"
    src = Path(os.environ.get("FLEXMESH_SIMDISTSERVE", home / "src"))
    py = Path(os.environ.get("FLEXMESH_SIMDISTSERVE_PYTHON", home / "venv" / "bin" / "python"))
    return (src, py) if (src / "simdistserve" / "base" / "worker.py").is_file() and py.is_file() else None


def fit_abc(rows: list[tuple[float, float, float]]) -> list[float]:
    """``a + b * x + c * y`` fitted to ``(x, y, ms)`` rows by least squares on relative error (DistServe's way).

    >>> [round(v, 6) for v in fit_abc([(x, y, 2 + 0.5 * x + 0.1 * y) for x, y in [(1, 2), (4, 1), (9, 7), (3, 3)]])]
    [2.0, 0.5, 0.1]
    """
    a = np.array([[1.0 / t, x / t, y / t] for x, y, t in rows])
    coef, *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    return [float(v) for v in coef]


def distserve_profile(samples) -> dict:
    """simdistserve's cost form fitted to an engine profile's ``(batch, seconds)`` samples: prefill rows are the
    batches of prompt chunks only (its form has no term for the context a chunk attends to, nor for decodes
    beside it), decode rows the batches of decodes only; one decode fit serves both batch-size ranges where
    one range has fewer than three rows."""
    pre = [(sum(q for _, q in b), sum(q * q for _, q in b), s * 1e3) for b, s in samples if all(q > 1 for _, q in b)]
    dec = [(sum(c + 1 for c, _ in b), len(b), s * 1e3, len(b)) for b, s in samples if all(q == 1 for _, q in b)]
    if len(pre) < 3 or len(dec) < 3:
        raise SystemExit(f"the engine profile has {len(pre)} prefill-only and {len(dec)} decode-only batches; "
                         "simdistserve's form needs 3 of each: profile a wider sweep")
    small = [r[:3] for r in dec if r[3] <= DECODE_THRESHOLD]
    large = [r[:3] for r in dec if r[3] > DECODE_THRESHOLD]
    every = fit_abc([r[:3] for r in dec])
    return {"decoding_large_small_bs_threshold": DECODE_THRESHOLD, "prefill": fit_abc(pre),
            "decoding_smallbs": fit_abc(small) if len(small) >= 3 else every,
            "decoding_largebs": fit_abc(large) if len(large) >= 3 else every}


def run_simdistserve(workload, spec: dict, paths: tuple[Path, Path]) -> list:
    """simdistserve's records of ``workload`` (flexmesh RequestRecords, its times) under ``spec`` (see the driver)."""
    from flexmesh.serve.metrics import RequestRecord

    reqs = list(workload.requests)
    src, py = paths
    with tempfile.TemporaryDirectory(prefix="bench-serve-peer-") as tmp:
        inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        inp.write_text(json.dumps({**spec, "requests": [
            {"id": r.id, "arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens}
            for r in reqs]}))
        env = {**os.environ, "PYTHONPATH": str(src)}
        done = subprocess.run([str(py), str(DRIVER), str(inp), str(out)], env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"simdistserve failed: {done.stderr.strip().splitlines()[-1:]}")
        got = {d["id"]: d for d in json.loads(out.read_text())}
    return [RequestRecord(r.id, 0, r.arrival_s, got[r.id]["first_token_s"], got[r.id]["finish_s"], r.prompt_tokens,
                          r.output_tokens) for r in reqs]


def nearer(measured: float, a: float, b: float) -> str:
    """Which of two predictions lies nearer the measurement (relative), or ``tie`` within 1%.

    >>> nearer(10.0, 9.0, 12.0), nearer(10.0, 14.0, 7.0), nearer(10.0, 9.0, 11.0)
    ('flexmesh', 'simdistserve', 'tie')
    """
    ea, eb = abs(a / measured - 1), abs(b / measured - 1)
    return "tie" if abs(ea - eb) <= 0.01 else ("flexmesh" if ea < eb else "simdistserve")


def side_by_side(rate: float, m: dict, f, d) -> tuple[list[list[str]], list[tuple[str, float, float]]]:
    """Table rows of one rate (measured / flexmesh / simdistserve, ms) and each cell's (nearer, errors); ``m``:
    the measured percentiles by metric (``{"ttft": {"p50": s, "p90": s}, ...}``; a metric left out has no row)."""
    rows, verdicts = [], []
    for key, label in METRICS:
        for q in ("p50", "p90") if key in m else ():
            mv, fv, dv = m[key][q], getattr(f, key)[q], getattr(d, key)[q]
            who = nearer(mv, fv, dv)
            verdicts.append((who, abs(fv / mv - 1), abs(dv / mv - 1)))
            rows.append([f"{rate:g}", f"{label} {q}", f"{mv * 1e3:,.1f}", f"{fv * 1e3:,.1f} ({fv / mv - 1:+.0%})",
                         f"{dv * 1e3:,.1f} ({dv / mv - 1:+.0%})", who])
    return rows, verdicts


_ROW = re.compile(r"^\| ([0-9.]+) \| (\d+) \|" + r" ([0-9,.]+) / [^|]*\|" * 4)
_LOAD = re.compile(r"Load average \(1 min\) ([0-9.]+) before, ([0-9.]+) after")
_WINDOW = re.compile(r"(\d+) requests of the Azure 2023 conversation trace scaled to (\d+) tokens")


def recorded_measurement(text: str) -> dict:
    r"""The measured side of bench/RESULTS.md's ``serve_engine`` record: its commit, load, window and, per rate,
    the p50 and p90 TTFT and TPOT it measured (seconds).

    >>> body = ("2 engine processes behind the router, 120 requests of the Azure 2023 conversation trace scaled "
    ...         "to 2048 tokens. Load average (1 min) 0.1 before, 1.6 after\n"
    ...         "| 8.67 | 120 | 29.2 / 17.6 (-40%) | 87.8 / 49.1 (-44%) | 9.0 / 7.8 (-13%) | 19.4 / 12.5 (-36%) |")
    >>> got = recorded_measurement("<!-- bench:serve_engine -->\n## serve_engine (`bench/serve_engine.py`)\n\n"
    ...     "- commit: b52cb53\n- date: 2026-11-27\n- machine: x\n- versions: y\n- headline: z\n- targets: 1 of 3 met"
    ...     "\n\n" + body + "\n<!-- /bench:serve_engine -->")
    >>> got["commit"], got["load"], got["requests"], got["engines"], round(got["rates"][8.67]["tpot"]["p90"], 6)
    ('b52cb53', (0.1, 1.6), 120, 2, 0.0194)
    """
    from bench._results import parse_sections

    sec = next((s for s in parse_sections(text) if s.name == "serve_engine"), None)
    if sec is None:
        raise SystemExit("bench/RESULTS.md holds no serve_engine record: run `python -m bench.serve_engine` first")
    rates = {}
    for line in sec.body.splitlines():
        row = _ROW.match(line)
        if row:
            v = [float(x.replace(",", "")) / 1e3 for x in row.groups()[2:]]
            rates[float(row.group(1))] = {"ttft": {"p50": v[0], "p90": v[1]}, "tpot": {"p50": v[2], "p90": v[3]}}
    load, win = _LOAD.search(sec.body), _WINDOW.search(sec.body)
    engines = re.search(r"(\d+) engine processes", sec.body)
    if not rates or not load or not win or not engines:
        raise SystemExit("bench/RESULTS.md's serve_engine record is not in the form this bench reads; re-run it")
    return {"commit": sec.commit, "date": sec.date, "load": (float(load.group(1)), float(load.group(2))),
            "requests": int(win.group(1)), "context": int(win.group(2)), "engines": int(engines.group(1)),
            "rates": rates}


def knee_rates(p90_ttft_at) -> list[float]:
    """RATE_FACTORS times the knee of ``p90_ttft_at(rate)``, found by a coarse sweep."""
    grid = [0.25 * 1.25 ** k for k in range(40)]
    base = p90_ttft_at(grid[0])
    found = next((r for r in grid if p90_ttft_at(r) >= KNEE_FACTOR * base), grid[-1])
    return [round(f * found, 2) for f in RATE_FACTORS]


def a100_rows(win, paths) -> tuple[list[float], list[list[str]]]:
    """OPT-13B on one A100-80GB around flexmesh's knee: flexmesh's analytic pricing and simdistserve's shipped
    vLLM fit (the rates, the table's rows)."""
    from flexmesh.data.requests import at_rate
    from flexmesh.serve.metrics import summarize

    fleet = a100_fleet()
    rates = knee_rates(lambda r: summarize(fleet.run(at_rate(win, r)).records).ttft["p90"])
    rows = []
    for rate in rates:
        w = at_rate(win, rate)
        f = summarize(fleet.run(w).records)
        d = summarize(run_simdistserve(w, {"instances": 1, "tp": 1, "prefill_max_tokens": 2048,
                                           "decode_max_tokens": 256, "chunked_prefill": True, "profile": None,
                                           "ray_overhead": True}, paths))
        for key, label in METRICS:
            cells = [f"{getattr(s, key)[q] * 1e3:,.1f}" for s in (f, d) for q in ("p50", "p90")]
            rows.append([f"{rate:g}", label, *cells, f"{getattr(f, key)['p50'] / getattr(d, key)['p50']:.2f}x"])
    return rates, rows


def a100_fleet():
    """One aggregated replica of OPT-13B (fp16) on the catalogue's A100-80GB, vLLM's knobs as in the row above."""
    from flexmesh.serve.layout.knobs import EngineKnobs
    from flexmesh.serve.layout.replicas import ReplicaSpec, place
    from flexmesh.serve.simulator import Fleet
    from flexmesh.spec.cluster import ClusterSpec, MixedCluster
    from flexmesh.spec.devices import device
    from flexmesh.spec.model import parse_model

    model = parse_model(OPT_13B)
    cluster = MixedCluster((ClusterSpec(nodes=1, devices_per_node=1, device=device("A100-80GB")),))
    replicas = place((ReplicaSpec(group=0),), cluster)
    knobs = EngineKnobs(max_seqs=256, max_batched_tokens=2048)
    return Fleet(model, cluster, replicas, knobs={0: knobs})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=120, help="requests in the trace window")
    ap.add_argument("--context", type=int, default=2048, help="tokens the trace's lengths are scaled to fit")
    ap.add_argument("--engines", type=int, default=2, help="engine processes behind the router")
    ap.add_argument("--rates", help="requests per second (default: around flexmesh's twin's knee)")
    ap.add_argument("--against-record", action="store_true",
                    help="hold the simulators against the measurement bench/RESULTS.md's serve_engine record holds "
                    "(its window, engines and rates) instead of replaying now: for a machine other work shares")
    ap.add_argument("--profile", help="an engine profile of this machine (default: measure one now)")
    ap.add_argument("--out", help="folder for the engine profile, the measured requests and the engines' logs")
    ap.add_argument("--no-record", action="store_true", help="print only: leave bench/RESULTS.md alone")
    args = ap.parse_args()

    from bench._results import RESULTS, markdown_table, record
    from bench.serve_engine import engine_and_profile
    from flexmesh.data.requests import at_rate, load_trace, scale_to_context, window
    from flexmesh.profile.iteration import ProfiledIterationTiming
    from flexmesh.serve.engine.processes import running_fleet
    from flexmesh.serve.engine.replay import replay_rates
    from flexmesh.serve.engine.twin import twin_fleet
    from flexmesh.serve.metrics import summarize

    paths = simdistserve_paths()
    if paths is None:
        raise SystemExit("simdistserve not found: set FLEXMESH_SIMDISTSERVE to a DistServe checkout and "
                         "FLEXMESH_SIMDISTSERVE_PYTHON to a python with simpy and pandas")
    src, _ = paths
    commit = (src / "COMMIT").read_text().strip()[:7] if (src / "COMMIT").is_file() else "unknown commit"
    rec = recorded_measurement(RESULTS.read_text()) if args.against_record else None
    n, context, engines = (rec["requests"], rec["context"], rec["engines"]) if rec else \
        (args.requests, args.context, args.engines)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-serve-peer-"))
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    cfg, prof = engine_and_profile(args.profile, out, quick=True, engines=engines)
    prof_when = f"measured {prof.produced_by.get('date', 'earlier')}, given" if args.profile else "measured in this run"
    timing = ProfiledIterationTiming(prof)
    peer_profile = distserve_profile(prof.samples)
    peer_spec = {"instances": engines, "tp": 1, "prefill_max_tokens": cfg.max_batch_tokens,
                 "decode_max_tokens": cfg.max_requests_per_batch, "chunked_prefill": True, "profile": peer_profile,
                 "ray_overhead": False}
    win = window(scale_to_context(load_trace("azure-conv"), context), 0.0, first=n)
    twin = twin_fleet(cfg, engines, timing)

    def flexmesh_at(rate: float):
        return summarize(twin.run(at_rate(win, rate)).records)

    if rec:
        rates = sorted(rec["rates"])
        measured = rec["rates"]
        source = (f"the measurement bench/RESULTS.md's `serve_engine` record holds (commit {rec['commit']}, "
                  f"{rec['date']}, load average {rec['load'][0]:g} before and {rec['load'][1]:g} after: TTFT and TPOT; "
                  f"it recorded no E2E), not replayed now")
    else:
        rates = [float(r) for r in args.rates.split(",")] if args.rates else \
            knee_rates(lambda r: flexmesh_at(r).ttft["p90"])
        print(f"window: {len(win)} requests of azure-conv scaled to {context} tokens; rates {rates}", flush=True)

        async def measure():
            async with running_fleet(cfg, engines, out / "logs") as (url, procs):
                return await replay_rates(url, [(r, at_rate(win, r)) for r in rates], [e.url for e in procs])

        measured = {}
        for run in asyncio.run(measure()):
            run.replay.write(out / f"requests-{run.rate:g}.jsonl")
            m = summarize(run.replay.records)
            measured[run.rate] = {key: getattr(m, key) for key, _ in METRICS}
        source = "replayed now (open loop)"
    load_after = os.getloadavg()
    rows, verdicts = [], []
    for rate in rates:
        d = summarize(run_simdistserve(at_rate(win, rate), peer_spec, paths))
        r, v = side_by_side(rate, measured[rate], flexmesh_at(rate), d)
        rows += r
        verdicts += v
    wins = {w: sum(1 for who, *_ in verdicts if who == w) for w in ("flexmesh", "simdistserve", "tie")}
    med_f = float(np.median([e for _, e, _ in verdicts]))
    med_d = float(np.median([e for *_, e in verdicts]))
    overall = "flexmesh" if med_f < med_d else "simdistserve"
    a100_rates, a100 = a100_rows(win, paths)

    pre = peer_profile["prefill"]
    md = [f"Peer: DistServe's simulator, simdistserve ({commit}, vLLM mode). Vidur 0.0.26 cannot run here: it "
          "downloads its profiles from Hugging Face when it starts, and its repository's `data/profiling/` lacks "
          "the attention tables it fits (each over 4 MiB, beyond what reaches this machine).", "",
          f"Shared configuration: the tiny model on {engines} engine process{'es' if engines > 1 else ''} behind "
          f"the router (`{cfg.to_json()}`), {len(win)} requests of the Azure 2023 conversation trace scaled to "
          f"{context} tokens, the trace's arrivals scaled to each rate. Measured: {source}. Both simulators priced "
          f"by one engine profile ({prof_when}; {len(prof.samples)} batches, CPU time of the engines' threads, "
          f"overhead c0 = {prof.fit['c0_s'] * 1e3:.2f} ms per iteration): "
          f"flexmesh by its fit (in-sample median error {prof.error['median']:.1%}), simdistserve by its own form "
          f"fitted to the same samples as DistServe fits its profiles (prefill a={pre[0]:.2f} ms, "
          f"b={pre[1]:.4f} ms/token, c={pre[2]:.2e} ms/token^2), its vLLM workers chunking prefill to the engine's "
          f"256-token budget, its least-loaded dispatch across the engines, Ray delay off. Load average (1 min) "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after this run, on {os.cpu_count()} cores.", "",
          *markdown_table(["rate/s", "metric (ms)", "measured", "flexmesh", "simdistserve", "nearer"], rows), "",
          f"- nearer the measurement: flexmesh in {wins['flexmesh']} of {len(verdicts)} cells, simdistserve in "
          f"{wins['simdistserve']}, {wins['tie']} within 1% of each other; median |error| flexmesh {med_f:.0%}, "
          f"simdistserve {med_d:.0%}: {overall} nearer overall (no bound is set: issue 54 asks which is nearer)",
          "- TPOT is flexmesh's (first token excluded: (finish - first token) / (tokens - 1)) in every column, "
          "computed from each simulator's first-token and finish times; simdistserve's own TPOT divides by all "
          "tokens.", "",
          f"No measurement: OPT-13B (fp16) on one A100-80GB, TP1, the same window (OPT-13B's context is 2048 "
          f"too) at {', '.join(f'{r:g}' for r in a100_rates)} requests/s (around flexmesh's knee), vLLM-like "
          "(2048 tokens per iteration, chunked prefill, 256 requests). simdistserve uses its shipped vLLM "
          "profile (DistServe's fit to vLLM on that GPU, Ray delay on as shipped); flexmesh prices the catalogue's "
          "A100-80GB analytically. Neither is checked here: this shows only how far apart they lie.", "",
          *markdown_table(["rate/s", "metric (ms)", "flexmesh p50", "flexmesh p90", "simdistserve p50",
                           "simdistserve p90", "p50 ratio"], a100)]
    print("\n".join(md))
    if not args.no_record:
        record("serve_peer", "\n".join(md), headline=f"nearer the engine: {overall} (median |error| flexmesh "
               f"{med_f:.0%}, simdistserve {med_d:.0%}; {wins['flexmesh']}/{wins['simdistserve']}/{wins['tie']} "
               f"cells of {len(verdicts)}); load {load_before[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
