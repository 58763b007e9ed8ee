"""`flexmesh demo --quick`: the README's main job, shortened, end to end in a child process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from flexmesh.runtime.launch import child_env


def test_quick_demo_writes_report(tmp_path: Path):
    out = tmp_path / "demo"
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "flexmesh", "demo", "--quick", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
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
