"""flexmesh's mixtures of experts compute what transformers computes for the same checkpoint (fp32).

Tiny random Mixtral, Qwen2-MoE (a gated shared expert and a dense layer), Qwen3-MoE and OLMoE
(q/k norms over the projections, clip_qkv) models are written twice: by ``save_pretrained``, which
in transformers 5 writes one key per expert and projection (Mixtral's ``block_sparse_moe`` names),
and from the model's own state dict, with experts fused (``gate_up_proj`` [E, 2F, H], gate first).
transformers must load both folders to the same logits, and flexmesh must match transformers'
logits of one sequence, of a packed row of three documents, the loss and every gradient from both.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_below, randomise_hf, rel_diff, transformers_diffs
from safetensors.torch import load_file, save_file

from flexmesh.errors import CheckpointError, SpecError
from flexmesh.layout.step import Piece
from flexmesh.runtime.model.packing import pack_microbatch
from flexmesh.runtime.model.transformer import build_model
from flexmesh.runtime.state.weights import hf_name, load_hf_safetensors
from flexmesh.spec import from_hf_config
from flexmesh.spec.hf import spec_from_hf_dict, to_hf_config

transformers = pytest.importorskip("transformers", reason="transformers is the reference; pip install -e .[dev]")

torch.set_num_threads(1)
TOL = 1e-5
LENGTHS = (21, 37, 48)
SHAPE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             hidden_act="silu", num_experts_per_tok=2)
CASES: dict[str, tuple[str, dict]] = {
    "mixtral": ("mixtral", {"intermediate_size": 96, "num_local_experts": 4}),
    "qwen2-moe": ("qwen2_moe", {"intermediate_size": 80, "moe_intermediate_size": 48, "num_experts": 4,
                                "shared_expert_intermediate_size": 80, "decoder_sparse_step": 2}),
    "qwen3-moe": ("qwen3_moe", {"intermediate_size": 80, "moe_intermediate_size": 48, "num_experts": 4,
                                "head_dim": 16, "norm_topk_prob": True}),
    # OLMoE's default pad_token_id 1 freezes that embedding row in transformers (padding_idx), which
    # flexmesh does not model for any family; None as the other families' defaults
    "olmoe": ("olmoe", {"intermediate_size": 48, "num_experts": 4, "clip_qkv": 1.5, "pad_token_id": None}),
}


def _fused(src: Path, dst: Path, hf: torch.nn.Module) -> None:
    """The checkpoint of ``hf`` with experts fused, as transformers 5 holds them in memory."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    built: dict[str, tuple[torch.nn.Module, dict[str, Path]]] = {}

    def get(name: str):
        if name not in built:
            family, over = CASES[name]
            cfg = transformers.AutoConfig.for_model(family, **SHAPE, **over, dtype="float32",
                                                    rope_parameters={"rope_theta": 5000.0})
            torch.manual_seed(0)
            hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
            randomise_hf(hf, seed=len(built) + 11)
            root = tmp_path_factory.mktemp(name)
            hf.save_pretrained(root / "per-expert")  # transformers 5 saves experts one key each
            keys = load_file(str(root / "per-expert" / "model.safetensors"))
            assert not any(k.endswith("gate_up_proj") for k in keys) and any(".experts.0." in k for k in keys)
            _fused(root / "per-expert", root / "fused", hf)
            built[name] = (hf, {"fused": root / "fused", "per-expert": root / "per-expert"})
        return built[name]

    return get


def _docs() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, SHAPE["vocab_size"], n) for n in LENGTHS]


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_reads_the_fused_folder(checkpoints, case):
    """The fused folder written here is one transformers loads (same logits)."""
    hf, folders = checkpoints(case)
    again = transformers.AutoModelForCausalLM.from_pretrained(folders["fused"], attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    tokens = torch.as_tensor(_docs()[-1])[None]
    with torch.no_grad():
        assert rel_diff(again(tokens).logits, hf(tokens).logits) < 1e-6


@pytest.mark.parametrize("layout", ["fused", "per-expert"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(checkpoints, case, layout):
    hf, folders = checkpoints(case)
    spec = from_hf_config(folders[layout])
    assert spec.moe is not None and spec.moe.num_experts == 4 and spec.dtype == "fp32"
    model = build_model(replace(spec, name=case), "cpu")
    report = load_hf_safetensors(model, folders[layout])
    assert report.expert_layout == layout
    assert_below(transformers_diffs(model, hf, _docs()), TOL, f"{case}/{layout}")


def test_mistakes_would_show(checkpoints):
    """A swapped gate/up, an unnormalised top-k or a missing clip moves the logits far past TOL."""
    docs = _docs()
    single = pack_microbatch(docs[-1:], (Piece(0, 0, len(docs[-1])),))
    hf, folders = checkpoints("mixtral")
    spec = from_hf_config(folders["fused"])
    tokens = torch.as_tensor(docs[-1])[None]
    with torch.no_grad():
        want = hf(tokens).logits[0]
        model = build_model(spec, "cpu")
        load_hf_safetensors(model, folders["fused"])
        for layer in model.layers.values():  # gate and up swapped
            gu = layer.feed_forward.experts.gate_up
            f = gu.shape[1] // 2
            gu.copy_(torch.cat([gu[:, f:], gu[:, :f]], dim=1))
        assert rel_diff(model(single.tokens, single)[0], want) > 100 * TOL
        wrong = build_model(replace(spec, moe=replace(spec.moe, norm_topk=False)), "cpu")
        load_hf_safetensors(wrong, folders["fused"])
        assert rel_diff(wrong(single.tokens, single)[0], want) > 100 * TOL
        hf, folders = checkpoints("olmoe")
        spec = from_hf_config(folders["fused"])
        unclipped = build_model(replace(spec, clip_qkv=None), "cpu")
        load_hf_safetensors(unclipped, folders["fused"])
        assert rel_diff(unclipped(single.tokens, single)[0], hf(tokens).logits[0]) > 100 * TOL


def test_other_expert_count_is_refused(checkpoints, tmp_path):
    _, folders = checkpoints("qwen3-moe")
    cfg = json.loads((folders["fused"] / "config.json").read_text())
    spec = spec_from_hf_dict({**cfg, "num_experts": 8}, name="eight")
    for layout in ("fused", "per-expert"):
        with pytest.raises(CheckpointError, match="holds 4 experts but the model config has 8"):
            load_hf_safetensors(build_model(spec, "meta"), folders[layout])


def test_incomplete_per_expert_file_is_refused(checkpoints, tmp_path):
    _, folders = checkpoints("qwen2-moe")
    tensors = load_file(str(folders["per-expert"] / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]  # layer 1 is the MoE one (decoder_sparse_step 2)
    (tmp_path / "config.json").write_text((folders["per-expert"] / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    spec = from_hf_config(tmp_path)
    with pytest.raises(CheckpointError, match="lacks expert 2's up projection"):
        load_hf_safetensors(build_model(spec, "meta"), tmp_path)


@pytest.mark.parametrize("case", list(CASES))
def test_config_round_trip(checkpoints, case):
    """to_hf_config writes back what was read, and transformers builds the same shapes from it."""
    _, folders = checkpoints(case)
    spec = from_hf_config(folders["fused"])
    cfg = to_hf_config(spec)
    assert cfg["model_type"] == CASES[case][0]
    assert spec_from_hf_dict(cfg, name=spec.name) == spec
    hf_cfg = transformers.AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items()
                                                                         if k != "architectures"})
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    theirs = {k: tuple(v.shape) for k, v in built.named_parameters()}
    with torch.device("meta"):
        ours = {hf_name(k): tuple(v.shape) for k, v in build_model(spec).named_parameters()}
    assert ours == theirs


@pytest.mark.parametrize("change, message", [
    ({"router_jitter_noise": 0.1}, "router_jitter_noise 0.1 is not supported"),
    ({"num_local_experts": 1}, "at least 2 experts"),
    ({"num_experts_per_tok": 9}, "at most num_experts"),
    ({"num_local_experts": "eight"}, "num_local_experts must be a whole number"),
])
def test_bad_mixtral_fields_say_which(change, message):
    cfg = {"model_type": "mixtral", **SHAPE, "intermediate_size": 96, "num_local_experts": 8, **change}
    with pytest.raises(SpecError, match=message):
        spec_from_hf_dict(cfg)


def test_unsupported_rope_type_names_itself():
    """A rope_type flexmesh does not implement is refused by name, not by a complaint about its keys."""
    cfg = {"model_type": "qwen3_moe", **SHAPE, "intermediate_size": 80, "num_experts": 4,
           "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [1.0, 2.0]}}
    with pytest.raises(SpecError, match="rope_type 'longrope' is not supported"):
        spec_from_hf_dict(cfg)


def _weights_worker(rank: int, port: int, folder: str, out: str) -> None:
    """Build a trainer from Hugging Face weights with every tensor ``to_empty`` makes filled with NaN
    (what a reused allocator block may hold), train one step, and save the routing buffers and loss."""
    import os

    import torch.distributed as dist

    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.step import Group, StepSchedule
    from flexmesh.layout.strategy import LayerStrategy
    from flexmesh.runtime.model.moe import MoEFeedForward
    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.train.config import TrainConfig
    from flexmesh.runtime.train.trainer import Trainer

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed(timeout_s=120)
    empty_like = torch.empty_like

    def garbage(*args, **kwargs) -> torch.Tensor:
        t = empty_like(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else 7)

    torch.empty_like = garbage  # type: ignore[assignment]
    spec = from_hf_config(folder)
    st = LayerStrategy.parse("tp1-dp1z0")
    plan = Plan.uniform(model=str(Path(folder) / "config.json"), cluster="cpu", world_size=1, pp=1,
                        pipeline_schedule="1f1b", virtual_stages=1, num_microbatches=1, seq_len=64, global_batch=1,
                        stages=(StagePlan(0, spec.num_layers, (st,) * spec.num_layers),))
    cfg = TrainConfig(max_steps=1, lr=1e-3, warmup_steps=0, grad_clip=0.0, progress=False)
    trainer = Trainer(plan, spec, cfg, weights=folder)
    torch.empty_like = empty_like
    buffers = {f"{name}.{b}": buf.detach().clone() for m in trainer.inner_models()
               for name, mod in m.named_modules() if isinstance(mod, MoEFeedForward)
               for b, buf in mod.named_buffers()}
    doc = _docs()[-1]
    sched = StepSchedule(lengths=(len(doc),), groups=(Group((0,), ((Piece(0, 0, len(doc)),),)),), policy="test")
    loss = trainer.step([doc], sched).loss
    torch.save({"buffers": buffers, "loss": loss}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_training_from_weights_starts_routing_state_at_zero(checkpoints, tmp_path):
    """Trained from a checkpoint (built on meta, materialised by ``to_empty``, weights loaded), the
    experts' routing state starts at zero whatever the allocator handed out: a balancing bias of garbage
    would route to other experts, garbage shares would place them; the first step's loss is
    transformers' own."""
    from helpers import spawn

    from flexmesh.runtime.launch import free_port

    hf, folders = checkpoints("mixtral")
    out = tmp_path / "out.pt"
    spawn(_weights_worker, (free_port(), str(folders["per-expert"]), str(out)), 1)
    got = torch.load(out)
    assert got["buffers"] and all(float(b.abs().max()) == 0.0 for b in got["buffers"].values()), got["buffers"]
    ids = torch.as_tensor(_docs()[-1])[None]
    with torch.no_grad():
        want = float(hf(input_ids=ids, labels=ids).loss)
    assert abs(got["loss"] - want) <= 1e-5 * abs(want)
