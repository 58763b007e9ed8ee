"""Sliding-window models against transformers: the same logits in fp32 (tiny random models, CPU).

A Mistral whose window is shorter than the documents, and a Qwen2 with ``use_sliding_window`` whose
first layers stay full (``max_window_layers``). flexmesh reads the config transformers writes, loads
its weights by the Hugging Face names, and runs packed documents; transformers runs each document
alone. Skipped when transformers is not installed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from flexmesh.layout.step import Piece  # noqa: E402 - after the importorskip
from flexmesh.runtime.model.packing import pack_microbatch  # noqa: E402
from flexmesh.runtime.model.transformer import build_model  # noqa: E402
from flexmesh.runtime.state.weights import hf_name  # noqa: E402
from flexmesh.spec import from_hf_config  # noqa: E402

torch.set_num_threads(1)

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
LENGTHS = (23, 5, 40)  # longer and shorter than the windows below


def _hf_model(kind: str, **kw):
    cls = {"mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    cfg = cls[0](**BASE, **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls[1](cfg).eval().float()
    with torch.no_grad():  # random norms and biases too, so a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def _flexmesh_logits(hf_model, tmp_path, docs):
    (tmp_path / "config.json").write_text(json.dumps(hf_model.config.to_dict()))
    spec = from_hf_config(tmp_path)
    model = build_model(spec, "cpu", torch.float32)
    hf_state = hf_model.state_dict()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(hf_state[hf_name(name)])
    batch = pack_microbatch(docs, tuple(Piece(i, 0, len(d)) for i, d in enumerate(docs)))
    with torch.no_grad():
        return spec, model(batch.tokens, batch)[0]


def _compare(hf_model, tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, BASE["vocab_size"], n) for n in LENGTHS]
    spec, got = _flexmesh_logits(hf_model, tmp_path, docs)
    at = 0
    for d in docs:
        with torch.no_grad():
            want = hf_model(torch.as_tensor(d)[None]).logits[0]
        part = got[at:at + len(d)]
        at += len(d)
        err = ((part - want).abs().max() / want.abs().max()).item()
        assert err <= 1e-5, f"relative error {err}"
    return spec


def test_mistral_sliding_window_matches_transformers(tmp_path):
    model = _hf_model("mistral", sliding_window=7)
    spec = _compare(model, tmp_path)
    assert spec.attention_windows == (7, 7, 7)


def test_qwen2_sliding_window_matches_transformers(tmp_path):
    model = _hf_model("qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1)
    spec = _compare(model, tmp_path)
    assert spec.attention_windows == (None, 6, 6)


def test_window_changes_the_logits(tmp_path):
    """The cases above test something: without the window transformers' logits differ."""
    rng = np.random.default_rng(0)
    d = torch.as_tensor(rng.integers(0, BASE["vocab_size"], 40))[None]
    with torch.no_grad():
        a = _hf_model("mistral", sliding_window=7)(d).logits
        b = _hf_model("mistral", sliding_window=None)(d).logits
    assert not torch.allclose(a, b, rtol=1e-3, atol=1e-3)
