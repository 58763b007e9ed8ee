"""A mixture of experts from Hugging Face weights, trained with experts over data ranks, exported back.

transformers writes a tiny random Mixtral and Qwen2-MoE (``save_pretrained``: one key per expert);
`flexmesh train` starts from those weights with the experts sharded over 2 data ranks, for 2 steps;
`flexmesh export` writes the checkpoint back in the layout it was read in (per expert, Mixtral's
``block_sparse_moe`` names) and, asked, fused. transformers must load both with the logits of the
flexmesh model built from the checkpoint by torch's own DCP reader (fp32, 1e-5 relative).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import flexmesh_ranks, randomise_hf, rel_diff

from flexmesh.data.tokenizer import train_bpe

transformers = pytest.importorskip("transformers", reason="transformers is the reference; pip install -e .[dev]")

SHAPE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             num_experts_per_tok=2, max_position_embeddings=512)
MODELS = {
    "mixtral": dict(intermediate_size=96, num_local_experts=4),
    "qwen2_moe": dict(intermediate_size=80, moe_intermediate_size=48, num_experts=4,
                      shared_expert_intermediate_size=64),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    tmp = tmp_path_factory.mktemp("moe-export")
    corpus = tmp / "corpus"
    corpus.mkdir()
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly boxing".split()
    for i in range(16):
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(words[(i + j * 3) % len(words)] for j in range(5 + i * 7)))
    out = {}
    for family, over in MODELS.items():
        cfg = transformers.AutoConfig.for_model(family, **SHAPE, **over, dtype="float32")
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(cfg).float()
        randomise_hf(hf, seed=3)
        weights = tmp / family / "weights"
        hf.save_pretrained(weights)  # transformers 5 writes experts one key each
        # the weights' own tokenizer beside them, as a Hugging Face folder holds one (train takes it from there)
        train_bpe(corpus, vocab_size=SHAPE["vocab_size"], cache_dir=tmp / "cache").save(str(weights / "tokenizer.json"))
        st = LayerStrategy.parse("tp1-dp2z2")
        plan = Plan.uniform(model=str(weights / "config.json"), cluster="2xA100-80GB", world_size=2, pp=1,
                            pipeline_schedule="1f1b", virtual_stages=1, num_microbatches=2, seq_len=128,
                            global_batch=4, stages=(StagePlan(0, 2, (st, st)),))
        plan.save(tmp / family / "plan.json")
        run = tmp / family / "run"
        r = flexmesh_ranks(2, "train", "--plan", str(tmp / family / "plan.json"), "--weights", str(weights),
                           "--corpus", str(corpus), "--max-steps", "2", "--out", str(run), "--cache-dir",
                           str(tmp / "cache"), "--no-progress", "--lr", "1e-2")
        assert r.returncode == 0, r.stderr[-4000:]
        out[family] = (run, tmp / family / "plan.json", weights)
    return out


def _reference_logits(checkpoint: Path, spec, tokens: torch.Tensor, tmp: Path) -> torch.Tensor:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from flexmesh.layout.step import Piece
    from flexmesh.runtime.model.packing import pack_microbatch
    from flexmesh.runtime.model.transformer import build_model

    dcp_to_torch_save(str(checkpoint), str(tmp / "ref.pt"))
    model = build_model(spec, device="cpu").eval()
    model.load_state_dict(torch.load(tmp / "ref.pt", weights_only=False)["model"], strict=True)
    batch = pack_microbatch([tokens.numpy()], (Piece(0, 0, len(tokens)),))
    with torch.no_grad():
        return model(batch.tokens, batch)[0]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", list(MODELS))
def test_export_writes_back_the_layout_read(runs, family, tmp_path):
    from flexmesh.cli import main
    from flexmesh.spec import from_hf_config

    run, plan, weights = runs[family]
    checkpoint = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert json.loads((checkpoint / "manifest.json").read_text())["expert_layout"] == "per-expert"
    spec = from_hf_config(weights)
    tokens = torch.as_tensor(np.random.default_rng(0).integers(0, spec.vocab, 48))
    ref = _reference_logits(checkpoint, spec, tokens, tmp_path)
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    for layout, key in (("per-expert", f"model.layers.1.{block}.experts.3."), ("fused", "mlp.experts.gate_up_proj")):
        out = tmp_path / layout
        flags = [] if layout == "per-expert" else ["--expert-layout", "fused"]
        assert main(["export", "--checkpoint", str(run), "--out", str(out), "--plan", str(plan), *flags]) == 0
        keys = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert any(key in k for k in keys), (layout, sorted(keys)[:8])
        assert not any("balance_bias" in k for k in keys)
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            got = hf(tokens[None]).logits[0]
        assert rel_diff(got, ref) <= 1e-5, layout
        assert from_hf_config(out).moe == spec.moe
