"""The price band: each part's device-layer prices between the ends its measurements support, and serve simulate and
serve plan reporting their figures at both ends."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from flexmesh.cost.device.hardware import Hardware
from flexmesh.cost.inference.band import KERNEL_BOUND, MEASURED_TABLES, kernel_band, with_kernel_table
from flexmesh.data.requests import load_trace, window
from flexmesh.serve.layout.engine import engine_spec
from flexmesh.serve.layout.replicas import parse_replicas, place
from flexmesh.serve.layout.slo import parse_slo
from flexmesh.serve.metrics import summarize
from flexmesh.serve.simulator import Fleet
from flexmesh.spec import parse_cluster, parse_model
from flexmesh.spec.cluster import ClusterSpec, parse_mixed_cluster
from flexmesh.spec.devices import device

MODEL = parse_model("llama3.1-8b")


def test_a_part_with_its_own_tables_is_held_to_the_kernel_bound_and_a_borrowing_one_spans_the_tables():
    own = kernel_band(MODEL, device("H100"))
    assert own.own and (own.low, own.high) == pytest.approx((1 - KERNEL_BOUND, 1 + KERNEL_BOUND))
    # an Ampere part priced from the one Ampere table: that table's price, within the bound, but not its own
    a10g = kernel_band(MODEL, device("A10G"))
    assert not a10g.own and "a100_sxm" in a10g.why
    assert (a10g.low, a10g.high) == pytest.approx((1 - KERNEL_BOUND, 1 + KERNEL_BOUND))
    # a Turing part: no Turing table, so every architecture's, each scaled to the RTX 2080 Ti's datasheet
    rtx = kernel_band(MODEL, device("RTX-2080Ti"))
    assert not rtx.own and "no turing tables" in rtx.why
    assert rtx.low <= 1 - KERNEL_BOUND and rtx.high >= 1 + KERNEL_BOUND and (rtx.low, rtx.high) != (own.low, own.high)
    # the T4 has its own GEMM table (DeepBench's), so only its attention spans the tables: a narrower slow end
    t4 = kernel_band(MODEL, device("T4"))
    assert not t4.own and "no turing attention tables" in t4.why and t4.high < rtx.high
    # its fast end is a price some table gives it, less the bound: no table prices its prefill below that
    fp16 = parse_model("llama3.1-8b@fp16")

    def prefill(d):  # noqa: ANN001, ANN202
        return engine_spec("vllm").iteration(fp16, Hardware(ClusterSpec(1, 1, d), "fp16")).dense_s(2048)

    tables = [prefill(with_kernel_table(device("T4"), t)) for t in MEASURED_TABLES]
    assert min(tables) * (1 - KERNEL_BOUND) >= t4.low * prefill(device("T4")) * (1 - 1e-9)


def test_a_power_capped_part_reaches_down_to_its_tables_short_runs():
    # the T4's GEMM table timed short runs, faster than the rate its 70 W cap sustains: the fast end reaches them
    t4, v100 = device("T4"), device("V100-32GB")
    burst = replace(t4, sustained_tflops={})
    fp16 = parse_model("llama3.1-8b@fp16")

    def prefill(d):  # noqa: ANN001, ANN202
        return engine_spec("vllm").iteration(fp16, Hardware(ClusterSpec(1, 1, d), "fp16")).dense_s(2048)

    band = kernel_band(fp16, t4)
    assert prefill(burst) < prefill(t4) * (1 - KERNEL_BOUND)  # the cap slows it by more than the bound
    assert band.low * prefill(t4) <= prefill(burst) and "power cap" in band.short
    assert "power cap" not in kernel_band(fp16, v100).short  # no cap: no such end


def test_the_scale_multiplies_every_device_price_and_leaves_the_engines_cpu_time():
    hw = Hardware(parse_cluster("1x8xH100"))
    after = replace(engine_spec("vllm"), cpu_overlap=False)  # the CPU's time after the GPU's, not overlapped
    one, slow = (after.iteration(MODEL, hw, tp=2, scale=f) for f in (1.0, 1.25))
    over_slow = engine_spec("vllm").iteration(MODEL, hw, tp=2, scale=1.25)
    for decodes, context, chunks in ((16, 16_000, ()), (4, 4_000, [(0, 900)]), (0, 0, [(512, 2048)])):
        requests = decodes + len(chunks)
        cpu = one.cpu_s(requests)
        gpu = one.split_s(decodes, context, chunks) - cpu
        assert slow.split_s(decodes, context, chunks) - cpu == pytest.approx(1.25 * gpu, rel=1e-12)
        # overlapped, the larger of the two
        assert over_slow.split_s(decodes, context, chunks) == pytest.approx(max(1.25 * gpu, cpu), rel=1e-12)
    assert slow.decode_run_s(8, 8_000, 50) > one.decode_run_s(8, 8_000, 50)


def test_a_fleet_at_the_ends_of_its_band_is_faster_and_slower_on_the_same_requests():
    cluster = parse_mixed_cluster("2xH100")
    fleet = Fleet(MODEL, cluster, place(parse_replicas("2xtp1", cluster), cluster))
    work = window(load_trace("azure-conv"), first=120)
    slo = parse_slo("ttft=200ms,tpot=10ms")
    got = {end: summarize((fleet if end == "mid" else fleet.at_band(end)).run(work).records, slo, None)
           for end in ("low", "mid", "high")}
    assert got["low"].ttft["p50"] < got["mid"].ttft["p50"] < got["high"].ttft["p50"]
    assert got["low"].tpot["p50"] < got["mid"].tpot["p50"] < got["high"].tpot["p50"]
    assert got["low"].attainment >= got["mid"].attainment >= got["high"].attainment


def test_serve_simulate_and_serve_plan_report_the_band(capsys):
    from flexmesh.cli import main

    args = ["serve", "simulate", "--cluster", "1xH100+2xL4", "--replicas", "1xtp1@H100,1xtp2@L4", "--trace",
            "const:500:50", "--requests", "40", "--rate", "4", "--slo", "ttft=1s,tpot=100ms"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())  # a narrow console folds the line
    # the L4 borrows the L40S's tables and runs below them at its power cap's sustained rate: its band spans both
    assert re.search(r"price band \(H100-80GB x0\.88-1\.12 \(own tables\), "
                     r"L4 x0\.[1-7]\d-1\.12 \(ada tables, power cap\)\): SLO met", out)
    assert main([*args, "--json"]) == 0
    band = json.loads(capsys.readouterr().out)["band"]
    assert set(band["parts"]) == {"H100-80GB", "L4"} and band["parts"]["L4"]["why"].startswith("the spread")
    assert band["low"]["ttft"]["p50"] < band["high"]["ttft"]["p50"]
    assert main(["serve", "plan", "--cluster", "2xH100", "--requests", "200", "--slo", "ttft=1s,tpot=100ms",
                 "--budget", "14", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["band"]["low"]["goodput"] >= doc["score"]["goodput"] >= doc["band"]["high"]["goodput"] > 0
