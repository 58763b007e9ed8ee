"""bench/gpu_torchtitan.py on CPU (the tiny model): torchtitan's Llama3 trains the bench's steps and returns
bench.gpu's worker row, so the GPU comparison cannot rot between GPU runs. Skipped without torchtitan."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

# the package only: its models import names a torch older than theirs lacks until the worker binds them
# (bench.gpu_torchtitan.torch_shims), as on the GPU machine's torch 2.11
pytest.importorskip("torchtitan")

ROOT = Path(__file__).resolve().parent.parent


def _args(**kw) -> argparse.Namespace:
    base = {"cpu": True, "case": "256", "steps": 4, "compile": False, "hf_folder": None, "weights": None}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchtitan_worker_learns_a_repeated_step_and_returns_the_bench_row(monkeypatch):
    import bench.gpu
    import bench.gpu_torchtitan as titan

    # the same documents every step: the loss must fall as AdamW fits them
    monkeypatch.setattr(titan, "make_steps", lambda spec, case, steps: bench.gpu.make_steps(spec, case, 1) * steps)
    result = titan.torchtitan_worker(_args())
    assert {"setup_s", "steps", "kernel", "compiled", "predicted", "device", "peak_gib", "version",
            "config", "torch_shims"} <= set(result)
    assert result["version"] == "0.3.0" and result["device"] == "CPU" and result["compiled"] is False
    assert result["predicted"] == {} and result["peak_gib"] is None
    losses = [s["loss"] for s in result["steps"]]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.01, losses
    # the 256 case: 8 documents of 256 tokens in micro-batches of 1,024 tokens
    assert all(s["tokens"] == 8 * 256 and s["microbatches"] == 2 and s["time_s"] > 0 for s in result["steps"])
    assert "4x256" in result["config"] and "1024" in result["config"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchtitan_bench_runs_standalone_and_writes_json(tmp_path):
    out = tmp_path / "titan.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_torchtitan", "--cpu", "--case", "1024", "--steps", "2",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=550)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    # the 1024 case: 2 documents of 1,024 tokens, one per micro-batch; the loss starts near ln(vocab)
    assert [s["microbatches"] for s in result["steps"]] == [2, 2]
    assert all(s["tokens"] == 2048 for s in result["steps"])
    assert all(abs(s["loss"] - math.log(4096)) < 2.0 for s in result["steps"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cpu_stand_in_matches_torchtitans_flex_attention_forward():
    """The CPU stand-in (SDPA under the BlockMask's mask made dense) computes what torchtitan's FlexAttention does
    on a packed row of several documents (forward only: FlexAttention has no CPU backward)."""
    import torch
    from torchtitan.models.common.attention import FlexAttention

    import bench.gpu as gpu
    import bench.gpu_torchtitan as titan

    titan.torch_shims()
    spec, case = gpu.model_spec(True), gpu.CPU_CASES[0]
    docs = gpu.make_steps(spec, case, 1)[0]
    schedule = gpu.schedules(spec, gpu.make_plan(spec, case, "1xA100-80GB"), [docs], case.doc_len)[0]
    mb = schedule.groups[0].microbatches[0]
    assert len(mb) > 1  # several documents in the row: the document mask matters
    model = titan.build_model(spec, case.microbatch_tokens)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    kernel = FlexAttention.__dict__["compiled_flex_attn"]
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        ids, _, positions = titan.pack_row(docs, mb, case.microbatch_tokens)
        flex = model(ids, positions=positions, attention_masks=model.get_attention_masks(positions=positions))
        with titan.dense_flex_on_cpu():
            dense = model(ids, positions=positions, attention_masks=model.get_attention_masks(positions=positions))
        # the row read as one document: the first document's outputs stay, the later ones change
        whole = torch.arange(ids.shape[1])[None]
        one = model(ids, positions=whole, attention_masks=model.get_attention_masks(positions=whole))
    assert FlexAttention.__dict__["compiled_flex_attn"] is kernel  # the stand-in is undone on leaving
    assert torch.allclose(flex, dense, atol=1e-4, rtol=1e-4)
    first = len(docs[mb[0].seq_id])
    assert torch.allclose(one[0, :first], flex[0, :first], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(one[0, first:], flex[0, first:], atol=1e-2)
