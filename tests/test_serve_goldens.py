"""Goldens of serving: what ``serve simulate`` and ``serve plan`` print (``--json``) and ``serve export`` writes, and
the simulator's records of test-time scaling and of the engines' twin, recorded before serving's house was rebuilt
(tests/golden/serving.json, by ``python tests/golden/record.py serving``, at the commit named in the file): a
refactoring of serving may move code, not numbers.

What they promise on every machine: every decision (replicas, routes, iterations, tokens, preemptions, the plan's
groups and shares, the launch scripts) exactly; every float within :data:`helpers.REL` of the recorded one (the
device layer's prices are numpy expressions whose last bit follows the host's SIMD path). How long a run took is
left out.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import assert_matches

GOLDEN = Path(__file__).resolve().parent / "golden" / "serving.json"

SIMULATE = {  # docs/cli-serve.md's examples and the policies beside them
    "aggregated": ["--cluster", "2xH100", "--window", "0:300", "--slo", "ttft=2s,tpot=100ms"],
    "rates-goodput": ["--cluster", "2xH100", "--window", "0:300", "--slo", "ttft=1s,tpot=50ms", "--rates", "10,20,40",
                      "--goodput"],
    "disaggregated": ["--cluster", "1x8xH100+2x8xA100-40GB", "--replicas", "2xtp4-prefill@H100,4xtp4-decode@1",
                      "--trace", "const:2000:200", "--rate", "20", "--requests", "2000", "--slo", "ttft=1s,tpot=50ms"],
    "mooncake-least-kv": ["--cluster", "8xH100", "--replicas", "4xtp2", "--trace", "mooncake", "--window", "0:600",
                          "--router", "least-kv"],
    "tie-long-to-kv": ["--cluster", "4xH100", "--replicas", "4xtp1", "--trace", "azure-code", "--window", "0:120",
                       "--rate", "30", "--queue", "tie", "--predictor", "noisy", "--router", "long-to-kv"],
    "sjf-small-kv": ["--cluster", "2xL4", "--replicas", "2xtp1", "--window", "0:60", "--rate", "6", "--kv-blocks",
                     "300", "--queue", "sjf", "--predictor", "oracle", "--router", "least-work"],
}
PLAN = {
    "mixed": ["--cluster", "2xH100+4xL4", "--requests", "300", "--slo", "ttft=1s,tpot=100ms", "--budget", "20"],
}
# A cascade's plan (as `serve plan --cascade llama3.1-8b,llama3.1-70b` wrote one), simulated on a trace's window:
# planning a cascade on a few hundred requests finds no rate it fails at, and picks among near-equal moves.
CASCADE = Path(__file__).resolve().parent / "golden" / "cascade-plan.json"
CASCADE_SIMULATE = ["--trace", "azure-conv", "--window", "0:300", "--rate", "6"]


def _cli(argv: list[str]) -> dict:
    from flexmesh.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0, argv
    return json.loads(out.getvalue())


def _simulated(d: dict) -> dict:
    d.pop("simulator", None)  # events and wall seconds: how the simulator ran, not what it found
    return d


def compute_serving() -> dict:
    from flexmesh.data.requests import Request, Workload, at_rate, load_trace, scale_to_context, window
    from flexmesh.serve.engine.config import EngineConfig
    from flexmesh.serve.engine.twin import twin_fleet

    out: dict = {"simulate": {}, "plan": {}, "plan-simulated": {}, "export": {}, "records": {}}
    for name, argv in SIMULATE.items():
        out["simulate"][name] = _simulated(_cli(["serve", "simulate", *argv, "--json"]))
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv in PLAN.items():
            d = _cli(["serve", "plan", *argv, "--json", "--out", f"{tmp}/{name}"])
            d.pop("timing")  # seconds the planner took
            out["plan"][name] = d
            plan = f"{tmp}/{name}/plan.json"
            out["plan-simulated"][name] = _simulated(_cli(["serve", "simulate", "--plan", plan, "--json"]))
        out["plan-simulated"]["cascade"] = _simulated(_cli(["serve", "simulate", "--plan", str(CASCADE),
                                                            *CASCADE_SIMULATE, "--json"]))
        from flexmesh.cli import main

        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["serve", "export", "--plan", f"{tmp}/mixed/plan.json", "--engine", "both", "--model-path",
                         "/models/llama-3.1-8b", "--out", f"{tmp}/launch"]) == 0
        out["export"] = {p.name: p.read_text() for p in sorted(Path(tmp, "launch").iterdir())}

    class Linear:  # 1 ms an iteration, 0.1 ms a token
        def iteration_s(self, batch):
            return 1e-3 + 1e-4 * sum(n for _, n in batch)

    cfg = EngineConfig(num_blocks=2048, page_size=16, max_batch_tokens=256, max_requests_per_batch=8)
    win = window(scale_to_context(load_trace("azure-conv"), 4096), 0.0, first=200)
    branches = Workload(tuple(Request(i, 0.05 * i, 16 + i, 120, branches=4, needed=2,
                                      branch_tokens=(40 + i, 7 + i, 90, 13)) for i in range(12)), "branches")
    for name, work, opts in (("twin-fcfs", at_rate(win, 20.0), {}),
                             ("twin-branches", branches, {"cancel_lag": 1})):
        result = twin_fleet(cfg, 2, Linear()).run(work, **opts)
        out["records"][name] = [json.loads(json.dumps(r.to_json())) for r in result.records]
    # where this run kept its files and which Python checked the scripts are this machine's, not results
    text = json.dumps(out).replace(tmp, "TMP").replace(json.dumps(sys.executable)[1:-1], "PYTHON")
    text = text.replace(json.dumps(str(GOLDEN.parent))[1:-1], "GOLDEN")
    return json.loads(text)


@pytest.mark.slow
def test_serving_goldens_hold():
    recorded = json.loads(GOLDEN.read_text())
    got = json.loads(json.dumps(compute_serving()))
    assert set(got) == set(recorded["values"])
    for key, want in recorded["values"].items():
        assert_matches(got[key], want, f"serving/{key} (recorded at {recorded['commit']})")
