"""Serving prices against real engine runs on GPUs: each shipped run's very requests replayed through `serve simulate`.

A run under ``bench/data/serve_gpu/<run>/`` (its README says what ran, where and at which commit) holds the plan an
engine served on a GPU and every request as it was served there. This bench replays those requests (their arrivals,
prompt and output lengths, nothing scaled) through ``flexmesh serve simulate --plan`` under each engine description
and sets the priced TTFT and TPOT beside the measured ones: the description of the engine that ran, and vLLM's for
comparison. The figures move when the prices do (the measured side is fixed). A description whose per-iteration
overhead was fitted to a replay's logged iterations (its source names the file: ``transformers``' is the H200
run's 4 req/s replay) is marked in-sample on that replay; the run's other replays are held out from it (the same
engine, model and machine at another rate).

Run: ``OMP_NUM_THREADS=1 python -m bench.serve_gpu [--no-record]``
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from pathlib import Path

from bench._results import markdown_table, record

DEPENDS_ON = ("flexmesh", "bench/data/serve_gpu")

RUNS = Path(__file__).resolve().parent / "data" / "serve_gpu"
ENGINES = ("transformers", "vllm")  # the engine that ran (flexmesh's own), and vLLM's description


def replays(run: Path) -> list[tuple[float, Path]]:
    """The run's replays: (its nominal rate, its requests file), slowest first."""
    files = sorted(run.glob("requests-*.jsonl"), key=lambda p: float(p.stem.split("-", 1)[1]))
    return [(float(p.stem.split("-", 1)[1]), p) for p in files]


def measured(run: Path, rate: float) -> dict:
    """``serve bench``'s summary of the replay at ``rate`` (what the engine did)."""
    return next(r["summary"] for r in json.loads((run / "summary.json").read_text()) if r["rate"] == rate)


def priced(plan: Path, requests: Path, engine: str) -> dict:
    """``serve simulate --plan``'s summary of exactly these requests under ``engine``'s description."""
    from flexmesh.cli import main

    rows = [json.loads(line) for line in requests.read_text().splitlines() if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        trace.write_text("".join(json.dumps({k: r[k] for k in ("arrival_s", "prompt_tokens", "output_tokens")}) + "\n"
                                 for r in rows))
        arrivals = [r["arrival_s"] for r in rows]
        rate = (len(rows) - 1) / (max(arrivals) - min(arrivals))  # the trace's own: its arrivals unscaled
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["serve", "simulate", "--plan", str(plan), "--trace", str(trace), "--rate", repr(rate),
                         "--engine", engine, "--json"])
    if code != 0:
        raise SystemExit(f"serve simulate exited {code} on {requests}")
    d = json.loads(out.getvalue())
    return {"summary": d["runs"][0], "overhead": d["engine_overhead"]["source"], "workload": d["workload"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-record", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args(argv)
    rows, ratios, sources = [], {e: [] for e in ENGINES}, {}
    for run in sorted(p for p in RUNS.iterdir() if p.is_dir()):
        for rate, requests in replays(run):
            m = measured(run, rate)
            cells = [run.name, f"{rate:g}", str(m["requests"]),
                     f"{m['ttft']['p50'] * 1e3:.1f} / {m['tpot']['p50'] * 1e3:.1f}"]
            for engine in ENGINES:
                p = priced(run / "plan.json", requests, engine)
                sources[engine] = p["overhead"]
                s = p["summary"]
                r = (s["ttft"]["p50"] / m["ttft"]["p50"], s["tpot"]["p50"] / m["tpot"]["p50"])
                fitted = f"{run.name}/iterations-{rate:g}.json" in p["overhead"]
                ratios[engine].append((*r, fitted))
                cells.append(f"{s['ttft']['p50'] * 1e3:.1f} / {s['tpot']['p50'] * 1e3:.1f} ({r[0]:.2f}x / {r[1]:.2f}x"
                             f"{', in-sample' if fitted else ''})")
            rows.append(cells)
    lines = markdown_table(["run", "rate/s", "requests", "measured TTFT / TPOT p50 ms",
                            *[f"{e} description: priced ms (priced / measured)" for e in ENGINES]], rows)
    lines += ["", "Per-iteration overhead each description priced with: "
              + "; ".join(f"{e}: {sources[e]}" for e in ENGINES) + ".",
              "Each run's README (bench/data/serve_gpu/) says what ran: the engine, its device, its commit.", "",
              "Reproduce: `OMP_NUM_THREADS=1 python -m bench.serve_gpu`"]
    body = "\n".join(lines)
    print(body)
    first = ENGINES[0]
    headline = (f"{first} description over measured, p50 TTFT / TPOT: "
                + ", ".join(f"{t:.2f}x / {p:.2f}x{' (in-sample)' if fitted else ''}" for t, p, fitted in ratios[first])
                + f" ({len(ratios[first])} replays on GPUs)")
    if not args.no_record:
        record("serve_gpu", body, headline=headline)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
