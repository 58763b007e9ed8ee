"""The Llama-family model: construction, deterministic init, packed documents, RoPE, stages, tying."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from flexmesh.errors import SpecError
from flexmesh.layout.step import Piece
from flexmesh.runtime.model.packing import pack_microbatch
from flexmesh.runtime.model.transformer import Transformer, apply_rope, build_model, rope_cos_sin
from flexmesh.spec.model import ModelSpec, gpt

torch.set_num_threads(1)

SPEC = ModelSpec("t", num_layers=4, hidden=64, num_heads=4, num_kv_heads=2, ffn_hidden=96, vocab=256,
                 dtype="fp32", rope_theta=500.0)


def _docs(seed: int = 0, lengths=(9, 1, 25, 6)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, SPEC.vocab, n) for n in lengths]


def test_parameter_count_matches_spec_for_gqa_bias_and_tied():
    for spec in (SPEC, replace(SPEC, qkv_bias=True), replace(SPEC, tie_embeddings=True)):
        model = build_model(spec)  # meta: counting needs no memory
        assert sum(p.numel() for p in model.parameters()) == spec.total_params
    assert build_model(replace(SPEC, tie_embeddings=True)).output is None


def test_meta_then_init_matches_cpu_build_and_seed_matters():
    cpu = build_model(SPEC, "cpu")
    meta = build_model(SPEC)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.init_weights(0)
    for (n, a), (_, b) in zip(cpu.named_parameters(), meta.named_parameters()):
        assert torch.equal(a, b), n  # exact: every parameter seeded by its name: the same operations
    meta.init_weights(1)
    assert not torch.equal(cpu.layers["0"].attention.wq.weight, meta.layers["0"].attention.wq.weight)
    # norms start at one, so the model starts as a near-identity residual stack
    assert torch.equal(cpu.norm.weight, torch.ones(SPEC.hidden))


def test_init_is_independent_of_pipeline_split_and_wrappers():
    full = build_model(SPEC, "cpu")
    stage = build_model(SPEC)
    del stage.layers["0"], stage.layers["1"]
    stage.tok_embeddings = None
    stage.layers["2"] = checkpoint_wrapper(stage.layers["2"])
    stage.to_empty(device="cpu")
    stage.init_weights(0)
    # exact: every parameter seeded by its name: the same operations
    assert torch.equal(stage.layers["2"]._checkpoint_wrapped_module.feed_forward.w1.weight,
                       full.layers["2"].feed_forward.w1.weight)
    # exact: every parameter seeded by its name: the same operations
    assert torch.equal(stage.output.weight, full.output.weight)


def test_packed_documents_give_the_same_logits_as_each_document_alone():
    model = build_model(SPEC, "cpu")
    docs = _docs()
    pieces = tuple(Piece(i, 0, len(d)) for i, d in enumerate(docs))
    packed = pack_microbatch(docs, pieces)
    logits = model(packed.tokens, packed)
    assert logits.shape == (1, sum(map(len, docs)), SPEC.vocab)
    at = 0
    for i, d in enumerate(docs):
        alone = pack_microbatch(docs, (Piece(i, 0, len(d)),))
        torch.testing.assert_close(logits[:, at:at + len(d)], model(alone.tokens, alone), rtol=1e-5, atol=1e-5)
        at += len(d)


def test_positions_come_from_the_batch():
    model = build_model(SPEC, "cpu")
    docs = _docs()
    b = pack_microbatch(docs, (Piece(2, 0, 25),))
    shifted = replace(b, positions=b.positions + 7)
    # RoPE is relative: shifting every position of a document leaves attention unchanged ...
    torch.testing.assert_close(model(b.tokens, b), model(b.tokens, shifted), rtol=1e-4, atol=1e-5)
    # ... but positions out of order change it
    scrambled = replace(b, positions=b.positions.flip(-1))
    assert not torch.allclose(model(b.tokens, b), model(b.tokens, scrambled), atol=1e-4)


def test_rope_rotates_half_split_pairs_as_complex_numbers():
    torch.manual_seed(0)
    d, theta = 8, 10000.0
    x = torch.randn(1, 5, 3, d)
    pos = torch.tensor([[0, 1, 2, 10, 300]])
    cos, sin = rope_cos_sin(pos, d, theta, torch.float32)
    got = apply_rope(x, cos, sin)
    # pair (i, i + d/2) is the complex number x_i + 1j * x_{i+d/2}, turned by angle pos * theta^(-2i/d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:])
    freq = torch.tensor([theta ** (-2 * i / d) for i in range(d // 2)])
    turned = z * torch.polar(torch.ones(5, d // 2), pos[0, :, None] * freq)[None, :, None, :]
    want = torch.cat([turned.real, turned.imag], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, 0], x[:, 0])  # position 0 is the identity


def test_pipeline_stages_compose_to_the_full_model():
    full = build_model(SPEC, "cpu")
    first, last = build_model(SPEC, "cpu"), build_model(SPEC, "cpu")
    del first.layers["2"], first.layers["3"]
    first.norm, first.output = None, None
    del last.layers["0"], last.layers["1"]
    last.tok_embeddings = None
    b = pack_microbatch(_docs(), (Piece(0, 0, 9), Piece(2, 0, 25)))
    hidden = first(b.tokens, b)
    assert hidden.shape == (1, 34, SPEC.hidden)
    torch.testing.assert_close(last(hidden, b), full(b.tokens, b), rtol=1e-5, atol=1e-5)


def test_tied_embeddings_share_the_weight_and_its_gradient():
    spec = replace(SPEC, tie_embeddings=True)
    model = build_model(spec, "cpu")
    b = pack_microbatch(_docs(), (Piece(2, 0, 25),))
    logits = model(b.tokens, b)
    row = model.row(b)
    h = model.norm(model.layers["3"](model.layers["2"](model.layers["1"](model.layers["0"](
        model.tok_embeddings(b.tokens), row), row), row), row))
    torch.testing.assert_close(logits, h @ model.tok_embeddings.weight.T, rtol=1e-5, atol=1e-5)
    loss = F.cross_entropy(logits[0], b.labels[0])
    loss.backward()
    # the embedding's gradient has rows for tokens never fed in: they come from the head
    unused = torch.ones(spec.vocab, dtype=torch.bool)
    unused[b.tokens[0]] = False
    assert model.tok_embeddings.weight.grad[unused].abs().sum() > 0
    stage = build_model(spec, "cpu")
    stage.tok_embeddings = None
    with pytest.raises(SpecError, match="tie"):
        stage(torch.zeros(1, 25, spec.hidden), b)


def test_training_step_reduces_loss():
    torch.manual_seed(0)
    model = build_model(SPEC, "cpu")
    b = pack_microbatch(_docs(), (Piece(0, 0, 9), Piece(2, 0, 25), Piece(3, 0, 6)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        loss = F.cross_entropy(model(b.tokens, b)[0], b.labels[0], reduction="sum") / b.num_label_tokens
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - np.log(SPEC.vocab)) < 0.5  # small init: near-uniform predictions
    assert losses[-1] < losses[0] - 0.5


def test_attention_calls_the_local_entry_point_until_context_parallelism_installs_its_own():
    from flexmesh.runtime.model.attention import attend
    from flexmesh.runtime.parallel.context import ContextParallelAttention, CPContext, apply_context_parallel

    model = build_model(SPEC)
    assert all(layer.attention.core is attend for layer in model.layers.values())
    model.layers["1"] = checkpoint_wrapper(model.layers["1"])  # installed through activation checkpointing too
    core = apply_context_parallel(model)
    assert isinstance(core, ContextParallelAttention) and core.cp is None
    assert all(layer.attention.core is core for layer in model.layers.values())
    core.cp = CPContext("ring", None, 0, 2)  # one object: switching its group switches every layer
    assert all(layer.attention.core.cp is core.cp for layer in model.layers.values())


def test_a_context_parallel_slice_builds_the_whole_rows_row():
    from flexmesh.runtime.model.packing import pad_to_multiple, shard_for_cp

    model = build_model(SPEC, "cpu")
    whole = pad_to_multiple(pack_microbatch(_docs(), (Piece(0, 0, 9), Piece(2, 0, 25))), 2)
    half = shard_for_cp(whole, 1, 2)
    assert (whole.row_tokens, half.row_tokens) == (None, 34)
    row = model.row(half)
    assert row.docs.total == 34 and row.cos.shape[1] == 17
    torch.testing.assert_close(row.cos, model.row(whole).cos[:, 17:])


def test_non_llama_shapes_are_rejected_with_what_to_change():
    with pytest.raises(SpecError, match="rmsnorm"):
        Transformer(gpt(2, 64, 4, vocab=256))


def test_the_model_wing_imports_no_process_group_code():
    """Parallelism is applied from outside (flexmesh.runtime.parallel): no module of the model wing imports
    torch.distributed, except the DTensor types that fill a parameter's shard from its full tensor."""
    import ast
    from pathlib import Path

    import flexmesh.runtime.model as wing

    found = {}
    for path in Path(wing.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.startswith("torch.distributed") and name != "torch.distributed.tensor":
                    found.setdefault(path.name, []).append(name)
    assert found == {}
