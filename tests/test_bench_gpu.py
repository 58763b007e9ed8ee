"""bench/gpu.py's CPU mode (a tiny model), so the GPU benchmark cannot rot between GPU runs: both
systems train the same documents from the same weights, so their first losses agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_bench_cpu_mode_runs_both_systems_on_the_same_batches(monkeypatch, capsys):
    # The bench's main in this process and each worker (`python -m bench.gpu worker ...`, run by
    # bench.gpu.run_worker) as a process forked by the fork server, where torch is imported already: the
    # same commands, files and results, without an interpreter importing torch for the bench and each worker.
    from helpers import launch

    import bench.gpu as G

    real_run = subprocess.run

    def run(cmd, *args, **kw):
        if list(cmd[1:4]) == ["-m", "bench.gpu", "worker"]:
            env = {k: v for k, v in (kw.get("env") or {}).items() if k not in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED")}
            return launch(1, list(cmd[3:]), script="-m bench.gpu", timeout=kw.get("timeout") or 850, env=env)
        return real_run(cmd, *args, **kw)

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.chdir(ROOT)
    # one step: what is checked is the first step's loss, packing and the figures of a timed step
    # (bench.gpu.summarise times every step where there are no more than its warm-up steps)
    monkeypatch.setattr(sys, "argv", ["bench.gpu", "--cpu", "--no-record", "--steps", "1", "--cases", "256,mix",
                                      "--cluster", "1xA100-80GB"])
    G.main()
    out, err = capsys.readouterr()
    proc = subprocess.CompletedProcess(sys.argv, 0, out, err)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == {"256/transformers", "256/flexmesh", "mix/transformers", "mix/flexmesh"}
    for case in ("256", "mix"):
        hf, fm = result[f"{case}/transformers"], result[f"{case}/flexmesh"]
        # the same weights, tokens and micro-batches: the loss before any update is the same (fp32)
        assert fm["loss1"] == pytest.approx(hf["loss1"], rel=1e-5)
        assert fm["microbatches"] == hf["microbatches"] >= 1
        assert fm["tokens_per_s"] > 0 and hf["tokens_per_s"] > 0 and fm["tflops"] > 0
        assert fm["predicted"]["preset"] > 0 and hf["predicted"] == {}
    assert result["mix/flexmesh"]["microbatches"] > 1  # the long-tail mix packs into several micro-batches
    assert "tiny on CPU" in proc.stdout
