"""Hugging Face ``config.json`` of families serving engines run but flexmesh's runtime does not build: their shapes,
for pricing (serve simulate, serve plan, plan), never for training.

vLLM serves OPT, GPT-NeoX (Pythia), Falcon, Gemma and Gemma 2, GPT-2, GPT-BigCode (StarCoder), GPT-J, Phi, Phi-3,
StarCoder2, MPT and BLOOM; a serving plan prices a model by its shapes alone (its GEMMs, its attention heads and KV
heads, its vocabulary, its context, its sliding windows: a sliding layer holds and reads at most its window,
flexmesh.cost.inference.memory.KVGroups). :func:`priced_from_hf_dict` reads those from each family's config as its
transformers config class defines them (a missing field takes that class's default) and gives a
:class:`~flexmesh.spec.shape.ModelSpec` marked ``priced_only`` with its family: ``build_model`` refuses it in one line.
What changes the math but not the shapes (OPT's ReLU, partial rotary, ALiBi, parallel attention and MLP, Gemma's scaled
embedding, soft-capping and GeGLU's tanh, which linears of a family carry biases) is not modelled; a non-gated MLP is
priced as two matrices (``activation`` gelu), a gated one as three (swiglu). What changes the shapes and is not read
here is refused: OPT's ``word_embed_proj_dim`` other than ``hidden_size`` (its projections in and out).

>>> spec = priced_from_hf_dict({"model_type": "opt", "num_hidden_layers": 40, "hidden_size": 5120,
...                             "num_attention_heads": 40, "ffn_dim": 20480, "vocab_size": 50272}, "opt-13b")
>>> spec.priced_only, spec.num_kv_heads, spec.activation, spec.max_position, spec.tie_embeddings
('opt', 40, 'gelu', 2048, True)
"""

from __future__ import annotations

from typing import Any

from flexmesh.errors import SpecError
from flexmesh.spec.shape import ModelSpec

PRICED_FAMILIES = ("opt", "gpt_neox", "falcon", "gemma", "gemma2", "gpt2", "gpt_bigcode", "gptj", "phi", "phi3",
                   "starcoder2", "mpt", "bloom")
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


def layer_slides(cfg: dict, where: str, layers: int) -> tuple[bool, ...] | None:
    """Which layers the config's ``layer_types`` marks ``"sliding_attention"`` (None without that list); a list
    of another length, or a type other than full or sliding attention, is refused."""
    types = cfg.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != layers:
        raise SpecError(f"{where}: layer_types must list one type per layer ({layers}), got {types!r}")
    odd = sorted({str(t) for t in types if t not in ("full_attention", "sliding_attention")})
    if odd:
        raise SpecError(f"{where}: layer_types {odd} are not supported; only full_attention and sliding_attention")
    return tuple(t == "sliding_attention" for t in types)


def window_pair(window: int | None, slides: tuple[bool, ...]) -> tuple[int | None, tuple[bool, ...] | None]:
    """``(sliding_window, window_layers)`` as a :class:`~flexmesh.spec.shape.ModelSpec` holds them: None where no
    layer slides, window_layers None where every layer does."""
    if window is None or not any(slides):
        return None, None
    return int(window), None if all(slides) else slides


def _windows(cfg: dict, where: str, layers: int, default: Any = None,
             sliding: Any = None) -> tuple[int | None, tuple[bool, ...] | None]:
    """The config's ``sliding_window`` (else ``default``) on the layers its ``layer_types`` marks sliding, else on
    those ``sliding(i)`` says (else every layer), as :func:`window_pair` gives them."""
    window = cfg.get("sliding_window", default)
    if window is not None:
        window = _int({"sliding_window": window}, where, "sliding_window")
    slides = layer_slides(cfg, where, layers)
    if slides is None:
        slides = tuple(sliding(i) if sliding else True for i in range(layers))
    return window_pair(window, slides)


def priced_from_hf_dict(cfg: dict, name: str | None = None, where: str = "config.json") -> ModelSpec:
    """The shapes of a config of one of :data:`PRICED_FAMILIES` (see the module doc)."""
    family = cfg.get("model_type")
    if family not in PRICED_FAMILIES:
        raise SpecError(f"{where}: model_type {family!r} is not one of {', '.join(PRICED_FAMILIES)}")
    layers = _int(cfg, where, "num_hidden_layers", "n_layer", "n_layers")
    hidden = _int(cfg, where, "hidden_size", "n_embd", "d_model")
    heads = _int(cfg, where, "num_attention_heads", "n_head", "n_heads")
    vocab = _int(cfg, where, "vocab_size")
    kw: dict[str, Any] = {"norm": "layernorm", "activation": "gelu", "kv": heads, "tie": False, "bias": True,
                          "position": "rope", "head_dim": None, "window": (None, None)}
    if family in ("gpt2", "gpt_bigcode"):  # learned positions, a c_fc / c_proj MLP, tied head
        ffn = _int(cfg, where, "n_inner", default=4 * hidden)
        ctx = _int(cfg, where, "n_positions", "max_position_embeddings", default=1024)
        kv = 1 if family == "gpt_bigcode" and cfg.get("multi_query", True) else heads
        kw.update(position="learned", kv=kv, tie=bool(cfg.get("tie_word_embeddings", True)))
    elif family == "gptj":
        ffn = _int(cfg, where, "n_inner", default=4 * hidden)
        ctx = _int(cfg, where, "n_positions", "max_position_embeddings", default=2048)
        kw.update(tie=bool(cfg.get("tie_word_embeddings", False)))
    elif family == "phi":
        ffn = _int(cfg, where, "intermediate_size", default=8192)
        ctx = _int(cfg, where, "max_position_embeddings", default=2048)
        kw.update(kv=_int(cfg, where, "num_key_value_heads", default=heads),
                  tie=bool(cfg.get("tie_word_embeddings", False)))
    elif family == "phi3":  # fused gate_up: three matrices, RMSNorm, no biases
        ffn = _int(cfg, where, "intermediate_size", default=8192)
        ctx = _int(cfg, where, "max_position_embeddings", default=4096)
        kw.update(norm="rmsnorm", activation="swiglu", bias=False, tie=bool(cfg.get("tie_word_embeddings", False)),
                  kv=_int(cfg, where, "num_key_value_heads", default=heads), window=_windows(cfg, where, layers))
    elif family == "starcoder2":
        ffn = _int(cfg, where, "intermediate_size", default=12288)
        ctx = _int(cfg, where, "max_position_embeddings", default=4096)
        kw.update(kv=_int(cfg, where, "num_key_value_heads", default=2), bias=bool(cfg.get("use_bias", True)),
                  tie=bool(cfg.get("tie_word_embeddings", True)), window=_windows(cfg, where, layers))
    elif family == "mpt":  # ALiBi (no position weights), expansion_ratio x d_model MLP, tied
        attn = cfg.get("attn_config") or {}
        if not isinstance(attn, dict):
            raise SpecError(f"{where}: attn_config must be an object, got {attn!r}")
        ffn = int(_int(cfg, where, "expansion_ratio", default=4) * hidden)
        ctx = _int(cfg, where, "max_seq_len", default=2048)
        kw.update(kv=_int(attn, where, "kv_n_heads", default=heads), bias=not cfg.get("no_bias", True),
                  tie=bool(cfg.get("tie_word_embeddings", True)))
    elif family == "bloom":  # ALiBi, a 4 x hidden MLP, tied; context: ALiBi sets none, priced at the 2048 it trained
        ffn = 4 * hidden
        ctx = _int(cfg, where, "seq_length", "max_position_embeddings", default=2048)
        kw.update(tie=bool(cfg.get("tie_word_embeddings", True)))
    elif family == "opt":
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
        if cfg.get("new_decoder_architecture"):
            kv = _int(cfg, where, "num_kv_heads", default=heads)
        else:
            kv = 1 if cfg.get("multi_query", True) else heads
        ffn = _int(cfg, where, "ffn_hidden_size", default=4 * hidden)
        ctx = _int(cfg, where, "max_position_embeddings", default=2048)
        kw.update(kv=kv, bias=bool(cfg.get("bias", False)), tie=bool(cfg.get("tie_word_embeddings", True)))
    else:  # gemma, gemma2: GeGLU (three matrices), RMSNorm, rotary, head_dim 256 by default, tied
        gemma2 = family == "gemma2"
        ffn = _int(cfg, where, "intermediate_size", default=9216 if gemma2 else 24576)
        ctx = _int(cfg, where, "max_position_embeddings", default=8192)
        kw.update(norm="rmsnorm", activation="swiglu", bias=False, tie=bool(cfg.get("tie_word_embeddings", True)),
                  kv=_int(cfg, where, "num_key_value_heads", default=4 if gemma2 else 16),
                  head_dim=_int(cfg, where, "head_dim", default=256))
        if gemma2:  # Gemma2Config: a 4096-token window on the even-numbered layers unless layer_types says
            kw["window"] = _windows(cfg, where, layers, default=4096, sliding=lambda i: i % 2 == 0)
    dtype = _DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"), "bf16")
    head_dim = kw["head_dim"] if kw["head_dim"] != hidden // heads else None
    return ModelSpec(name=name or family, num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=kw["kv"],
                     ffn_hidden=ffn, vocab=vocab, norm=kw["norm"], activation=kw["activation"],
                     position=kw["position"], tie_embeddings=kw["tie"], linear_bias=kw["bias"],
                     head_dim_override=head_dim, max_position=ctx, dtype=dtype, sliding_window=kw["window"][0],
                     window_layers=kw["window"][1], priced_only=family)
