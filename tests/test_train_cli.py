"""`flexmesh train` end to end: --nproc launches torchrun, writes metrics.jsonl and checkpoints, resumes.

Also the errors a user meets first: a plan for another world size, a corpus with no documents.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIELDS = {"step", "loss", "grad_norm", "lr", "tokens", "label_tokens", "padded_tokens", "microbatches",
          "step_time_s", "tokens_per_s", "peak_memory_gib"}


def write_inputs(tmp: Path, world: int) -> tuple[Path, Path, Path]:
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    cfg = tmp / "config.json"
    cfg.write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 320, "torch_dtype": "float32",
        "max_position_embeddings": 512}))
    corpus = tmp / "corpus"
    corpus.mkdir()
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly boxing".split()
    for i in range(24):  # documents of very different lengths
        n = 5 + (i * 37) % 90
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(words[(i + j * 3) % len(words)] for j in range(n)))
    st = StagePlan(0, 2, (LayerStrategy.parse(f"tp1-dp{world}z3"), LayerStrategy.parse(f"tp1-dp{world}z2-ac")))
    plan = Plan(model=str(cfg), cluster=f"{world}xA100-80GB", world_size=world, pp=1, pipeline_schedule="1f1b",
                num_microbatches=1, seq_len=128, global_batch=4, stages=(st,))
    plan_path = tmp / "plan.json"
    plan.save(plan_path)
    return cfg, corpus, plan_path


def flexmesh(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "flexmesh", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_train_with_nproc_writes_metrics_and_resumes(tmp_path):
    _, corpus, plan = write_inputs(tmp_path, world=2)
    out = tmp_path / "run"
    common = ["train", "--nproc", "2", "--plan", str(plan), "--corpus", str(corpus), "--out", str(out),
              "--cache-dir", str(tmp_path / "cache"), "--checkpoint-every", "2", "--no-progress", "--lr", "1e-3"]
    first = flexmesh(*common, "--max-steps", "2")
    assert first.returncode == 0, first.stderr[-4000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert FIELDS <= set(rows[0])
    assert all(r["loss"] > 0 and r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert (out / "checkpoints" / "step_000002" / "manifest.json").is_file()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"

    second = flexmesh(*common, "--max-steps", "3")
    assert second.returncode == 0, second.stderr[-4000:]
    rows2 = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows2] == [1, 2, 3]  # resumed at 3, earlier lines kept once
    assert rows2[:2] == rows[:2]
    assert (out / "checkpoints" / "step_000003" / "manifest.json").is_file()


def test_plan_for_other_world_size_is_rejected(tmp_path, capsys):
    from flexmesh.cli import main

    _, corpus, plan = write_inputs(tmp_path, world=2)
    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in os.environ}
    try:
        rc = main(["train", "--plan", str(plan), "--corpus", str(corpus), "--max-steps", "1",
                   "--out", str(tmp_path / "o")])
    finally:
        os.environ.update(env)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            if k not in env:
                os.environ.pop(k, None)
    assert rc == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "is for 2 ranks but 1" in err and "--nproc 2" in err


def test_corpus_without_documents_is_rejected(tmp_path, capsys):
    from flexmesh.cli import main

    _, _, plan = write_inputs(tmp_path, world=1)
    empty = tmp_path / "empty"
    empty.mkdir()
    saved = dict(os.environ)
    try:
        rc = main(["train", "--plan", str(plan), "--corpus", str(empty), "--max-steps", "1",
                   "--out", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "cache")])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert rc == 2
    assert "no documents" in " ".join(capsys.readouterr().err.split())
