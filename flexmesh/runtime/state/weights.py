"""Hugging Face safetensors weights in and out of a flexmesh Transformer, whatever its layout.

The model may be plain, FSDP2-sharded or tensor-parallel (its parameters are then DTensors), and a
pipeline stage holds only some layers: every parameter the model holds is read from the file by its
Hugging Face Llama name, as a full tensor, and only this rank's shard is kept. The loader checks the
file against the whole model its config describes: a tensor the model needs and the file lacks, or
a tensor of the file the model has no place for, is a CheckpointError naming them; tensors of
layers another pipeline stage holds are skipped and named in the returned :class:`LoadReport`;
``rotary_emb.inv_freq`` buffers of old checkpoints are recomputed, not read.

Name mapping (flexmesh <- Hugging Face Llama / Mistral / Qwen2)::

    tok_embeddings.weight                      model.embed_tokens.weight
    layers.N.attention_norm.weight             model.layers.N.input_layernorm.weight
    layers.N.attention.wq|wk|wv|wo.{weight,bias}  model.layers.N.self_attn.q_proj|k_proj|v_proj|o_proj.*
    layers.N.attention.q_norm|k_norm.weight    model.layers.N.self_attn.q_norm|k_norm.weight (Qwen3)
    layers.N.ffn_norm.weight                   model.layers.N.post_attention_layernorm.weight
    layers.N.feed_forward.w1|w2|w3.{weight,bias}  model.layers.N.mlp.gate_proj|down_proj|up_proj.*
    norm.weight                                model.norm.weight
    output.weight                              lm_head.weight

A mixture-of-experts layer (flexmesh.runtime.model.moe) in transformers 5's fused layout; files in the
per-expert layout of transformers 4 are read and written by flexmesh.runtime.state.expert_weights::

    layers.N.feed_forward.router.weight        model.layers.N.mlp.gate.weight
    layers.N.feed_forward.experts.gate_up      model.layers.N.mlp.experts.gate_up_proj
    layers.N.feed_forward.experts.down         model.layers.N.mlp.experts.down_proj
    layers.N.feed_forward.shared.w1|w2|w3.weight  model.layers.N.mlp.shared_expert.gate|down|up_proj.weight
    layers.N.feed_forward.shared_gate.weight   model.layers.N.mlp.shared_expert_gate.weight

Both use the half-split RoPE convention, so q/k weights need no permutation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from flexmesh.errors import CheckpointError
from flexmesh.files import plain_name, write_atomic_with
from flexmesh.inputs import load_json
from flexmesh.runtime.model.params import canonical_name, copy_full_, is_adapter

_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
_FFN = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_NORMS = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_QK_NORMS = ("q_norm", "k_norm")
_MOE: dict[tuple[str, ...], str] = {("router", "weight"): "gate.weight", ("experts", "gate_up"): "experts.gate_up_proj",
        ("experts", "down"): "experts.down_proj", ("shared_gate", "weight"): "shared_expert_gate.weight"}
# Buffers some checkpoints carry that the model recomputes instead of reading.
_RECOMPUTED = (".rotary_emb.inv_freq",)


def hf_name(name: str) -> str:
    """The Hugging Face key of a flexmesh parameter name (experts: transformers 5's fused layout).

    >>> hf_name("layers.3.feed_forward.w1.weight")
    'model.layers.3.mlp.gate_proj.weight'
    """
    name = canonical_name(name)
    top = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) >= 4:
        n, module, rest = parts[1], parts[2], parts[3:]
        prefix = f"model.layers.{n}"
        if module in _NORMS and rest == ["weight"]:
            return f"{prefix}.{_NORMS[module]}.weight"
        if module == "attention" and len(rest) == 2 and rest[0] in _ATTN:
            return f"{prefix}.self_attn.{_ATTN[rest[0]]}.{rest[1]}"
        if module == "attention" and rest[0] in _QK_NORMS and rest[1:] == ["weight"]:
            return f"{prefix}.self_attn.{rest[0]}.weight"
        if module == "feed_forward" and len(rest) == 2 and rest[0] in _FFN:
            return f"{prefix}.mlp.{_FFN[rest[0]]}.{rest[1]}"
        if module == "feed_forward" and tuple(rest) in _MOE:
            return f"{prefix}.mlp.{_MOE[tuple(rest)]}"
        if module == "feed_forward" and len(rest) == 3 and rest[0] == "shared" and rest[1] in _FFN:
            return f"{prefix}.mlp.shared_expert.{_FFN[rest[1]]}.{rest[2]}"
    raise CheckpointError(f"parameter {name!r} has no Hugging Face Llama name; is this a flexmesh Transformer?")


def _open_weights(path: Path) -> dict[str, Path]:
    """Map each key to the file holding it: a single .safetensors file or a sharded index json."""
    if not path.exists():
        raise CheckpointError(f"weights file {str(path)!r} does not exist; give a .safetensors file or a "
                              "*.safetensors.index.json")
    if path.is_dir():
        idx = sorted(path.glob("*.safetensors.index.json"))
        single = sorted(path.glob("*.safetensors"))
        if idx:
            path = idx[0]
        elif len(single) == 1:
            path = single[0]
        else:
            raise CheckpointError(f"folder {str(path)!r} holds {len(single)} .safetensors files and no index; "
                                  "give the file (or the *.safetensors.index.json) itself")
    if path.name.endswith(".json"):
        index = load_json(path, CheckpointError, invalid="not a safetensors index")
        try:
            weight_map = index["weight_map"]
        except (KeyError, TypeError, IndexError) as e:
            raise CheckpointError(f"{path}: not a safetensors index (needs a 'weight_map' object): "
                                  f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f for f in weight_map.values()):
            raise CheckpointError(f"{path}: 'weight_map' must map each tensor name to a shard file name")
        # shard names come from the file: plain names next to the index, never paths to elsewhere
        files = {str(k): path.parent / plain_name(f, f"{path}: shard", CheckpointError) for k, f in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{path} names shard {f.name!r}, which is missing next to it; download it")
        return files
    return {k: path for k in _safetensors_keys(path)}


def _safetensors_keys(path: Path) -> list[str]:
    """The tensor names of a safetensors file; CheckpointError when it is truncated or not one."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); it may be truncated: download "
                              "it again") from None


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_hf_safetensors` did with the file's tensors (Hugging Face names, sorted)."""

    loaded: tuple[str, ...]
    other_stages: tuple[str, ...]  # tensors of layers or ends that other pipeline stages hold
    recomputed: tuple[str, ...]  # buffers such as rotary_emb.inv_freq, which the model computes itself
    expert_layout: str | None = None  # fused or per-expert (flexmesh.runtime.state.expert_weights); None: no experts

    def summary(self) -> str:
        """One line: how many tensors were read and which were left to other stages."""
        line = f"loaded {len(self.loaded)} tensors"
        if self.expert_layout is not None:
            line += f" (experts {self.expert_layout})"
        if self.other_stages:
            line += f"; {len(self.other_stages)} belong to other pipeline stages ({_shown(self.other_stages)})"
        return line


def _shown(keys: list[str] | tuple[str, ...], n: int = 5) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def _whole_model_keys(model: nn.Module) -> set[str]:
    """Hugging Face names of every parameter of the whole model ``model`` (maybe a stage) is part of."""
    spec = getattr(model, "spec", None)
    if spec is None:
        return {hf_name(name) for name, _ in model.named_parameters()}
    from flexmesh.runtime.model.transformer import Transformer  # the model module imports this one lazily

    with torch.device("meta"):  # names and shapes only, no memory
        whole = Transformer(spec)
    return {hf_name(name) for name, _ in whole.named_parameters()}


def _expert_count_error(file: Path, key: str, got: tuple[int, ...], want: tuple[int, ...]) -> CheckpointError:
    return CheckpointError(f"{file.name}: {key} holds {got[0]} experts but the model config has {want[0]}; the "
                           "weights belong to another config (check num_experts / num_local_experts)")


def load_hf_safetensors(model: nn.Module, path: str | Path) -> LoadReport:
    """Fill every parameter ``model`` holds from Hugging Face-named safetensors weights.

    Works for plain, FSDP2- and TP-sharded (DTensor) parameters and for pipeline stages; each tensor
    is read on its own, so peak extra memory is one full parameter. Experts are read from either
    checkpoint layout (flexmesh.runtime.state.expert_weights). Raises CheckpointError when the file lacks a
    tensor of the model or holds one the model's config has no place for.
    """
    from contextlib import ExitStack

    from flexmesh.runtime.state.expert_weights import sources

    path = Path(path)
    files = _open_weights(path)
    found, layout = sources(files)
    wanted = {name: hf_name(name) for name, _ in model.named_parameters() if not is_adapter(name)}
    whole = _whole_model_keys(model)
    missing = sorted(k for k in wanted.values() if k not in found)
    recomputed = sorted(k for k in found if k.endswith(_RECOMPUTED))
    unexpected = sorted(k for k in found if k not in whole and not k.endswith(_RECOMPUTED))
    if missing or unexpected:
        parts = [f"weights are missing {_shown(missing)}"] if missing else []
        if unexpected:
            parts.append(f"hold {_shown(unexpected)}, which the model has no place for")
        raise CheckpointError(f"{path}: {' and '.join(parts)}; the file does not match the model config "
                              "(check num_hidden_layers, tie_word_embeddings, the experts, attention_bias and "
                              "mlp_bias)")
    params = dict(model.named_parameters())
    checked: set[Path] = set()
    with ExitStack() as stack:
        opened: dict[Path, Any] = {}  # safetensors' safe_open handles (untyped)

        def read(key: str):  # one tensor of the file, its shard checked before the first read from it
            file = files[key]
            if file not in opened:
                if file != path and file not in checked:
                    _safetensors_keys(file)
                    checked.add(file)
                opened[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            try:
                return opened[file].get_tensor(key)
            except Exception as e:  # safetensors' own error types for a header naming bytes not there
                raise CheckpointError(f"{file}: tensor {key} cannot be read ({e}); the file is corrupt or "
                                      "truncated: download it again") from None

        for name, key in wanted.items():
            src = found[key]
            full = src.combine([read(k) for k in src.keys])
            want = tuple(params[name].shape)
            if tuple(full.shape) != want:
                file = files[src.keys[0]]
                if key.endswith(("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight")) \
                        and full.shape[0] != want[0]:
                    raise _expert_count_error(file, key, tuple(full.shape), want)
                raise CheckpointError(f"{file.name}: {key} has shape {tuple(full.shape)} but the model expects "
                                      f"{want}; the weights belong to another config")
            copy_full_(params[name], full)
    held = set(wanted.values())
    has_experts = any(k.endswith("experts.gate_up_proj") for k in whole)
    return LoadReport(loaded=tuple(sorted(held)), other_stages=tuple(sorted(k for k in found if k in whole - held)),
                      recomputed=tuple(recomputed), expert_layout=layout if has_experts else None)


def save_hf_safetensors(model: nn.Module, path: str | Path) -> None:
    """Write the model's parameters as one Hugging Face Llama-named safetensors file.

    DTensor parameters are gathered first, so every rank must call it; only global rank 0 writes.
    Meant for tests and small models (the whole model passes through host memory).
    """
    tensors = {}
    for name, p in model.named_parameters():
        if is_adapter(name):  # LoRA adapters: PEFT's format (flexmesh.runtime.state.peft)
            continue
        full = p.full_tensor() if isinstance(p, DTensor) else p
        tensors[hf_name(name)] = full.detach().to("cpu").contiguous()
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        write_atomic_with(Path(path), lambda tmp: save_file(tensors, str(tmp)))
