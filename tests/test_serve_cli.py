"""`flexmesh serve simulate`: its JSON and files, and one-line errors (exit 2) for bad traces, clusters, replicas
and SLOs."""

from __future__ import annotations

import json

import pytest

from flexmesh.cli import main
from flexmesh.serve.metrics import read_records

SMALL = ["serve", "simulate", "--model", "llama3-8b", "--cluster", "2xH100", "--window", "0:60"]


def test_json_has_the_fleet_the_runs_and_the_cost(capsys):
    assert main(SMALL + ["--slo", "ttft=2s,tpot=100ms", "--rates", "10", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == "llama3-8b" and doc["cluster"] == "2xH100-80GB"
    assert [r["replica"] for r in doc["replicas"]] == ["tp1", "tp1"] and doc["gpus"] == {"H100-80GB": 2}
    assert doc["dollars_per_hour"] == pytest.approx(2 * 6.88)
    rates = [run["rate"] for run in doc["runs"]]
    assert rates[1] == 10.0 and rates[0] == pytest.approx(doc["workload"]["rate"])
    for run in doc["runs"]:
        assert run["requests"] == doc["workload"]["requests"] and 0 <= run["attainment"] <= 1
        assert run["ttft"]["p50"] <= run["ttft"]["p90"] <= run["ttft"]["p99"]
        assert run["dollars_per_m_output"] > 0
    assert doc["engine_overhead"]["fixed_s"] > 0 and "Vidur" in doc["engine_overhead"]["source"]


def test_out_writes_the_records_a_summary_and_plots(capsys, tmp_path):
    out = tmp_path / "o"
    assert main(SMALL + ["--rates", "5,20", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    # the table's header wraps at the width of the terminal it prints to (80 columns in CI)
    assert "TTFT ms" in text and "p99" in text and "simulated" in text
    records = read_records(out / "requests.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    assert len(records) == summary["workload"]["requests"] and {r.replica for r in records} == {0, 1}
    for png in ("timeline.png", "knee.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_goodput_and_disaggregation(capsys):
    argv = ["serve", "simulate", "--cluster", "1x2xH100+1x2xA100-40GB", "--replicas", "tp1-prefill@0,2xtp1-decode@1",
            "--trace", "const:1000:50", "--requests", "200", "--rate", "2", "--slo", "ttft=1s,tpot=50ms",
            "--goodput", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["role"] for r in doc["replicas"]] == ["prefill", "decode", "decode"]
    g = doc["goodput"]
    assert g["rate"] > 0 and g["bounded"] and len(g["points"]) == len(doc["runs"])  # the start rate listed once


@pytest.mark.parametrize("extra,says", [
    (["--trace", "no-such-trace"], "unknown trace 'no-such-trace'"),
    (["--cluster", "2xH1000"], "unknown device 'H1000'"),
    (["--cluster", "banana"], "unknown cluster 'banana'"),
    (["--cluster", "1x8x"], "unknown cluster '1x8x': write NODESxPERNODExDEVICE"),  # not a device named '8x'
    (["--cluster", "2x8x8"], "unknown cluster '2x8x8': write NODESxPERNODExDEVICE"),
    (["--slo", "ttft=fast"], "SLO 'ttft=fast' is not METRIC=TIME"),
    (["--slo", "latency=2s"], "is not METRIC=TIME"),
    (["--slo", "ttft=2,tpot=100ms"], "SLO 'ttft=2' gives no unit: write ttft=2ms or ttft=2s"),
    (["--slo", "tpot=100"], "vLLM's --goodput reads a bare number as milliseconds"),
    (["--goodput"], "--goodput needs --slo"),
    (["--replicas", "4xtp1"], "no group of 2xH100-80GB has that many left"),
    (["--replicas", "tp1-prefil"], "role 'prefil' is not one of aggregated, prefill, decode"),
    (["--replicas", "2xtp1-prefill"], "prefill replicas need decode replicas"),
    (["--router", "weights"], "--router weights needs --weights"),
    (["--router", "weights", "--weights", "1"], "one weight >= 0 per replica"),
    (["--window", "soon"], "is not START:END"),
    (["--trace", "const:100"], "is not const:PROMPT:OUTPUT"),
    (["--trace", "const:100:10"], "synthetic arrivals need a rate: give --rate"),
    (["--trace", "const:100:10", "--arrivals", "trace"], "constant lengths have no arrival times"),
    (["--trace", "mooncake"], "more than llama3-8b's context"),
    (["--max-seqs", "512", "--max-batched-tokens", "256"], "must be at least max-seqs"),
    (["--price", "H100"], "is not DEVICE=USD_PER_GPU_HOUR"),
    (["--engine-overhead", "slow"], "is not FIXED_MS[,PER_REQUEST_MS]"),
    (["--weights", "1,1"], "--weights weighs the weights router; the router here is round-robin"),  # was ignored
])
def test_bad_input_is_one_line_and_exit_2(capsys, extra, says):
    assert main(SMALL + extra) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_a_bound_no_engine_is_near_is_questioned(capsys):
    assert main(SMALL + ["--slo", "ttft=2s,tpot=100s", "--json"]) == 0
    err = capsys.readouterr().err
    assert "note: tpot 100 s: a token every 100 s is not a serving target; did you mean tpot=100ms?" in err
    assert main(SMALL + ["--slo", "ttft=2s,tpot=100ms", "--json"]) == 0
    assert "did you mean" not in capsys.readouterr().err


def test_a_bad_trace_file_names_its_row_and_field(capsys, tmp_path):
    p = tmp_path / "mine.csv"
    p.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,2\n1,ten,2\n")
    assert main(["serve", "simulate", "--cluster", "1xH100", "--trace", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "mine.csv row 3: field 'prompt_tokens' is 'ten'" in err and len(err.splitlines()) == 1


def test_a_sharegpt_file_is_simulated_at_the_rate_given(capsys, tmp_path):
    convs = [{"conversations": [{"from": "human", "value": "q" * (40 + 8 * i)}, {"from": "gpt", "value": "a" * 200}]}
             for i in range(30)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    assert main(["serve", "simulate", "--cluster", "1xH100", "--trace", str(path), "--json"]) == 2
    err = capsys.readouterr().err
    assert "need a rate: give --rate REQ_PER_S (the trace 'sharegpt.json' has no arrival times)" in err
    assert main(["serve", "simulate", "--cluster", "1xH100", "--trace", str(path), "--rate", "4", "--json"]) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert doc["runs"][0]["requests"] == 30 and doc["runs"][0]["rate"] == pytest.approx(4, rel=0.6)
    assert "note: sharegpt.json: ShareGPT conversations have no arrival times" in out.err


def test_a_long_simulation_says_how_it_goes_whatever_its_size(monkeypatch, capsys):
    """Not its request count but its time decides: a run is never silent longer than PROGRESS_EVERY_S (here 0,
    so every report of the simulator's prints a line, with what is left)."""
    import flexmesh.commands.serve_simulate as serve_simulate
    import flexmesh.serve.simulator as simulator
    from flexmesh.cli import main

    monkeypatch.setattr(serve_simulate, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(simulator, "PROGRESS_S", 0.0)
    assert main(["serve", "simulate", "--trace", "const:300:20", "--requests", "40", "--rate", "5",
                 "--max-batched-tokens", "16", "--max-seqs", "2", "--json"]) == 0
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("simulating: ")]
    assert len(lines) > 3 and all("of 40 requests of this run done" in x for x in lines)
    assert any("s left in it" in x for x in lines)


def test_a_replay_that_would_take_days_is_refused_before_an_engine_starts(capsys):
    pytest.importorskip("aiohttp")
    from flexmesh.cli import main

    assert main(["serve", "bench", "--rate", "4,1e-6", "--requests", "20"]) == 2
    err = capsys.readouterr().err
    assert "at 1e-06 req/s the window's 20 requests arrive over" in err and "raise --rate" in err
    assert "starting" not in err  # nothing was started


def test_a_fleet_too_large_to_simulate_is_one_line(capsys):
    from flexmesh.cli import main
    from flexmesh.serve.simulator import MAX_REPLICAS

    assert main(["serve", "simulate", "--cluster", f"{MAX_REPLICAS // 8 + 1}x8xH100", "--requests", "10"]) == 2
    err = capsys.readouterr().err
    assert f"more than the {MAX_REPLICAS:,} one simulation holds" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv,says", [
    (["serve", "plan", "--rate", "5", "--buckets", "512:128=1", "--trace", "azure-code"], "--trace shapes a trace's"),
    (["serve", "plan", "--rate", "5", "--buckets", "512:128=1", "--output-edges", "128"], "--output-edges shapes"),
])
def test_flags_that_would_be_ignored_beside_buckets_are_refused(capsys, argv, says):
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_serve_plan_check_refuses_an_objective(tmp_path, capsys):
    from flexmesh.serve.export import EXAMPLE_PLAN

    (tmp_path / "p.json").write_text(EXAMPLE_PLAN)
    assert main(["serve", "plan", "--check", str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    assert main(["serve", "plan", "--check", str(tmp_path / "p.json"), "--rate", "5"]) == 2
    assert "--check validates a plan file as it is; --rate asks for a new plan" in capsys.readouterr().err
