"""Hugging Face ``config.json`` -> ModelSpec, exactly as transformers builds the model.

Reads the Llama, Mistral, Qwen2 and Qwen3 families and the mixtures of experts Mixtral, Qwen2-MoE,
Qwen3-MoE and OLMoE (their expert fields: flexmesh.spec.hf_moe) in both the transformers 4 layout (top-level
``rope_theta``, ``rope_scaling``, ``torch_dtype``) and the transformers 5 layout (``rope_parameters``
holding ``rope_theta``, ``dtype``). A missing field takes the default of that family's transformers
config class, so a config means the same model here as there. A field that changes the math and
that flexmesh does not implement (an unknown ``rope_type``, ``partial_rotary_factor`` != 1, a layer
type other than full or sliding attention, attention dropout, ...) is a one-line SpecError, never
ignored. docs/specs.md lists what is read, the defaults and what is refused.

:func:`to_hf_config` writes the other way (transformers 5 layout), picking the family the spec's
fields need, so that ``spec_from_hf_dict(to_hf_config(spec)) == spec``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flexmesh.errors import SpecError
from flexmesh.files import read_json
from flexmesh.spec.hf_moe import MOE_FAMILIES, moe_family, moe_from_hf, moe_to_hf
from flexmesh.spec.hf_priced import PRICED_FAMILIES, layer_slides, priced_from_hf_dict, window_pair
from flexmesh.spec.shape import ModelSpec, RopeScaling
from flexmesh.spec.values import flag, number, whole

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", *MOE_FAMILIES)

# Shape fields without which a config names no particular model (transformers' defaults for them
# describe a 7B model nobody means by leaving them out).
_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")

# transformers 5.x defaults of the fields that change the math, per family (configuration_*.py).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-6},
    "mistral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "head_dim": None,
                "rms_norm_eps": 1e-6},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": None, "rms_norm_eps": 1e-6},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128, "rms_norm_eps": 1e-6},
    "mixtral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "head_dim": None,
                "rms_norm_eps": 1e-5},
    "qwen2_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 16, "head_dim": None,
                  "rms_norm_eps": 1e-6},
    "qwen3_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 4, "head_dim": None,
                  "rms_norm_eps": 1e-6},
    "olmoe": {"max_position_embeddings": 4096, "num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-5},
}
# Families whose attention is another family's (same biases, norms and windows).
_ATTENTION_OF = {"mixtral": "mistral", "qwen3_moe": "qwen3"}
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

# Keys each rope_type may carry besides rope_type/type, rope_theta and partial_rotary_factor.
_ROPE_KEYS: dict[str, set[str]] = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor", "original_max_position_embeddings"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
}


def read_hf_config(path: str | Path) -> dict:
    """The JSON object of a ``config.json`` (or of the one in folder ``path``)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    # each number used is checked by the field's own rule (whole, > 0, ...), NaN included
    cfg = read_json(path, SpecError, missing=f"config file {str(path)!r} does not exist", finite=False)
    if not isinstance(cfg, dict):
        raise SpecError(f"{path}: config.json must hold a JSON object")
    return cfg


def from_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (Llama, Mistral, Qwen2 or Qwen3 family) from disk; no network."""
    path = Path(path)
    cfg = read_hf_config(path)
    where = path / "config.json" if path.is_dir() else path
    name = cfg.get("_name_or_path") or where.parent.name
    return spec_from_hf_dict(cfg, name=name, where=str(where))


def spec_from_hf_dict(cfg: dict, name: str | None = None, where: str = "config.json") -> ModelSpec:
    """The ModelSpec of a parsed config (``where`` names it in error messages)."""
    family = cfg.get("model_type")
    if family in PRICED_FAMILIES:  # shapes only, to price serving (flexmesh.spec.hf_priced)
        return priced_from_hf_dict(cfg, name, where)
    if family not in FAMILIES:
        raise SpecError(f"{where}: model_type {family!r} is not supported; supported families: {', '.join(FAMILIES)}"
                        f" (and, priced for serving only, {', '.join(PRICED_FAMILIES)})")
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise SpecError(f"{where}: config.json is missing {', '.join(missing)} (needed for a {family} model)")
    cfg = _checked(cfg, where)
    defaults = _DEFAULTS[family]
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise SpecError(f"{where}: hidden_act {act!r} is not supported (flexmesh models use SwiGLU with silu)")
    if float(cfg.get("attention_dropout") or 0.0) != 0.0:
        raise SpecError(f"{where}: attention_dropout {cfg['attention_dropout']} is not supported "
                        "(the flexmesh runtime has no dropout); set it to 0.0")
    layer_slides(cfg, where, cfg["num_hidden_layers"])
    heads = cfg["num_attention_heads"]
    # An explicit null means "as many as query heads" in every family; an absent key is the default.
    kv_heads = cfg.get("num_key_value_heads", defaults["num_key_value_heads"]) or heads
    head_dim = cfg.get("head_dim", defaults["head_dim"])
    if head_dim is not None and head_dim == cfg["hidden_size"] // heads:
        head_dim = None
    max_position = int(cfg.get("max_position_embeddings", defaults["max_position_embeddings"]))
    theta, scaling = _rope(cfg, max_position, where)
    window, window_layers = _window(cfg, family)
    attention = _ATTENTION_OF.get(family, family)
    attention_bias = bool(cfg.get("attention_bias", False))
    if family == "olmoe" and head_dim is not None:
        raise SpecError(f"{where}: an OLMoE head_dim other than hidden_size / num_attention_heads is not supported "
                        "(its q norm spans hidden_size); remove head_dim")
    moe = moe_from_hf(cfg, family, where)
    return ModelSpec(
        name=name or cfg.get("_name_or_path") or family,
        num_layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        ffn_hidden=cfg["intermediate_size"],
        vocab=cfg["vocab_size"],
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and never an o_proj bias (Qwen2-MoE: qkv_bias, default on);
        # Mistral and Mixtral have none; Llama, Qwen3(-MoE) and OLMoE put attention_bias on all four.
        qkv_bias=attention == "qwen2" or (family == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))
        or (attention in ("llama", "qwen3", "olmoe") and attention_bias),
        attention_out_bias=attention in ("llama", "qwen3", "olmoe") and attention_bias,
        mlp_bias=family == "llama" and bool(cfg.get("mlp_bias", False)),
        qk_norm=attention in ("qwen3", "olmoe"),
        qk_norm_scope="projection" if family == "olmoe" else "head",
        clip_qkv=cfg.get("clip_qkv") if family == "olmoe" else None,
        head_dim_override=head_dim,
        max_position=max_position,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(cfg.get("rms_norm_eps", defaults["rms_norm_eps"])),
        dtype=_dtype(cfg, where),
        sliding_window=window,
        window_layers=window_layers,
        moe=moe,
    )


def hf_sliding_window(cfg: dict, family: str) -> tuple[int | None, tuple[bool, ...] | None]:
    """``(sliding_window, window_layers)`` of a Hugging Face config, as transformers' models read it.

    Mistral: ``sliding_window`` on every layer (null: none; MistralModel ignores ``layer_types``).
    Qwen2: none unless ``use_sliding_window``; then the layers ``layer_types`` marks
    ``"sliding_attention"``, or without that list layers ``i >= max_window_layers`` (Qwen2Config).
    Llama has no window. A window no layer uses is dropped; ``window_layers`` is None when all slide.

    >>> hf_sliding_window({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1,
    ...                    "num_hidden_layers": 3}, "qwen2")
    (4, (False, True, True))
    """
    window = cfg.get("sliding_window")
    layers = cfg["num_hidden_layers"]
    if family == "qwen2":
        if not cfg.get("use_sliding_window", False):
            window = None
        slides = layer_slides(cfg, "config.json", layers)
        if slides is None:
            start = cfg.get("max_window_layers", 28)  # Qwen2Config's default
            slides = tuple(i >= start for i in range(layers))
    elif family == "mistral":
        slides = (True,) * layers
    else:
        window = None
        slides = (False,) * layers
    return window_pair(window, slides)


def _window(cfg: dict, family: str) -> tuple[int | None, tuple[bool, ...] | None]:
    """``(sliding_window, window_layers)`` as each family's transformers model reads them: Mixtral as
    Mistral; Qwen3 and Qwen2 alike; Qwen3-MoE on every layer when ``use_sliding_window``; Qwen2-MoE
    by ``layer_types``, else its own default (odd-numbered layers below ``max_window_layers``); OLMoE
    none."""
    if family == "qwen3_moe":
        return (int(cfg["sliding_window"]), None) if cfg.get("use_sliding_window") and cfg.get("sliding_window") \
            else (None, None)
    if family == "qwen2_moe" and cfg.get("layer_types") is None and cfg.get("use_sliding_window"):
        start = cfg.get("max_window_layers", 28)
        cfg = {**cfg, "layer_types": ["sliding_attention" if (i + 1) % 2 and i < start else "full_attention"
                                      for i in range(cfg["num_hidden_layers"])]}
    window, layers = hf_sliding_window(cfg, {"qwen3": "qwen2", "qwen2_moe": "qwen2", "mixtral": "mistral"}.get(family,
                                                                                                        family))
    if window == 0:
        raise SpecError(f"a sliding_window of 0 would let no token see any other; set use_sliding_window false "
                        f"or give a window (model_type {family})")
    return window, layers


# Keys read as counts, numbers and flags. A null is allowed where transformers gives it a meaning
# (the _NULLABLE ones: "as many as query heads", "hidden / heads", "no window"); elsewhere it is refused.
_WHOLE = (*_REQUIRED, "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window",
          "original_max_position_embeddings")
_NULLABLE = ("num_key_value_heads", "head_dim", "sliding_window", "original_max_position_embeddings",
             "partial_rotary_factor", "rope_scaling", "rope_parameters", "dtype", "torch_dtype", "layer_types",
             "clip_qkv", "mlp_only_layers")
_POSITIVE = ("rope_theta", "rms_norm_eps", "partial_rotary_factor", "clip_qkv")
_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "qkv_bias")


def _checked(cfg: dict, where: str) -> dict:
    """``cfg`` with every value flexmesh reads checked for its type and range (SpecError naming the key)."""
    for key, value in cfg.items():
        if value is None and key not in _REQUIRED:  # a required count that is null: whole() says what it must be
            if key in (*_WHOLE, *_POSITIVE, *_FLAGS, "attention_dropout", "max_window_layers") \
                    and key not in _NULLABLE:
                raise SpecError(f"{where}: {key} is null; give a value or leave the key out")
            continue
        what = f"{where}: {key}"
        if key == "sliding_window":  # transformers 5 writes 0 for "off" in the Qwen MoE families
            whole(value, what, SpecError, minimum=0)
        elif key in _WHOLE:
            whole(value, what, SpecError)
        elif key == "max_window_layers":
            whole(value, what, SpecError, minimum=0)
        elif key in _POSITIVE:
            number(value, what, SpecError)
        elif key == "attention_dropout":
            number(value, what, SpecError, strict=False, maximum=1.0)
        elif key in _FLAGS:
            flag(value, what, SpecError)
        elif key == "_name_or_path" and not isinstance(value, str):
            raise SpecError(f"{what} must be a string, got {value!r}")
    return cfg


def _dtype(cfg: dict, where: str) -> str:
    """transformers 5 writes ``dtype``, 4 wrote ``torch_dtype``; neither: bf16 (how flexmesh trains)."""
    raw = cfg.get("dtype", cfg.get("torch_dtype"))
    if raw is None or raw == "auto":
        return "bf16"
    if not isinstance(raw, str) or raw not in _DTYPES:
        raise SpecError(f"{where}: dtype {raw!r} is not supported; use one of {', '.join(_DTYPES)}")
    return _DTYPES[raw]


def _rope(cfg: dict, max_position: int, where: str) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from ``rope_parameters`` (transformers 5) or top-level keys (4).

    Precedence as in transformers: ``rope_scaling`` if set, else ``rope_parameters``; inside it,
    ``rope_theta`` wins over the top-level one, which wins over 10000.
    """
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise SpecError(f"{where}: rope_parameters must be a JSON object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise SpecError(f"{where}: per-layer-type rope_parameters are not supported; give one RoPE for all layers")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in _ROPE_KEYS:
        raise SpecError(f"{where}: rope_type {rope_type!r} is not supported; "
                        f"use one of {', '.join(_ROPE_KEYS)}")
    for key, value in params.items():
        if key == "rope_theta" and value is None:
            raise SpecError(f"{where}: rope parameter rope_theta is null; give a value or leave the key out")
        if key in ("rope_type", "type", "truncate") or value is None:
            continue
        if key == "original_max_position_embeddings":
            whole(value, f"{where}: rope parameter {key}", SpecError)
        else:
            number(value, f"{where}: rope parameter {key}", SpecError, strict=key not in ("mscale", "mscale_all_dim",
                                                                                           "beta_fast", "beta_slow"))
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise SpecError(f"{where}: partial_rotary_factor {partial} is not supported; flexmesh rotates whole heads")
    extra = sorted(set(params) - _ROPE_KEYS[rope_type] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if extra:
        raise SpecError(f"{where}: rope parameters {extra} are not understood for rope_type {rope_type!r}; remove them")
    if rope_type == "default":
        return theta, None

    def need(key: str) -> Any:
        if params.get(key) is None:
            raise SpecError(f"{where}: rope_type {rope_type!r} needs rope parameter {key!r}")
        return params[key]

    # transformers falls back to max_position_embeddings when the original length is not given.
    # A top-level original_max_position_embeddings wins over the one in the rope parameters (as there).
    original = int(cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                   or max_position)
    try:
        if rope_type == "linear":
            return theta, RopeScaling("linear", float(need("factor")))
        if rope_type == "dynamic":
            # transformers' dynamic NTK scales relative to max_position_embeddings, not the original length
            return theta, RopeScaling("dynamic", float(need("factor")), max_position)
        if rope_type == "llama3":
            return theta, RopeScaling("llama3", float(need("factor")), original,
                                      low_freq_factor=float(need("low_freq_factor")),
                                      high_freq_factor=float(need("high_freq_factor")))
        factor = params.get("factor")
        opt = {k: float(params[k]) if params.get(k) is not None else None
               for k in ("attention_factor", "mscale", "mscale_all_dim")}
        return theta, RopeScaling(
            "yarn", float(factor) if factor is not None else max_position / original, original,
            # transformers treats a 0 or null beta as its default ("or 32", "or 1")
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
            truncate=flag(params.get("truncate", True), f"{where}: rope parameter truncate", SpecError), **opt,
        )
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from e


# ---- writing -------------------------------------------------------------------------------------
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
_HF_DTYPES = {v: k for k, v in _DTYPES.items()}


def hf_family(spec: ModelSpec) -> str:
    """The transformers family (``model_type``) that builds exactly ``spec``'s model.

    Qwen3 for q/k norms, Qwen2 for q/k/v biases without an o_proj bias, Mistral for a window on
    every layer, Qwen2 for a window on some layers (which only it can say), Llama otherwise. A
    mixture of experts: OLMoE for q/k norms over the projections, Qwen3-MoE for per-head q/k norms,
    Qwen2-MoE for a shared expert, Mixtral otherwise (flexmesh.spec.hf_moe.moe_family).

    >>> from flexmesh.spec.model import MODEL_PRESETS
    >>> hf_family(MODEL_PRESETS["qwen2.5-7b"]), hf_family(MODEL_PRESETS["llama3-8b"])
    ('qwen2', 'llama')
    >>> [hf_family(MODEL_PRESETS[n]) for n in ("mixtral-8x7b", "qwen2-57b-a14b", "qwen3-30b-a3b", "olmoe-1b-7b")]
    ['mixtral', 'qwen2_moe', 'qwen3_moe', 'olmoe']
    """
    where = f"model {spec.name!r} cannot be written as a Hugging Face config"
    wrong = [f"{k}={getattr(spec, k)!r}" for k, ok in (("norm", "rmsnorm"), ("activation", "swiglu"),
                                                        ("position", "rope")) if getattr(spec, k) != ok]
    if spec.linear_bias:
        wrong.append("linear_bias=True")
    if wrong:
        raise SpecError(f"{where}: {', '.join(wrong)} (only Llama-family decoders: rmsnorm, swiglu, rope)")
    if spec.moe is not None:
        return _moe_family(spec, where)
    if spec.qk_norm_scope != "head" or spec.clip_qkv is not None:
        raise SpecError(f"{where}: q/k norms over the whole projections and clip_qkv exist only in OLMoE, a "
                        "mixture of experts")
    biases = (spec.qkv_bias, spec.attention_out_bias)
    if spec.qk_norm:
        # Qwen3's attention_bias covers all four projections; it has no mlp_bias.
        if biases[0] != biases[1] or spec.mlp_bias:
            raise SpecError(f"{where}: with qk_norm the attention biases must be all on or all off and mlp_bias "
                            "off (Qwen3)")
        return "qwen3"
    if biases == (True, False):
        if spec.mlp_bias:
            raise SpecError(f"{where}: q/k/v biases without an o_proj bias (Qwen2) cannot have mlp_bias")
        return "qwen2"
    if biases == (False, True):
        raise SpecError(f"{where}: an o_proj bias needs q/k/v biases too (Llama attention_bias)")
    if spec.sliding_window is None:
        return "llama"
    if any(biases) or spec.mlp_bias:
        raise SpecError(f"{where}: a sliding window with attention_bias or mlp_bias has no transformers family; "
                        "drop the biases or the window")
    if spec.window_layers is None:
        return "mistral"
    raise SpecError(f"{where}: a window on some layers only exists in Qwen2 (with q/k/v biases); "
                    "slide every layer or add qkv_bias")


def _moe_family(spec: ModelSpec, where: str) -> str:
    """:func:`hf_family` of a mixture of experts: the family its experts and attention need, whose
    sliding windows can say the spec's."""
    assert spec.moe is not None
    family = moe_family(spec.moe, spec.qk_norm, spec.qk_norm_scope, spec.qkv_bias, spec.attention_out_bias,
                        spec.ffn_hidden, where)
    if spec.clip_qkv is not None and family != "olmoe":
        raise SpecError(f"{where}: clip_qkv exists only in OLMoE (q/k norms over the projections)")
    if spec.sliding_window is not None and (family == "olmoe" or (spec.window_layers is not None
                                                                  and family != "qwen2_moe")):
        raise SpecError(f"{where}: {family} cannot say this sliding window (OLMoE has none; only Qwen2-MoE slides "
                        "some layers only)")
    return family


def to_hf_config(spec: ModelSpec) -> dict:
    """The Hugging Face ``config.json`` object of ``spec`` (transformers 5 layout); SpecError when no
    supported family builds that model (see :func:`hf_family`).

    >>> from flexmesh.spec.model import MODEL_PRESETS
    >>> spec = MODEL_PRESETS["llama3.1-8b"]
    >>> cfg = to_hf_config(spec)
    >>> cfg["model_type"], cfg["rope_parameters"]["rope_type"], spec_from_hf_dict(cfg) == spec
    ('llama', 'llama3', True)
    """
    family = hf_family(spec)
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[family]],
        "model_type": family,
        "_name_or_path": spec.name,
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn_hidden,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        # Always written: Qwen3's default (128) is not hidden / heads.
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": spec.norm_eps,
        "tie_word_embeddings": spec.tie_embeddings,
        "attention_dropout": 0.0,
        "rope_parameters": _rope_parameters(spec),
        "dtype": _HF_DTYPES[spec.dtype],
    }
    if family in ("llama", "qwen3", "qwen3_moe", "olmoe"):
        cfg["attention_bias"] = spec.qkv_bias
    if family == "llama":
        cfg["mlp_bias"] = spec.mlp_bias
    if family in ("mistral", "mixtral"):
        cfg["sliding_window"] = spec.sliding_window
    if family == "qwen3_moe":
        cfg["use_sliding_window"] = spec.sliding_window is not None
        cfg["sliding_window"] = spec.sliding_window
    if family == "qwen2_moe":
        cfg["qkv_bias"] = spec.qkv_bias
    if family == "olmoe":
        cfg["clip_qkv"] = spec.clip_qkv
    if spec.moe is not None:
        cfg.update(moe_to_hf(spec.moe, family))
    if family in ("qwen2", "qwen3", "qwen2_moe"):
        windows = spec.attention_windows
        cfg["use_sliding_window"] = spec.sliding_window is not None
        cfg["sliding_window"] = spec.sliding_window
        # Written out per layer: max_window_layers can only say "from layer k on".
        cfg["layer_types"] = ["full_attention" if w is None else "sliding_attention" for w in windows]
        cfg["max_window_layers"] = spec.num_layers
    return cfg


def _rope_parameters(spec: ModelSpec) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` of ``spec``: rope_theta, rope_type and that type's keys."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    s = spec.rope_scaling
    if s is None:
        return params
    params.update(rope_type=s.rope_type, factor=s.factor)
    if s.rope_type == "dynamic":
        # transformers scales dynamic NTK relative to max_position_embeddings (see _rope)
        if s.original_max_position != spec.max_position:
            raise SpecError(f"model {spec.name!r}: dynamic RoPE scaling relative to {s.original_max_position} "
                            f"positions, not max_position {spec.max_position}, has no Hugging Face config; set "
                            "original_max_position to max_position")
    elif s.rope_type == "llama3":
        params.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                      original_max_position_embeddings=s.original_max_position)
    elif s.rope_type == "yarn":
        params.update(original_max_position_embeddings=s.original_max_position, beta_fast=s.beta_fast,
                      beta_slow=s.beta_slow, truncate=s.truncate)
        params.update({k: getattr(s, k) for k in ("attention_factor", "mscale", "mscale_all_dim")
                       if getattr(s, k) is not None})
    return params
