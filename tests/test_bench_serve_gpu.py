"""bench/serve_gpu.py: a shipped GPU run's requests are replayed through `serve simulate` as they were served."""

from __future__ import annotations

import json

from bench.serve_gpu import RUNS, measured, priced, replays


def test_each_shipped_replay_is_priced_on_its_own_requests_unscaled():
    runs = [p for p in RUNS.iterdir() if p.is_dir()]
    assert runs
    for run in runs:
        assert (run / "README.md").exists() and (run / "plan.json").exists()
        for rate, requests in replays(run):
            served = [json.loads(line) for line in requests.read_text().splitlines() if line.strip()]
            m = measured(run, rate)
            assert m["requests"] == len(served)
            p = priced(run / "plan.json", requests, "transformers")
            assert p["workload"]["requests"] == len(served)
            assert p["workload"]["name"].endswith("@x1")  # the arrivals as measured, not rescaled to a rate
            assert p["summary"]["ttft"]["p50"] > 0 and p["summary"]["tpot"]["p50"] > 0
