"""KV cache bytes and capacity of an inference engine on one device.

- KV bytes per token: keys and values of every layer, ``2 x layers x kv heads x head dim x dtype bytes``
  (:func:`kv_bytes_per_token`: what a replica holds of a request, and what moves when a prefill replica hands
  it to a decode replica). On a device of a ``tp x pp`` replica: its stage's layers and its share of the KV
  heads; with ``tp`` above the KV heads each device keeps one head, replicated as vLLM replicates them.
- Sliding layers (:class:`KVGroups`, as vLLM's hybrid KV cache manager): a request holds blocks for its whole
  context in a full-attention layer and for at most the window in a sliding one.
- Capacity (:func:`kv_capacity`), as vLLM sizes its cache (``gpu_memory_utilization``, default
  :data:`VLLM_MEMORY_FRACTION` 0.9; ``vllm/v1/worker/gpu_worker.py`` ``determine_available_memory``): the
  device memory x the engine's memory fraction, less the memory outside PyTorch's allocator (the CUDA context:
  the catalogue's ``framework_reserve_gib``), the weights on the device and the peak activations of a forward
  pass of ``max_batched_tokens`` tokens with ``max_seqs`` requests sampling (the profiling run vLLM does
  before it sizes the cache); what is left holds whole blocks of ``block_tokens`` tokens.

>>> from flexmesh.spec import MODEL_PRESETS, parse_cluster
>>> m, h100 = MODEL_PRESETS["llama3-8b"], parse_cluster("8xH100").device
>>> kv_bytes_per_token(m)  # 2 x 32 layers x 8 heads x 128 x 2 B
131072
>>> c = kv_capacity(m, h100, tp=1, pp=1, max_batched_tokens=8192, max_seqs=1024)
>>> round(c.weight_bytes / 2**30, 1), c.blocks, c.tokens
(15.0, 27754, 444064)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from flexmesh.errors import SpecError
from flexmesh.spec.devices import DeviceSpec
from flexmesh.spec.model import ModelSpec
from flexmesh.units import GIB

# vLLM's default share of device memory its engine may use (EngineArgs.gpu_memory_utilization = 0.9).
VLLM_MEMORY_FRACTION = 0.9
# vLLM's default KV block (CacheConfig.block_size = 16 tokens on CUDA).
VLLM_BLOCK_TOKENS = 16
# Bytes per logit of the sampler's profiling pass: the logits gathered in fp32 and their fp32 probabilities
# (vLLM's sampler computes in float32).
SAMPLER_BYTES_PER_LOGIT = 8


def check_tp(model: ModelSpec, tp: int, pp: int = 1) -> None:
    """Refuse (one line) a degree vLLM refuses: query heads split evenly, KV heads split or replicated evenly,
    at most one stage per layer."""
    if tp < 1 or pp < 1:
        raise SpecError(f"tensor and pipeline degrees are >= 1, got tp {tp} and pp {pp}")
    if model.num_heads % tp:
        raise SpecError(f"{model.name} has {model.num_heads} attention heads, which tp {tp} does not divide; choose "
                        "a tp that divides them")
    kv = model.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise SpecError(f"{model.name}'s {kv} KV heads cannot be split or replicated evenly over tp {tp}; choose a "
                        f"tp that divides {kv} or a multiple of it")
    if pp > model.num_layers:
        raise SpecError(f"pp {pp} is more stages than {model.name}'s {model.num_layers} layers")


@dataclass(frozen=True)
class KVGroups:
    """How an engine's paged KV cache holds a model whose layers slide (vLLM's hybrid KV cache manager,
    vllm/v1/core/kv_cache_utils.py ``_get_kv_cache_groups_uniform_page_size``): the model's ``full_layers``
    full-attention layers and ``sliding_layers`` layers with a ``window`` fall into groups of :attr:`size` layers
    each (vLLM's rule: the fewer type's layer count, or the more numerous one's where that is under 1.5 times it;
    a type's last group padded to the size), :attr:`full` groups of full-attention layers and :attr:`sliding`
    groups of sliding ones. A block is ``block_tokens`` tokens of one group, and all groups draw from one pool. A
    request holds a block per ``block_tokens`` of its context in each full group, and in each sliding group only
    those of its last ``window`` tokens (older ones are freed as it moves on); its decodes read its context in the
    full layers and at most the window in the sliding ones (padding layers hold memory and are never read). A model
    without a window is one full group: its blocks are the blocks of every layer, as before.

    >>> g = KVGroups(13, 13, window=4096)  # Gemma 2 2B: every other layer slides
    >>> g.groups, g.held(1000), g.held(10_000), g.blocks(10_000, 16)
    (2, 1000.0, 7048.0, 881)
    >>> g = KVGroups(4, 22, window=512)  # Gemma 3 1B: groups of 4 layers, 1 full, 6 sliding (2 padding layers)
    >>> g.size, g.full, g.sliding, g.blocks(10_000, 16)
    (4, 1, 6, 817)
    """

    full_layers: int = 1
    sliding_layers: int = 0
    window: int | None = None

    @cached_property
    def size(self) -> int:
        """Layers per group, as vLLM sizes them."""
        counts = [n for n in (self.full_layers, self.sliding_layers) if n]
        low, high = min(counts), max(counts)
        return high if high < 1.5 * low else low

    @cached_property
    def full(self) -> int:
        return -(-self.full_layers // self.size)

    @cached_property
    def sliding(self) -> int:
        return -(-self.sliding_layers // self.size)

    @property
    def groups(self) -> int:
        return self.full + self.sliding

    @property
    def layers(self) -> int:
        return self.full_layers + self.sliding_layers

    @property
    def windowed(self) -> bool:
        return self.sliding_layers > 0

    def held(self, context: float) -> float:
        """Tokens of every layer's KV a request of ``context`` tokens reads, on average over the layers: its
        context in the full layers, at most the window in the sliding ones."""
        if not self.windowed:
            return float(context)
        assert self.window is not None
        return (self.full_layers * context + self.sliding_layers * min(context, self.window)) / self.layers

    def held_sum(self, contexts: int, short: int, short_contexts: int, n: int) -> int:
        """:meth:`held` summed over ``n`` requests whose contexts sum to ``contexts``, ``short`` of them (their
        contexts summing to ``short_contexts``) short of the window, the others holding all of it."""
        if not self.windowed:
            return contexts
        assert self.window is not None
        held = short_contexts + self.window * (n - short)
        return round((self.full_layers * contexts + self.sliding_layers * held) / self.layers)

    def held_step(self, decodes: int, short: int) -> float:
        """How much :meth:`held_sum` grows in an iteration where ``decodes`` requests each add a token, ``short`` of
        them short of the window (so growing in the sliding layers too)."""
        if not self.windowed:
            return float(decodes)
        return (self.full_layers * decodes + self.sliding_layers * short) / self.layers

    def explain(self) -> str:
        """What the groups change, for a report beside :meth:`KVCapacity.explain` (nothing without a window)."""
        if not self.windowed:
            return ""
        pad = self.groups * self.size - self.layers
        return (f"; {self.sliding} of {self.groups} KV groups of {self.size} layers slide, a request holding at most "
                f"{self.window:,} tokens of theirs" + (f" ({pad} padding layers)" if pad else ""))

    def blocks(self, tokens: int, block_tokens: int, shared: int = 0) -> int:
        """Group blocks a request holding ``tokens`` tokens takes, the first ``shared`` of them held by prefix
        cache entries (a full group's blocks; a sliding group's are its own, as it frees them moving on)."""
        own = -(-(tokens - shared) // block_tokens)
        if not self.windowed:
            return own
        assert self.window is not None
        return self.full * own + self.sliding * -(-min(tokens, self.window) // block_tokens)

    def reserve(self, tokens: int, block_tokens: int, shared: int, in_flight: int) -> int:
        """Group blocks vLLM asks to be free before it admits a request of ``tokens`` known tokens whose first
        ``shared`` a prefix cache holds (``scheduler_reserve_full_isl``: ``KVCacheManager.allocate_slots`` with
        ``full_sequence_must_fit``): :meth:`blocks` of them all, a sliding group's at most those of ``window - 1``
        tokens and the ``in_flight`` ones an iteration computes, and one more for a window that starts mid-block
        (``SlidingWindowSpec.max_admission_blocks_per_request``)."""
        own = -(-(tokens - shared) // block_tokens)
        if not self.windowed:
            return own
        assert self.window is not None
        cap = -(-(self.window - 1 + in_flight) // block_tokens) + 1
        return self.full * own + self.sliding * min(-(-tokens // block_tokens), cap)

    def pool(self, cap: KVCapacity) -> int:
        """Group blocks in the KV cache ``cap``: as given (vLLM's ``num_gpu_blocks_override`` counts them), or its
        memory over a group's block (``cap``'s blocks are of every layer)."""
        if cap.blocks_given is not None:
            return cap.blocks_given
        return cap.blocks * self.layers // self.size

    def room(self, cap: KVCapacity) -> int:
        """Tokens of :meth:`held` the KV cache ``cap`` holds: its pool shared evenly over the groups (the
        planner's approximation; the simulator counts blocks). Without a window, ``cap``'s tokens."""
        return self.pool(cap) * cap.block_tokens // self.groups

    def fits(self, tokens: int, cap: KVCapacity) -> bool:
        """Whether the KV cache ``cap`` holds a request of ``tokens`` tokens alone."""
        return self.blocks(tokens, cap.block_tokens) <= self.pool(cap)


# Every layer attending to the whole context: one group, blocks of every layer's KV.
FULL_ATTENTION = KVGroups()


def kv_groups(model: ModelSpec) -> KVGroups:
    """:class:`KVGroups` of ``model``: its full-attention and sliding layers (:data:`FULL_ATTENTION` where none
    slides)."""
    windows = model.attention_windows if model.sliding_window is not None else ()
    sliding = sum(w is not None for w in windows)
    if not sliding:
        return FULL_ATTENTION
    return KVGroups(model.num_layers - sliding, sliding, model.sliding_window)


def kv_heads_per_device(model: ModelSpec, tp: int) -> int:
    """KV heads a device of a ``tp`` group keeps: its share, or one (replicated) when ``tp`` exceeds them."""
    return max(1, model.num_kv_heads // tp)


def kv_bytes_per_token(model: ModelSpec) -> int:
    """Keys and values of one token over every layer, all heads: what a request's KV cache holds per token."""
    return 2 * model.num_layers * model.kv_dim * model.dtype_bytes


def kv_bytes_per_token_on_device(model: ModelSpec, tp: int, pp: int) -> int:
    """Keys and values of one token on one device of a ``tp x pp`` replica (its stage's layers, the most any
    stage holds, and its KV heads)."""
    layers = math.ceil(model.num_layers / pp)
    return 2 * layers * kv_heads_per_device(model, tp) * model.head_dim * model.dtype_bytes


def weight_bytes_on_device(model: ModelSpec, tp: int, pp: int) -> float:
    """Weights on the busiest device of a ``tp x pp`` replica: its stage's layers (the most any stage holds)
    and the embedding (first stage) or the head (last stage; with a tied head the last stage loads the
    embedding's matrix too), split by tp (vocabulary-parallel embedding and head, as vLLM shards them)."""
    layers = math.ceil(model.num_layers / pp) * model.layer_params
    if pp == 1:
        return (layers + model.embedding_params + model.head_params) * model.dtype_bytes / tp
    last = model.head_params + (model.vocab * model.hidden if model.tie_embeddings else 0)
    return (layers + max(model.embedding_params, last)) * model.dtype_bytes / tp


def activation_bytes_on_device(model: ModelSpec, tp: int, max_batched_tokens: int, max_seqs: int) -> float:
    """Peak activations of the profiling forward pass: per token the residual and hidden states (``2h``) and the
    larger of a layer's attention tensors (qkv and the attention output) and MLP tensors (gate and up, the
    activation), split by tp; plus the sampler's logits over the whole vocabulary for ``max_seqs`` requests."""
    h, b = model.hidden, model.dtype_bytes
    attn = (2 * model.q_dim + 2 * model.kv_dim) / tp
    up = (2 if model.activation == "swiglu" else 1) * model.ffn_hidden
    mlp = (up + model.ffn_hidden) / tp
    return max_batched_tokens * (2 * h + max(attn, mlp)) * b + max_seqs * model.vocab * SAMPLER_BYTES_PER_LOGIT


@dataclass(frozen=True)
class KVCapacity:
    """How a device's memory splits (bytes) and the KV blocks that fit in what is left."""

    device_bytes: float
    fraction: float
    reserve_bytes: float  # outside the allocator: the CUDA context
    weight_bytes: float
    activation_bytes: float
    kv_bytes_per_token: int  # on this device
    block_tokens: int
    blocks_given: int | None = None  # blocks set by hand (an engine told how many), not sized from memory

    @property
    def kv_bytes(self) -> float:
        return (self.device_bytes * self.fraction - self.reserve_bytes - self.weight_bytes
                - self.activation_bytes)

    @property
    def blocks(self) -> int:
        if self.blocks_given is not None:
            return self.blocks_given
        return max(0, int(self.kv_bytes // (self.kv_bytes_per_token * self.block_tokens)))

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_tokens

    def explain(self) -> str:
        g = GIB
        if self.blocks_given is not None:
            return f"{self.blocks_given:,} blocks of {self.block_tokens} tokens, as given"
        return (f"{self.device_bytes / g:.1f} GiB x {self.fraction:g} - {self.reserve_bytes / g:.2f} GiB CUDA context "
                f"- {self.weight_bytes / g:.2f} GiB weights - {self.activation_bytes / g:.2f} GiB activations = "
                f"{self.kv_bytes / g:.2f} GiB of KV: {self.blocks:,} blocks of {self.block_tokens} tokens")


def kv_capacity(model: ModelSpec, device: DeviceSpec, tp: int, pp: int, max_batched_tokens: int, max_seqs: int,
                block_tokens: int = VLLM_BLOCK_TOKENS, fraction: float = VLLM_MEMORY_FRACTION) -> KVCapacity:
    """The KV capacity of each device of a ``tp x pp`` replica of ``model`` on ``device``; a one-line
    SpecError when not one block fits."""
    check_tp(model, tp, pp)
    if not 0 < fraction <= 1:
        raise SpecError(f"the engine's memory fraction is in (0, 1], got {fraction}")
    c = KVCapacity(device.memory_gib * GIB, fraction, device.framework_reserve_gib * GIB,
                   weight_bytes_on_device(model, tp, pp),
                   activation_bytes_on_device(model, tp, max_batched_tokens, max_seqs),
                   kv_bytes_per_token_on_device(model, tp, pp), block_tokens)
    if c.blocks < 1:
        raise SpecError(f"{model.name} at tp {tp} pp {pp} leaves no room for a KV cache on a {device.name}: "
                        f"{c.explain()}; raise tp or pp, or lower --max-batched-tokens or --max-seqs")
    return c


def served_dtype(dtype: str, device) -> str:  # noqa: ANN001 - a DeviceSpec
    """The dtype an engine serves ``dtype`` weights in on ``device``: bf16 as fp16 on a part without bf16 Tensor
    Cores (Volta, Turing: vLLM refuses bf16 there and asks for ``--dtype half``, which ``serve export`` then
    writes); else as given. The same bytes per value, so KV and weights size alike."""
    if dtype == "bf16" and "bf16" not in device.peak_tflops and "fp16" in device.peak_tflops:
        return "fp16"
    return dtype

