"""Hugging Face ``config.json`` of families serving engines run but flexmesh's runtime does not build: their shapes,
for pricing (serve simulate, serve plan, plan), never for training.

vLLM serves OPT, GPT-NeoX (Pythia), Falcon and Gemma; a serving plan prices a model by its shapes alone (its GEMMs,
its attention heads and KV heads, its vocabulary, its context). :func:`priced_from_hf_dict` reads those from each
family's config as its transformers config class defines them (a missing field takes that class's default) and
gives a :class:`~flexmesh.spec.shape.ModelSpec` marked ``priced_only`` with its family: ``build_model`` refuses it
in one line. What changes the math but not the shapes (OPT's ReLU, GPT-NeoX's partial rotary and parallel residual,
Falcon's parallel attention, Gemma's scaled embedding and GeGLU's tanh) is not modelled; a non-gated MLP is priced as
two matrices (``activation`` gelu), a gated one as three (swiglu). What changes the shapes and is not read here is
refused: OPT's ``word_embed_proj_dim`` other than ``hidden_size`` (its projections in and out), Falcon's ALiBi.

>>> spec = priced_from_hf_dict({"model_type": "opt", "num_hidden_layers": 40, "hidden_size": 5120,
...                             "num_attention_heads": 40, "ffn_dim": 20480, "vocab_size": 50272}, "opt-13b")
>>> spec.priced_only, spec.num_kv_heads, spec.activation, spec.max_position, spec.tie_embeddings
('opt', 40, 'gelu', 2048, True)
"""

from __future__ import annotations

from typing import Any

from flexmesh.errors import SpecError
from flexmesh.spec.shape import ModelSpec

PRICED_FAMILIES = ("opt", "gpt_neox", "falcon", "gemma")
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _int(cfg: dict, where: str, *keys: str, default: Any = None) -> int:
    """The first of ``keys`` the config has (older and newer names of one field), else ``default``."""
    for k in keys:
        if cfg.get(k) is not None:
            v = cfg[k]
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpecError(f"{where}: {k} is a whole number >= 1, got {v!r}")
            return v
    if default is None:
        raise SpecError(f"{where}: config.json is missing {keys[0]}")
    return int(default)


def priced_from_hf_dict(cfg: dict, name: str | None = None, where: str = "config.json") -> ModelSpec:
    """The shapes of an OPT, GPT-NeoX, Falcon or Gemma config (see the module doc)."""
    family = cfg.get("model_type")
    if family not in PRICED_FAMILIES:
        raise SpecError(f"{where}: model_type {family!r} is not one of {', '.join(PRICED_FAMILIES)}")
    layers = _int(cfg, where, "num_hidden_layers", "n_layer")
    hidden = _int(cfg, where, "hidden_size")
    heads = _int(cfg, where, "num_attention_heads", "n_head")
    vocab = _int(cfg, where, "vocab_size")
    kw: dict[str, Any] = {"norm": "layernorm", "activation": "gelu", "kv": heads, "tie": False, "bias": True,
                          "position": "rope", "head_dim": None}
    if family == "opt":
        if cfg.get("word_embed_proj_dim", hidden) != hidden:
            raise SpecError(f"{where}: an OPT word_embed_proj_dim ({cfg['word_embed_proj_dim']}) other than "
                            f"hidden_size ({hidden}) is not read (its projections in and out)")
        ffn = _int(cfg, where, "ffn_dim", default=3072)
        ctx = _int(cfg, where, "max_position_embeddings", default=2048)
        kw.update(position="learned", tie=bool(cfg.get("tie_word_embeddings", True)))
    elif family == "gpt_neox":
        ffn = _int(cfg, where, "intermediate_size", default=24576)
        ctx = _int(cfg, where, "max_position_embeddings", default=2048)
        kw.update(tie=bool(cfg.get("tie_word_embeddings", False)))
    elif family == "falcon":
        if cfg.get("alibi"):
            raise SpecError(f"{where}: Falcon with ALiBi positions is not read; vLLM's Falcon models use rotary")
        if cfg.get("new_decoder_architecture"):
            kv = _int(cfg, where, "num_kv_heads", default=heads)
        else:
            kv = 1 if cfg.get("multi_query", True) else heads
        ffn = _int(cfg, where, "ffn_hidden_size", default=4 * hidden)
        ctx = _int(cfg, where, "max_position_embeddings", default=2048)
        kw.update(kv=kv, bias=bool(cfg.get("bias", False)), tie=bool(cfg.get("tie_word_embeddings", True)))
    else:  # gemma: GeGLU (three matrices), RMSNorm, rotary, head_dim 256 by default, tied
        ffn = _int(cfg, where, "intermediate_size", default=24576)
        ctx = _int(cfg, where, "max_position_embeddings", default=8192)
        kw.update(norm="rmsnorm", activation="swiglu", bias=False, tie=bool(cfg.get("tie_word_embeddings", True)),
                  kv=_int(cfg, where, "num_key_value_heads", default=16),
                  head_dim=_int(cfg, where, "head_dim", default=256))
    dtype = _DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"), "bf16")
    head_dim = kw["head_dim"] if kw["head_dim"] != hidden // heads else None
    return ModelSpec(name=name or family, num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=kw["kv"],
                     ffn_hidden=ffn, vocab=vocab, norm=kw["norm"], activation=kw["activation"],
                     position=kw["position"], tie_embeddings=kw["tie"], linear_bias=kw["bias"],
                     head_dim_override=head_dim, max_position=ctx, dtype=dtype, priced_only=family)
