"""ModelSpec: the shape of a decoder-only transformer, from a preset, a GPT triple or a HF config.json.

Parameter and FLOP counts live here because they are properties of the shape alone; how long the
FLOPs take is the cost model's business (flexmesh.cost).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from flexmesh.errors import SpecError

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer.

    >>> m = MODEL_PRESETS["llama2-7b"]
    >>> round(m.total_params / 1e9, 2)
    6.74
    """

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden: int
    vocab: int
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    activation: str = "swiglu"  # swiglu | gelu
    position: str = "rope"  # rope | learned
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has biases on q, k, v only
    linear_bias: bool = False  # GPT-2/Megatron GPT: biases on every linear
    head_dim_override: int | None = None  # Mistral-Nemo style head_dim != hidden / heads
    max_position: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "vocab"):
            if getattr(self, f) <= 0:
                raise SpecError(f"model {self.name!r}: {f} must be positive, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise SpecError(
                f"model {self.name!r}: num_heads {self.num_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim_override is None and self.hidden % self.num_heads:
            raise SpecError(f"model {self.name!r}: hidden {self.hidden} is not divisible by num_heads {self.num_heads}")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise SpecError(f"model {self.name!r}: norm must be rmsnorm or layernorm, got {self.norm!r}")
        if self.activation not in ("swiglu", "gelu"):
            raise SpecError(f"model {self.name!r}: activation must be swiglu or gelu, got {self.activation!r}")
        if self.position not in ("rope", "learned"):
            raise SpecError(f"model {self.name!r}: position must be rope or learned, got {self.position!r}")
        if self.dtype not in DTYPE_BYTES:
            raise SpecError(f"model {self.name!r}: dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    # ---- shape -------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.num_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    # ---- parameters --------------------------------------------------------------------------
    @property
    def layer_linear_params(self) -> int:
        """Weights of the matmuls of one layer (what tensor parallelism splits)."""
        h = self.hidden
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        mlp = (3 if self.activation == "swiglu" else 2) * h * self.ffn_hidden
        return attn + mlp

    @property
    def layer_params(self) -> int:
        h = self.hidden
        norm = 2 * (h if self.norm == "rmsnorm" else 2 * h)
        bias = 0
        if self.qkv_bias or self.linear_bias:
            bias += self.q_dim + 2 * self.kv_dim
        if self.linear_bias:
            bias += h + (2 if self.activation == "swiglu" else 1) * self.ffn_hidden + h
        return self.layer_linear_params + norm + bias

    @property
    def embedding_params(self) -> int:
        pos = self.max_position * self.hidden if self.position == "learned" else 0
        return self.vocab * self.hidden + pos

    @property
    def head_params(self) -> int:
        """Final norm plus the LM head (zero extra weights when tied to the embedding)."""
        norm = self.hidden if self.norm == "rmsnorm" else 2 * self.hidden
        return norm + (0 if self.tie_embeddings else self.vocab * self.hidden)

    @property
    def total_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params + self.head_params

    # ---- FLOPs (forward; backward is twice the forward) --------------------------------------
    @property
    def layer_linear_flops_per_token(self) -> int:
        return 2 * self.layer_linear_params

    @property
    def layer_attn_flops_per_sq_token(self) -> int:
        """Causal attention forward FLOPs per layer per squared token: QK^T and AV over s^2/2 pairs."""
        return 2 * self.q_dim

    @property
    def head_flops_per_token(self) -> int:
        return 2 * self.vocab * self.hidden

    def model_flops(self, tokens: float, sq_tokens: float) -> float:
        """Forward + backward FLOPs of the whole model for tokens whose squared lengths sum to sq_tokens.

        This is the numerator of MFU (recomputation excluded).
        """
        per_layer = self.layer_linear_flops_per_token * tokens + self.layer_attn_flops_per_sq_token * sq_tokens
        return 3.0 * (self.num_layers * per_layer + self.head_flops_per_token * tokens)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise SpecError(f"model spec has unknown fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


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


# Shapes from each model's published config.json (Hugging Face hub model cards of meta-llama/* and Qwen/*).
MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000),
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, max_position=8192, rope_theta=500000.0),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, max_position=8192, rope_theta=500000.0),
        _llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, qkv_bias=True, max_position=32768,
               rope_theta=1e6, norm_eps=1e-6),
        _llama("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, qkv_bias=True, max_position=32768,
               rope_theta=1e6, norm_eps=1e-6),
        _llama("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, qkv_bias=True, max_position=32768,
               rope_theta=1e6, norm_eps=1e-6),
        # A small model for tests, benchmarks and the demo on CPUs.
        _llama("tiny", 4, 256, 8, 4, 688, 4096, max_position=4096),
    )
}

_GPT_RE = re.compile(r"^gpt:(\d+):(\d+):(\d+)(?::(\d+))?$")

# Hugging Face config.json keys we need, per family; all three families share Llama's names.
_HF_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
_HF_FAMILIES = ("llama", "mistral", "qwen2")


def from_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (Llama, Mistral or Qwen2 family) from disk; no network."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SpecError(f"config file {str(path)!r} does not exist")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpecError(f"{path}: not valid JSON ({e})") from e
    family = cfg.get("model_type")
    if family not in _HF_FAMILIES:
        raise SpecError(
            f"{path}: model_type {family!r} is not supported; supported families: {', '.join(_HF_FAMILIES)}"
        )
    missing = [k for k in _HF_REQUIRED if k not in cfg]
    if missing:
        raise SpecError(f"{path}: config.json is missing {', '.join(missing)} (needed for a {family} model)")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise SpecError(f"{path}: hidden_act {act!r} is not supported (flexmesh models use SwiGLU with silu)")
    dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(cfg.get("torch_dtype", "bfloat16"), "bf16")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim == cfg["hidden_size"] // heads:
        head_dim = None
    return ModelSpec(
        name=cfg.get("_name_or_path") or path.parent.name or family,
        num_layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        ffn_hidden=cfg["intermediate_size"],
        vocab=cfg["vocab_size"],
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        head_dim_override=head_dim,
        max_position=cfg.get("max_position_embeddings", 4096),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        dtype=dtype,
    )


def parse_model(text: str) -> ModelSpec:
    """A preset name, ``gpt:LAYERS:HIDDEN:HEADS[:VOCAB]``, a config.json path, or a folder holding one."""
    if text in MODEL_PRESETS:
        return MODEL_PRESETS[text]
    m = _GPT_RE.match(text)
    if m:
        L, h, a, V = m.groups()
        return gpt(int(L), int(h), int(a), int(V) if V else 51200)
    p = Path(text)
    if p.suffix == ".json" or p.is_dir():
        return from_hf_config(p)
    raise SpecError(
        f"unknown model {text!r}; known presets: {', '.join(MODEL_PRESETS)}; "
        "or give gpt:LAYERS:HIDDEN:HEADS[:VOCAB], or a path to a Hugging Face config.json"
    )


def with_dtype(model: ModelSpec, dtype: str) -> ModelSpec:
    return replace(model, dtype=dtype)
