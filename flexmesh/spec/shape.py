"""ModelSpec: the shape of a decoder-only transformer (where models come from: flexmesh.spec.model, the
presets and the model text a user types, and flexmesh.spec.hf, a Hugging Face config.json).

Parameter and FLOP counts live here because they are properties of the shape alone; how long the
FLOPs take is the cost model's business (flexmesh.cost).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property

from flexmesh.errors import SpecError
from flexmesh.spec.limits import MAX_LAYERS, MAX_SEQ_LEN, MAX_VOCAB, MAX_WIDTH, within
from flexmesh.spec.moe import MoESpec
from flexmesh.spec.values import flag, known_keys, mapping, number, text, whole

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# transformers' rope_type values the runtime implements (flexmesh.runtime.model.transformer.rope_frequencies).
ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched past the pre-training context (transformers' ``rope_type``).

    ``original_max_position`` is the length the scaling is relative to: ``original_max_position_embeddings``
    for llama3 and yarn, ``max_position_embeddings`` for dynamic (as transformers computes it).

    >>> RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0).rope_type
    'llama3'
    """

    rope_type: str
    factor: float
    original_max_position: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None: derived from factor (and mscale, mscale_all_dim)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range outwards to whole dimensions

    def __post_init__(self) -> None:
        where = f"rope scaling {self.rope_type!r}"
        object.__setattr__(self, "factor", number(self.factor, f"{where}: factor", SpecError))
        if self.original_max_position is not None:
            object.__setattr__(self, "original_max_position",
                               whole(self.original_max_position, f"{where}: original_max_position", SpecError))
        for f in ("low_freq_factor", "high_freq_factor", "attention_factor", "mscale", "mscale_all_dim"):
            if getattr(self, f) is not None:
                object.__setattr__(self, f, number(getattr(self, f), f"{where}: {f}", SpecError, strict=False))
        for f in ("beta_fast", "beta_slow"):
            object.__setattr__(self, f, number(getattr(self, f), f"{where}: {f}", SpecError))
        flag(self.truncate, f"{where}: truncate", SpecError)
        if self.rope_type not in ROPE_TYPES:
            raise SpecError(f"rope_type {self.rope_type!r} is not supported; use one of {', '.join(ROPE_TYPES)}")
        if not self.factor > 0:
            raise SpecError(f"rope scaling factor must be positive, got {self.factor}")
        if self.rope_type != "linear" and not (self.original_max_position or 0) > 0:
            raise SpecError(f"rope_type {self.rope_type!r} needs a positive original_max_position, "
                            f"got {self.original_max_position}")
        if self.rope_type == "llama3":
            low, high = self.low_freq_factor, self.high_freq_factor
            if low is None or high is None or not high > low:
                raise SpecError(f"rope_type 'llama3' needs low_freq_factor < high_freq_factor, got {low} and {high}")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer.

    >>> from flexmesh.spec.model import MODEL_PRESETS
    >>> m = MODEL_PRESETS["llama2-7b"]
    >>> round(m.total_params / 1e9, 2)
    6.74
    >>> [round(MODEL_PRESETS[n].total_params / 1e9, 2) for n in ("mixtral-8x7b", "olmoe-1b-7b")]
    [46.7, 6.92]
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
    # Sliding-window attention (Mistral, Qwen2): a query sees the last `sliding_window` keys of its
    # document, itself included. `window_layers[i]` says whether layer i slides (None: all do).
    sliding_window: int | None = None
    window_layers: tuple[bool, ...] | None = None
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    attention_out_bias: bool = False  # a bias on the attention output projection (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False  # biases on the three MLP projections (Llama mlp_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    # Where qk_norm normalises: "head" (Qwen3: each head over head_dim) or "projection" (OLMoE: the
    # whole q and k projections, over q_dim and kv_dim)
    qk_norm_scope: str = "head"
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv]
    moe: MoESpec | None = None  # mixture-of-experts layers (flexmesh.spec.moe); None: dense
    # A family read for its shapes only (flexmesh.spec.hf_priced: OPT, Falcon, Gemma, ...): priced, never built
    priced_only: str = ""

    def __post_init__(self) -> None:
        text(self.name, "model name", SpecError)
        where = f"model {self.name!r}"
        bounds = {"num_layers": MAX_LAYERS, "vocab": MAX_VOCAB, "max_position": MAX_SEQ_LEN}
        for f in ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "vocab", "max_position"):
            value = whole(getattr(self, f), f"{where}: {f}", SpecError)
            object.__setattr__(self, f, within(value, bounds.get(f, MAX_WIDTH), f"{where}: {f}"))
        for f in ("tie_embeddings", "qkv_bias", "linear_bias", "attention_out_bias", "mlp_bias", "qk_norm"):
            flag(getattr(self, f), f"{where}: {f}", SpecError)
        for f in ("rope_theta", "norm_eps"):
            object.__setattr__(self, f, number(getattr(self, f), f"{where}: {f}", SpecError))
        for f in ("head_dim_override", "sliding_window"):
            if getattr(self, f) is not None:
                object.__setattr__(self, f, whole(getattr(self, f), f"{where}: {f} (or null)", SpecError))
        if self.clip_qkv is not None:
            object.__setattr__(self, "clip_qkv", number(self.clip_qkv, f"{where}: clip_qkv (or null)", SpecError))
        if self.qk_norm_scope not in ("head", "projection"):
            raise SpecError(f"{where}: qk_norm_scope must be 'head' or 'projection', got {self.qk_norm_scope!r}")
        if self.moe is not None:
            if self.activation != "swiglu" or self.mlp_bias or self.linear_bias:
                raise SpecError(f"{where}: experts are SwiGLU MLPs without biases; a mixture of experts needs "
                                "activation swiglu, mlp_bias and linear_bias off")
            if not isinstance(self.moe, MoESpec):
                raise SpecError(f"{where}: moe must be an object with num_experts, top_k and expert_ffn, "
                                f"got {self.moe!r}")
            if self.moe.dense_layers and self.moe.dense_layers[-1] >= self.num_layers:
                raise SpecError(f"{where}: dense layer {self.moe.dense_layers[-1]} is past the last layer "
                                f"({self.num_layers - 1})")
        if self.window_layers is not None and (not isinstance(self.window_layers, tuple)
                                               or not all(isinstance(x, bool) for x in self.window_layers)):
            raise SpecError(f"{where}: window_layers must be a list of true/false, one per layer")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise SpecError(f"{where}: rope_scaling must be an object with rope_type and factor, "
                            f"got {self.rope_scaling!r}")
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
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise SpecError(f"model {self.name!r}: dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise SpecError(f"model {self.name!r}: sliding_window must be positive or None, got {self.sliding_window}")
        if self.window_layers is not None and len(self.window_layers) != self.num_layers:
            raise SpecError(f"model {self.name!r}: window_layers names {len(self.window_layers)} layers, "
                            f"the model has {self.num_layers}")

    # ---- attention window --------------------------------------------------------------------------
    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (query i sees keys j with i - w < j <= i), None: plain causal.

        >>> m = ModelSpec("m", 3, 64, 4, 4, 128, 100, sliding_window=8, window_layers=(False, True, True))
        >>> [m.window_of(i) for i in range(3)]
        [None, 8, 8]
        """
        if self.window_layers is not None and not self.window_layers[layer]:
            return None
        return self.sliding_window

    @property
    def attention_windows(self) -> tuple[int | None, ...]:
        """:meth:`window_of` of every layer, in order."""
        return tuple(self.window_of(i) for i in range(self.num_layers))

    # ---- shape -------------------------------------------------------------------------------
    @cached_property  # asked for on every cost of every layer a search prices
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.num_heads

    @cached_property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @cached_property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    # ---- mixture of experts ------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` routes its tokens to experts (False: a dense MLP).

        >>> from flexmesh.spec.model import MODEL_PRESETS
        >>> m = MODEL_PRESETS["mixtral-8x7b"]
        >>> m.is_moe_layer(0), MODEL_PRESETS["llama2-7b"].is_moe_layer(0)
        (True, False)
        """
        return self.moe is not None and layer not in self.moe.dense_layers

    @cached_property
    def moe_layers(self) -> int:
        """How many layers are MoE layers."""
        return 0 if self.moe is None else self.num_layers - len(self.moe.dense_layers)

    # ---- parameters --------------------------------------------------------------------------
    @cached_property
    def attention_linear_params(self) -> int:
        h = self.hidden
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h

    @cached_property
    def dense_mlp_params(self) -> int:
        return (3 if self.activation == "swiglu" else 2) * self.hidden * self.ffn_hidden

    def _per_layer_mean(self, moe_value: int) -> int:
        """A per-layer count averaged over the layers (dense MLP layers and MoE layers), rounded."""
        dense = self.num_layers - self.moe_layers
        return round((dense * self.dense_mlp_params + self.moe_layers * moe_value) / self.num_layers)

    @cached_property
    def layer_linear_params(self) -> int:
        """Weights of the matmuls of one layer (what tensor parallelism splits); with experts, every
        expert's, averaged over the layers where some keep a dense MLP."""
        if self.moe is None:
            return self.attention_linear_params + self.dense_mlp_params
        return self.attention_linear_params + self._per_layer_mean(self.moe.total_params(self.hidden))

    @cached_property
    def layer_active_linear_params(self) -> int:
        """Matmul weights one token of one layer multiplies with (what its FLOPs count): with experts,
        the router's, its ``top_k`` experts' and the shared expert's, averaged over the layers."""
        if self.moe is None:
            return self.layer_linear_params
        return self.attention_linear_params + self._per_layer_mean(self.moe.active_params(self.hidden))

    @cached_property
    def layer_params(self) -> int:
        h = self.hidden
        norm = 2 * (h if self.norm == "rmsnorm" else 2 * h)
        bias = 0
        if self.qkv_bias or self.linear_bias:
            bias += self.q_dim + 2 * self.kv_dim
        if self.attention_out_bias or self.linear_bias:
            bias += h
        if self.mlp_bias or self.linear_bias:
            bias += (2 if self.activation == "swiglu" else 1) * self.ffn_hidden + h
        if self.qk_norm:
            norm += 2 * self.head_dim if self.qk_norm_scope == "head" else self.q_dim + self.kv_dim
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
        layers = self.num_layers * self.layer_params
        if self.moe is not None:  # exact: layer_params rounds a mean over dense and MoE layers
            dense = self.num_layers - self.moe_layers
            layers += (dense * self.dense_mlp_params + self.moe_layers * self.moe.total_params(self.hidden)
                       - self.num_layers * (self.layer_linear_params - self.attention_linear_params))
        return layers + self.embedding_params + self.head_params

    # ---- FLOPs (forward; backward is twice the forward) --------------------------------------
    @property
    def layer_linear_flops_per_token(self) -> int:
        return 2 * self.layer_active_linear_params

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

    def describe(self) -> str:
        """One line of what was parsed: parameters, layers, width, heads, vocabulary, tied or not, dtype.

        >>> from flexmesh.spec.model import parse_model
        >>> parse_model("llama3-8b").describe()
        'llama3-8b: 8.03B parameters, 32 layers, hidden 4096, 32 heads (8 KV), vocab 128,256, untied, bf16'
        """
        experts = f", {self.moe.num_experts} experts" if self.moe is not None else ""
        return (f"{self.name}: {self.total_params / 1e9:.3g}B parameters, {self.num_layers} layers, hidden "
                f"{self.hidden}, {self.num_heads} heads ({self.num_kv_heads} KV){experts}, vocab {self.vocab:,}, "
                f"{'tied' if self.tie_embeddings else 'untied'}, {self.dtype}")

    def to_dict(self) -> dict:
        d = asdict(self)
        # Left out when unset, so models without a window keep the dicts (and profile hashes) they had.
        for key in ("sliding_window", "window_layers"):
            if d[key] is None:
                del d[key]
        if d.get("window_layers") is not None:
            d["window_layers"] = list(d["window_layers"])
        # Same for the fields of Hugging Face exactness and experts: absent when off.
        for key in ("rope_scaling", "attention_out_bias", "mlp_bias", "qk_norm", "clip_qkv", "moe", "priced_only"):
            if not d[key]:
                del d[key]
        if d["qk_norm_scope"] == "head":
            del d["qk_norm_scope"]
        if self.moe is not None:
            d["moe"] = self.moe.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        mapping(d, "model spec", SpecError)
        known = {f for f in cls.__dataclass_fields__}
        known_keys(d, known, "model spec", SpecError)
        if isinstance(d.get("window_layers"), list):  # JSON has lists; the frozen spec keeps a hashable tuple
            d = {**d, "window_layers": tuple(d["window_layers"])}
        if d.get("moe") is not None:
            d = {**d, "moe": MoESpec.from_dict(d["moe"])}
        if isinstance(d.get("rope_scaling"), dict):
            try:
                d = {**d, "rope_scaling": RopeScaling(**d["rope_scaling"])}
            except TypeError as e:
                raise SpecError(f"model spec has a malformed rope_scaling {d['rope_scaling']}: {e}") from e
        try:
            return cls(**d)
        except TypeError as e:  # a required field left out
            raise SpecError(f"model spec is incomplete ({e}); it needs name, num_layers, hidden, num_heads, "
                            "num_kv_heads, ffn_hidden and vocab") from e
