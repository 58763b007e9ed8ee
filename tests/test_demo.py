"""`flexmesh demo --quick`: the README's main job, shortened, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import flexmesh_here, run_flexmesh_here


@pytest.mark.slow
@pytest.mark.timeout(900)  # about 90 s on a quiet 2-core machine; well above it for a loaded one
def test_quick_demo_writes_report(tmp_path: Path, monkeypatch):
    # The demo in this process, its children's runs as ranks forked from the fork server (the launchers'
    # start-up, seconds a run, is what other tests check: test_train_cli, test_failures, test_profile_cli).
    from flexmesh.runtime import launch

    monkeypatch.setattr(launch, "run_flexmesh", run_flexmesh_here)
    out = tmp_path / "demo"
    proc = flexmesh_here("demo", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (out / "report.md").read_text()
    for heading in ("## 1. Plan", "## 2. Simulated per-step policies", "## 3. Measured training"):
        assert heading in report
    images = [line.split("](")[1].rstrip(")") for line in report.splitlines() if line.startswith("![")]
    assert len(images) >= 6
    for rel in images:
        assert (out / rel).stat().st_size > 1000, rel
    runs = {}
    for label in ("fixed", "adaptive"):
        rows = [json.loads(x) for x in (out / "runs" / label / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        for r in rows:
            assert len(r["busy_s"]) == 2 and all(0 < b <= r["step_time_s"] for b in r["busy_s"])
            assert r["predicted_step_time_s"] > 0
        runs[label] = rows
    assert {r["requested_policy"] for r in runs["adaptive"]} == {"milp"}
    # The correctness contract on real data: the same batches under either schedule, the same losses.
    for a, b in zip(runs["fixed"], runs["adaptive"]):
        assert a["tokens"] == b["tokens"]
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"])
    # The slow-rank part: rank 1 emulated at half speed in both runs, speeds measured every step.
    assert "emulated** at 0.5x" in report
    for label in ("static", "adaptive"):
        rows = [json.loads(x) for x in (out / "stragglers" / "runs" / label / "metrics.jsonl").read_text().splitlines()]
        assert all(r["emulated_speed"] == [1.0, 0.5] and len(r["speed"]) == 2 for r in rows)
        if label == "static":  # --no-replan: the schedules never change
            assert all(r["assumed_speed"] == [1.0, 1.0] for r in rows)
    # The two parts that run their trainings silently say a line as each run ends.
    for line in ("static: 4 steps,", "adaptive: 4 steps,", "static: 2 steps,", "laer: 2 steps,"):
        assert line in proc.stdout, line
    # The experts part: the same losses whatever the placement, a routing trace each, the experts page.
    assert "## A mixture of experts: static against load-following placement" in report
    moe = {label: [json.loads(x) for x in (out / "experts" / "runs" / label / "metrics.jsonl").read_text().splitlines()]
           for label in ("static", "laer")}
    assert [r["loss"] for r in moe["static"]] == pytest.approx([r["loss"] for r in moe["laer"]], rel=1e-6)
    for label in ("static", "laer"):
        routing = (out / "experts" / "runs" / label / "routing.jsonl").read_text().splitlines()
        assert len(routing) == 2 * 4  # 2 steps of 4 MoE layers
        assert f"experts_{label}.png" in report
    # The serving part: a plan on a mixed GPU catalogue, simulated, its layout run here; its page and plots.
    assert "## Serving" in report and "[serving](serving/serving.md)" in report
    page = (out / "serving" / "serving.md").read_text()
    assert "| measured |" in page and "| predicted |" in page
    assert (out / "serving" / "measured_vs_predicted.png").stat().st_size > 1000
    assert (out / "serving" / "requests.jsonl").read_text().count("\n") == 30


def test_demo_places_its_steps_one_process_per_gpu(monkeypatch):
    """Where the demo's parts run for 0, 1, 2 and 4 visible GPUs with 4 processes (no GPU needed)."""
    import torch
    from rich.console import Console

    from flexmesh.commands.demo import demo_devices
    from flexmesh.errors import FlexmeshError
    from flexmesh.runtime.parallel import device as D

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    quiet = Console(quiet=True)
    want = {0: ("cpu", "cpu", None), 1: ("cpu", "cpu", "NVIDIA H100 80GB HBM3"),
            2: ("cpu", "cuda", "NVIDIA H100 80GB HBM3"), 4: ("cuda", "cuda", "NVIDIA H100 80GB HBM3")}
    for gpus, (multi, pair, gpu) in want.items():
        monkeypatch.setattr(D, "visible_gpus", lambda g=gpus: g)
        got = demo_devices("auto", 4, quiet)
        assert (got["multi"], got["pair"], got["gpu"]) == (multi, pair, gpu), gpus
        assert ("H100" in got["text"]) == bool(gpus)
        assert demo_devices("cpu", 4, quiet)["gpu"] is None  # --device cpu: nothing on a GPU
    monkeypatch.setattr(D, "visible_gpus", lambda: 0)
    with pytest.raises(FlexmeshError, match="no GPU is visible"):
        demo_devices("cuda", 4, quiet)


def test_report_names_the_gpu_of_the_one_gpu_run(tmp_path: Path):
    from flexmesh.report.demo import Report, gpu_section

    rows = [{"step": s, "loss": 9.0 - s, "tokens": 20000, "step_time_s": t, "busy_s": [t], "dtype": "bf16",
             "predicted_step_time_s": 0.1, "attention_kernel": "varlen", "microbatch_tokens": 32768,
             "peak_memory_gib": 3.5, "policy": "fixed"} for s, t in ((1, 40.0), (2, 0.1), (3, 0.1))]
    rep = Report("r", tmp_path)
    gpu_section(rep, {"name": "NVIDIA H100 80GB HBM3", "preset": "H100-80GB", "rows": rows})
    text = rep.write().read_text()
    assert "## One GPU: NVIDIA H100 80GB HBM3" in text and "`varlen`" in text and "H100-80GB device preset" in text
    assert "200,000" in text  # tokens/s after the compiling first step: 20000 tokens / 0.1 s


@pytest.mark.slow
def test_a_failed_part_names_itself_and_ends_with_the_childs_words():
    """The demo's parts run in children (flexmesh.runtime.launch.run_flexmesh, which the demo test above
    replaces): one that fails is a FlexmeshError saying which part, the command and what the child said."""
    from flexmesh.errors import FlexmeshError
    from flexmesh.runtime.launch import run_flexmesh

    with pytest.raises(FlexmeshError, match=r"(?s)demo step 'plan' failed \(exit 2\): flexmesh plan --model nope\n"
                                            r".*unknown model 'nope'"):
        run_flexmesh(["plan", "--model", "nope"], "demo step 'plan'")
