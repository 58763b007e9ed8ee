"""Hugging Face safetensors weights: naming, round trips, shards, stages, errors, sharded layouts."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import spawn
from safetensors.torch import load_file, save_file

from flexmesh.errors import CheckpointError
from flexmesh.layout.step import Piece
from flexmesh.runtime.launch import free_port
from flexmesh.runtime.model.packing import pack_microbatch
from flexmesh.runtime.model.transformer import build_model
from flexmesh.runtime.state.weights import load_hf_safetensors, save_hf_safetensors
from flexmesh.spec.model import ModelSpec

torch.set_num_threads(1)

SPEC = ModelSpec("t", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, ffn_hidden=96, vocab=256,
                 dtype="fp32", qkv_bias=True)


def _batch():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, SPEC.vocab, n) for n in (7, 12, 5)]
    return pack_microbatch(docs, tuple(Piece(i, 0, len(d)) for i, d in enumerate(docs)))


def _saved(tmp_path: Path, spec: ModelSpec = SPEC, seed: int = 3) -> tuple[torch.nn.Module, Path]:
    model = build_model(spec)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    path = tmp_path / "model.safetensors"
    save_hf_safetensors(model, path)
    return model, path


def test_saved_file_uses_hugging_face_llama_names(tmp_path):
    _, path = _saved(tmp_path)
    keys = set(load_file(str(path)))
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for n in range(SPEC.num_layers):
        p = f"model.layers.{n}"
        want |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"}
        want |= {f"{p}.self_attn.{x}_proj.weight" for x in "qkvo"}
        want |= {f"{p}.self_attn.{x}_proj.bias" for x in "qkv"}
        want |= {f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
    assert keys == want
    assert load_file(str(path))["model.layers.1.mlp.gate_proj.weight"].shape == (SPEC.ffn_hidden, SPEC.hidden)


def test_round_trip_gives_the_same_logits(tmp_path):
    src, path = _saved(tmp_path)
    dst = build_model(SPEC, "cpu")  # seed 0, different from the saved seed 3
    b = _batch()
    assert not torch.allclose(src(b.tokens, b), dst(b.tokens, b))
    load_hf_safetensors(dst, path)
    torch.testing.assert_close(dst(b.tokens, b), src(b.tokens, b), rtol=0, atol=0)


def test_sharded_index_and_bf16_file(tmp_path):
    src, path = _saved(tmp_path)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(path)).items()}
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    dst = build_model(SPEC, "cpu")
    load_hf_safetensors(dst, index)
    for name, p in dst.named_parameters():
        assert p.dtype == torch.float32
        torch.testing.assert_close(p, dict(src.named_parameters())[name].to(torch.bfloat16).float())
    (tmp_path / "b.safetensors").unlink()
    with pytest.raises(CheckpointError, match="b.safetensors"):
        load_hf_safetensors(dst, index)


def test_pipeline_stage_loads_only_its_layers(tmp_path):
    src, path = _saved(tmp_path)
    stage = build_model(SPEC, "cpu")
    del stage.layers["0"]
    stage.tok_embeddings = None
    load_hf_safetensors(stage, path)
    assert torch.equal(stage.layers["1"].attention.wk.bias, src.layers["1"].attention.wk.bias)
    assert torch.equal(stage.output.weight, src.output.weight)  # exact: the weights written and read back


def test_tied_model_loads_a_file_without_lm_head(tmp_path):
    tied = replace(SPEC, tie_embeddings=True)
    src, path = _saved(tmp_path, tied)
    assert "lm_head.weight" not in load_file(str(path))
    dst = build_model(tied, "cpu")
    load_hf_safetensors(dst, path)
    b = _batch()
    torch.testing.assert_close(dst(b.tokens, b), src(b.tokens, b), rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="lm_head.weight.*tie_word_embeddings"):
        load_hf_safetensors(build_model(SPEC, "cpu"), path)  # an untied model needs lm_head


def test_shape_mismatch_and_bad_files_are_clear(tmp_path):
    _, path = _saved(tmp_path)
    wider = replace(SPEC, ffn_hidden=128)
    with pytest.raises(CheckpointError, match=r"gate_proj.weight has shape \(96, 64\).*\(128, 64\)"):
        load_hf_safetensors(build_model(wider, "cpu"), path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_safetensors(build_model(SPEC, "cpu"), tmp_path / "nope.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="not a readable"):
        load_hf_safetensors(build_model(SPEC, "cpu"), junk)


# ---- multi-process: FSDP2 and tensor-parallel parameters (DTensors) -------------------------------------
def _worker(rank: int, world: int, port: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (world,))
        ref = build_model(SPEC, "cpu")
        load_hf_safetensors(ref, path)
        b = _batch()
        want = ref(b.tokens, b)

        fsdp = build_model(SPEC)
        for layer in fsdp.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(fsdp, mesh=mesh)
        fsdp.to_empty(device="cpu")
        # deterministic init of sharded parameters equals the plain model's init
        fsdp.init_weights(0)
        plain0 = build_model(SPEC, "cpu")
        for (n, p), (_, q) in zip(fsdp.named_parameters(), plain0.named_parameters()):
            torch.testing.assert_close(p.full_tensor(), q, rtol=0, atol=0, msg=n)
        load_hf_safetensors(fsdp, path)
        torch.testing.assert_close(fsdp(b.tokens, b), want, rtol=1e-5, atol=1e-5)

        tp = build_model(SPEC)
        plan = {}
        for n in tp.layers:
            plan.update({f"layers.{n}.attention.wq": ColwiseParallel(), f"layers.{n}.attention.wk": ColwiseParallel(),
                         f"layers.{n}.attention.wv": ColwiseParallel(), f"layers.{n}.attention.wo": RowwiseParallel(),
                         f"layers.{n}.feed_forward.w1": ColwiseParallel(),
                         f"layers.{n}.feed_forward.w3": ColwiseParallel(),
                         f"layers.{n}.feed_forward.w2": RowwiseParallel()})
        parallelize_module(tp, mesh, plan)
        tp.to_empty(device="cpu")
        load_hf_safetensors(tp, path)
        assert tp.layers["0"].attention.wq.weight.to_local().shape[0] == SPEC.q_dim // world
        torch.testing.assert_close(tp(b.tokens, b), want, rtol=1e-5, atol=1e-5)
        out = Path(path).with_name("resaved.safetensors")
        save_hf_safetensors(tp, out)  # gathers the shards; rank 0 writes
        dist.barrier()
        for k, v in load_file(str(out)).items():
            torch.testing.assert_close(v, load_file(path)[k], rtol=0, atol=0)
        dist.barrier()
    finally:
        dist.destroy_process_group()




@pytest.mark.slow
@pytest.mark.timeout(120)
def test_loads_into_fsdp2_and_tensor_parallel_layouts(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _, path = _saved(tmp_path)
    spawn(_worker, (2, free_port(), str(path)), 2)
