"""The request simulator's speed (requests a minute on one core) and Mooncake's prefix reuse.

Speed: ``flexmesh.serve.simulator.Fleet.run`` timed alone (the fleet built and the workload made before), the
fastest of a few runs (bench._results.fastest), on:

- (a) Llama-3.1-8B on 8 H100 (8 replicas, tp 1), 100,000 requests with the Azure 2023 conversation trace's
  lengths at 50 requests/s (Poisson): a busy fleet below its knee;
- (b) the same fleet with the conversation trace as it is (19,366 requests at its own ~5.5/s): a quiet fleet,
  where each request decodes mostly alone (the most iterations per request);
- (c) prefill/decode disaggregation on 1x8xH100+2x8xA100-40GB (2 tp4 prefill replicas on the H100s, 4 tp4
  decode replicas on the A100s), 50,000 requests at 20/s: every request handed off over the cluster's link;
- (d) Mooncake's conversation trace (12,031 requests, prompts up to 126K tokens) with Llama-3.1-8B on 8 H100
  (4 replicas, tp 2), prefix caching over its hash_ids.

Target: >= 100,000 requests a minute on one core. Reuse: the fraction of Mooncake's prompt blocks an
unbounded prefix cache serves (0.366 expected, the trace's published figure) and the hit rate of LRU caches
of bounded capacity (flexmesh.data.prefix_reuse).

Usage: ``OMP_NUM_THREADS=1 python -m bench.serve_sim [--no-record]``.
"""

from __future__ import annotations

import argparse
import os

from rich.console import Console
from rich.table import Table

from bench._results import fastest, markdown_table, record
from flexmesh.cost.inference.memory import kv_bytes_per_token
from flexmesh.data.prefix_reuse import block_reuse, lru_hit_rates
from flexmesh.data.requests import load_trace, with_arrivals
from flexmesh.serve.layout.replicas import parse_replicas, place
from flexmesh.serve.metrics import summarize
from flexmesh.serve.simulator import Fleet
from flexmesh.spec.cluster import parse_mixed_cluster
from flexmesh.spec.model import parse_model

# The code this bench's figures depend on: a change there makes its record out of date.
DEPENDS_ON = ("flexmesh/serve", "flexmesh/layout/enums.py", "flexmesh/cost/inference", "flexmesh/cost/device",
              "flexmesh/data/requests.py", "flexmesh/data/prefix_reuse.py", "flexmesh/data/traces",
              "flexmesh/schedule/dispatch.py", "flexmesh/spec", "flexmesh/errors.py", "flexmesh/files.py",
              "flexmesh/inputs.py", "flexmesh/units.py")
TARGET_PER_MIN = 100_000
LRU_BLOCKS = (1_000, 4_000, 16_000, 32_000, 64_000, 128_000)


def cases() -> list[tuple[str, str, str, str, object]]:
    conv = load_trace("azure-conv")
    return [
        ("(a) busy", "llama3.1-8b", "8xH100", "8xtp1", with_arrivals(conv, 50.0, seed=0, n=100_000)),
        ("(b) quiet", "llama3.1-8b", "8xH100", "8xtp1", conv),
        ("(c) prefill/decode", "llama3.1-8b", "1x8xH100+2x8xA100-40GB", "2xtp4-prefill@0,4xtp4-decode@1",
         with_arrivals(conv, 20.0, seed=0, n=50_000)),
        ("(d) mooncake", "llama3.1-8b", "8xH100", "4xtp2", load_trace("mooncake")),
    ]


def speed_rows() -> list[list[str]]:
    rows = []
    for label, model, cluster, replicas, workload in cases():
        c = parse_mixed_cluster(cluster)
        fleet = Fleet(parse_model(model), c, place(parse_replicas(replicas, c), c))
        _, out, secs = fastest(lambda: None, lambda _, f=fleet, w=workload: f.run(w), label)  # type: ignore[misc]
        s = summarize(out.records)
        per_min = len(out.records) / secs * 60
        hits = [r.prefix_hit_rate for r in out.replicas if r.prefix_hit_rate is not None]
        rows.append([label, f"{model} on {cluster}, {replicas}", f"{len(out.records):,}", f"{out.events:,}",
                     f"{secs:.2f}", f"{per_min:,.0f}", "PASS" if per_min >= TARGET_PER_MIN else "FAIL",
                     f"{s.ttft['p50'] * 1e3:.0f} / {s.ttft['p99'] * 1e3:.0f}",
                     f"{s.tpot['p50'] * 1e3:.1f} / {s.tpot['p99'] * 1e3:.1f}",
                     f"{sum(hits) / len(hits):.1%}" if hits else "-"])
    return rows


def reuse_rows() -> tuple[float, list[list[str]]]:
    reqs = load_trace("mooncake").requests
    kv_gib = 512 * kv_bytes_per_token(parse_model("llama3.1-8b")) / 2**30  # one 512-token block of Llama-3.1-8B
    rates = lru_hit_rates(reqs, LRU_BLOCKS)
    return block_reuse(reqs), [[f"{b:,}", f"{b * 512 / 1e6:.1f}M", f"{b * kv_gib:,.0f}", f"{h:.3f}"]
                               for b, h in zip(LRU_BLOCKS, rates)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    head = ["case", "fleet", "requests", "loop steps", "s", "requests/min", f">= {TARGET_PER_MIN:,}",
            "TTFT ms p50/p99", "TPOT ms p50/p99", "prefix hits"]
    rows = speed_rows()
    reuse, curve = reuse_rows()
    load = os.getloadavg()[0]
    console = Console()
    table = Table(*head, title=f"simulator speed, one core (load average {load:.1f} on {os.cpu_count()} cores)")
    for r in rows:
        table.add_row(*r)
    console.print(table)
    rhead = ["LRU capacity (512-token blocks)", "tokens", "Llama-3.1-8B KV GiB", "block hit rate"]
    curve_table = Table(*rhead, title=f"Mooncake conversation: unbounded prefix cache reuses {reuse:.3f} of blocks")
    for r in curve:
        curve_table.add_row(*r)
    console.print(curve_table)
    if not args.no_record:
        md = "\n".join(markdown_table(head, rows))
        md += (f"\n\nOne core (the simulator is single-threaded), fastest of 3 runs of `Fleet.run` alone (fleet and "
               f"workload made before), load average {load:.1f} on {os.cpu_count()} cores while measuring (the "
               "machine is shared). Loop steps: events the simulator handled (arrivals, iterations it could not run "
               "straight on, transfers); a decode-only run of iterations before the next event counts as one. "
               "Latencies as simulated (the analytic pricing with vLLM's engine overhead from Vidur's A100 profile; "
               "not yet checked against measured GPU runs).\n\n")
        md += f"Mooncake conversation trace, unbounded prefix cache over its hash_ids: block reuse **{reuse:.3f}** " \
              f"(expected 0.366). LRU caches of bounded capacity (one cache for the whole trace):\n\n"
        md += "\n".join(markdown_table(rhead, curve)) + "\n"
        slowest = min(float(r[5].replace(",", "")) for r in rows)
        record("serve_sim", md, headline=f"slowest case {slowest:,.0f} requests/min on one core (target "
               f">= {TARGET_PER_MIN:,}); Mooncake block reuse {reuse:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
