"""The models flexmesh knows by name: the presets, ``gpt:LAYERS:HIDDEN:HEADS``, and a Hugging Face
config.json by its path (flexmesh.spec.hf), each optionally ``@dtype``: :func:`parse_model`.

The shape itself, :class:`ModelSpec` with its parameter and FLOP counts, is flexmesh.spec.shape's.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import replace
from pathlib import Path

from flexmesh.errors import SpecError
from flexmesh.spec.hf import from_hf_config
from flexmesh.spec.moe import MoESpec
from flexmesh.spec.shape import DTYPE_BYTES, ROPE_TYPES, ModelSpec, RopeScaling

__all__ = ["DTYPE_BYTES", "MODEL_PRESETS", "ROPE_TYPES", "ModelSpec", "RopeScaling", "config_path",
           "from_hf_config", "gpt", "parse_model", "with_dtype"]


def _llama(name: str, L: int, h: int, a: int, kv: int, ffn: int, V: int, **kw) -> ModelSpec:
    return ModelSpec(name=name, num_layers=L, hidden=h, num_heads=a, num_kv_heads=kv, ffn_hidden=ffn, vocab=V, **kw)


def gpt(num_layers: int, hidden: int, num_heads: int, vocab: int = 51200, name: str | None = None,
        max_position: int = 2048) -> ModelSpec:
    """A GPT-style model (Megatron-LM's GPT: LayerNorm, GeLU MLP of 4h, learned positions, biases)."""
    return ModelSpec(
        name=name or f"gpt-{num_layers}x{hidden}x{num_heads}",
        num_layers=num_layers, hidden=hidden, num_heads=num_heads, num_kv_heads=num_heads,
        ffn_hidden=4 * hidden, vocab=vocab, norm="layernorm", activation="gelu", position="learned",
        tie_embeddings=True, linear_bias=True, max_position=max_position,
    )


_LLAMA31_ROPE = RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0)

# Shapes from each model's published config.json (Hugging Face hub model cards of meta-llama/* and Qwen/*).
MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000),
        # meta-llama/Meta-Llama-3-{8B,70B}/config.json: rope_theta 5e5, 8192 positions, rope_scaling null
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, max_position=8192, rope_theta=500000.0),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, max_position=8192, rope_theta=500000.0),
        # meta-llama/Llama-3.1-{8B,70B}/config.json: the same shapes, 131072 positions by rope_scaling
        # {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        #  "original_max_position_embeddings": 8192}
        _llama("llama3.1-8b", 32, 4096, 32, 8, 14336, 128256, max_position=131072, rope_theta=500000.0,
               rope_scaling=_LLAMA31_ROPE),
        _llama("llama3.1-70b", 80, 8192, 64, 8, 28672, 128256, max_position=131072, rope_theta=500000.0,
               rope_scaling=_LLAMA31_ROPE),
        # Qwen/Qwen2.5-{7B,32B,72B}-Instruct/config.json: q/k/v biases, rope_theta 1e6, rms_norm_eps 1e-6,
        # use_sliding_window false (so no window), 32768 positions
        _llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, qkv_bias=True, max_position=32768,
               rope_theta=1e6, norm_eps=1e-6),
        _llama("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, qkv_bias=True, max_position=32768,
               rope_theta=1e6, norm_eps=1e-6),
        _llama("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, qkv_bias=True, max_position=32768,
               rope_theta=1e6, norm_eps=1e-6),
        # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T/config.json: Llama 2's architecture at 1.1B,
        # 2048 positions, rope_theta 1e4, rms_norm_eps 1e-5 (bench/gpu.py trains this shape)
        _llama("tinyllama-1.1b", 22, 2048, 32, 4, 5632, 32000, max_position=2048),
        # A small model for tests, benchmarks and the demo on CPUs.
        _llama("tiny", 4, 256, 8, 4, 688, 4096, max_position=4096),
        # Mixtures of experts, from each model's published config.json:
        # mistralai/Mixtral-8x7B-v0.1: 8 experts of 14336 (intermediate_size), top 2, rope_theta 1e6,
        # 32768 positions, router_aux_loss_coef 0.02
        _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, max_position=32768, rope_theta=1e6,
               moe=MoESpec(8, 2, 14336, aux_loss=0.02)),
        # Qwen/Qwen2-57B-A14B: q/k/v biases, 64 experts of 2560 (moe_intermediate_size), top 8 not
        # renormalised, a gated shared expert of 20480, 131072 positions, rope_theta 1e6
        _llama("qwen2-57b-a14b", 28, 3584, 28, 4, 18944, 151936, qkv_bias=True, max_position=131072,
               rope_theta=1e6, norm_eps=1e-6,
               moe=MoESpec(64, 8, 2560, shared_ffn=20480, shared_gate=True, norm_topk=False, aux_loss=0.001)),
        # Qwen/Qwen3-30B-A3B: head_dim 128, per-head q/k norms, 128 experts of 768, top 8 renormalised,
        # 40960 positions, rope_theta 1e6
        _llama("qwen3-30b-a3b", 48, 2048, 32, 4, 6144, 151936, head_dim_override=128, qk_norm=True,
               max_position=40960, rope_theta=1e6, norm_eps=1e-6, moe=MoESpec(128, 8, 768, aux_loss=0.001)),
        # allenai/OLMoE-1B-7B-0924: q/k norms over the whole projections, 64 experts of 1024, top 8 not
        # renormalised, 4096 positions, rope_theta 1e4, clip_qkv null
        _llama("olmoe-1b-7b", 16, 2048, 16, 16, 1024, 50304, qk_norm=True, qk_norm_scope="projection",
               max_position=4096, moe=MoESpec(64, 8, 1024, norm_topk=False, aux_loss=0.01)),
        # A small mixture of experts for tests, benchmarks and the demo on CPUs.
        _llama("tiny-moe", 4, 256, 8, 4, 512, 4096, max_position=4096, moe=MoESpec(8, 2, 512)),
    )
}

_GPT_RE = re.compile(r"^gpt:(\d+):(\d+):(\d+)(?::(\d+))?(:untied)?$")
# MODEL@DTYPE: any model text planned in another precision (llama2-7b@fp16 on V100s).
_DTYPE_SUFFIX = re.compile(r"^(.+)@(bf16|fp16|fp32)$")


def config_path(text: str) -> Path | None:
    """The config.json file that model text ``text`` names: a ``.json`` path or a folder holding a
    config.json; None for a preset name or ``gpt:...`` (which come first: ``tiny`` is the preset
    even beside a folder ``tiny``, which ``./tiny`` or ``tiny/config.json`` names) and anything else."""
    suffixed = _DTYPE_SUFFIX.match(text)
    if suffixed and not Path(text).expanduser().exists():
        text = suffixed.group(1)
    if text in MODEL_PRESETS or _GPT_RE.match(text):
        return None
    p = Path(text).expanduser()
    if p.is_dir():
        return p / "config.json"
    return p if p.suffix == ".json" else None


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as the Hub spells a repository


def parse_model(text: str) -> ModelSpec:
    """A preset name, ``gpt:LAYERS:HIDDEN:HEADS[:VOCAB][:untied]``, a config.json path, or a folder holding
    one; any of them may end in ``@bf16``, ``@fp16`` or ``@fp32``, the precision to train in (the
    default: bf16, or a config.json's ``torch_dtype``). A ``gpt:`` model ties its head to the embedding
    as Megatron-LM's GPT does unless ``:untied``.

    >>> m = parse_model("gpt:24:2048:16:50257:untied@fp16")
    >>> m.dtype, m.tie_embeddings, m.vocab, parse_model("llama2-7b@fp32").dtype
    ('fp16', False, 50257, 'fp32')
    """
    suffixed = _DTYPE_SUFFIX.match(text)
    if suffixed and not Path(text).expanduser().exists():
        return with_dtype(parse_model(suffixed.group(1)), suffixed.group(2))
    if text in MODEL_PRESETS:
        return MODEL_PRESETS[text]
    m = _GPT_RE.match(text)
    if m:
        L, h, a, V, untied = m.groups()
        spec = gpt(int(L), int(h), int(a), int(V) if V else 51200)
        return replace(spec, name=f"{spec.name}-untied", tie_embeddings=False) if untied else spec
    path = config_path(text)
    if path is not None:
        return from_hf_config(path)
    by_case = {k.lower(): k for k in MODEL_PRESETS}.get(text.lower())
    if by_case is not None:
        return MODEL_PRESETS[by_case]
    if _HUB_ID.match(text):
        raise SpecError(f"model {text!r} looks like a Hugging Face Hub id, and flexmesh downloads nothing: download "
                        f"it (e.g. `hf download {text} config.json`) and give its folder or config.json")
    near = difflib.get_close_matches(text.lower(), [k.lower() for k in MODEL_PRESETS], n=3, cutoff=0.6)
    hint = "did you mean " + ", ".join(k for k in MODEL_PRESETS if k.lower() in near) + "? " if near else ""
    raise SpecError(
        f"unknown model {text!r}; {hint}known presets: {', '.join(MODEL_PRESETS)}; "
        "or give gpt:LAYERS:HIDDEN:HEADS[:VOCAB][:untied], or a path to a Hugging Face config.json, "
        "optionally followed by @bf16, @fp16 or @fp32"
    )


def with_dtype(model: ModelSpec, dtype: str) -> ModelSpec:
    return replace(model, dtype=dtype)


def precision_suffix(text: str) -> str | None:
    """The precision model text ``text`` asks for with ``@bf16``, ``@fp16`` or ``@fp32``; None without one.

    >>> precision_suffix("tiny@fp16"), precision_suffix("tiny")
    ('fp16', None)
    """
    suffixed = _DTYPE_SUFFIX.match(text)
    return suffixed.group(2) if suffixed and not Path(text).expanduser().exists() else None
