"""A Llama-family decoder in plain PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

No distributed code lives here: parallelism is applied afterwards, from outside
(flexmesh.runtime.parallel.parallelize; context parallelism replaces what each layer's attention calls,
``Attention.core``: flexmesh.runtime.parallel.context).
Module names follow one fixed layout so tensor parallelism, pipeline splitting, checkpoints and the
Hugging Face weight mapping can address parts by name::

    tok_embeddings            nn.Embedding(vocab, hidden)
    layers["0".."L-1"]        TransformerBlock
        attention_norm        RMSNorm
        attention             Attention: wq, wk, wv, wo (nn.Linear; q/k/v biases when spec.qkv_bias,
                              a wo bias when spec.attention_out_bias); q_norm, k_norm when spec.qk_norm
                              (per head, or over the whole projections: spec.qk_norm_scope)
        ffn_norm              RMSNorm
        feed_forward          FeedForward: w1 (gate), w2 (down), w3 (up) (biases when spec.mlp_bias)
    norm                      RMSNorm
    output                    nn.Linear(hidden, vocab), or None when tied to tok_embeddings

A pipeline stage deletes the layers it does not own (``del model.layers["3"]``) and sets missing
ends to None: without ``tok_embeddings`` the forward takes hidden states instead of token ids;
without ``norm`` it returns hidden states instead of logits.

What every layer of a micro-batch shares is computed once per micro-batch, before the first layer,
into a :class:`Row`: the documents' boundaries (flexmesh.runtime.model.attention_kernels.Documents, on the
device and on the host, with the attention kernels' per-row structures such as FlexAttention's block
mask), and RoPE's cos and sin of every token's position (positions restart at every packed document
and come from the batch). Attention never looks across a document (flexmesh.runtime.model.attention); a
layer with a sliding window (``spec.window_of(layer)``) passes it to the kernel too. A micro-batch
holding a piece of a cut document brings a view of the keys and values carried between micro-batches
(``batch.carry``), which every layer's attention reads and extends (flexmesh.runtime.model.carry).

The attention core runs outside ``torch.compile`` (:func:`attention_core`): compiled blocks
(``--compile``) fuse the norms, RoPE, the SwiGLU and the residual adds around it, while the core's
kernels, its host-side loops over documents and any collectives of an installed core stay as they are.

With ``labels`` the model's last stage returns the summed cross-entropy itself, computed chunk by
chunk from the final hidden states (flexmesh.runtime.model.loss.linear_cross_entropy): the full logits
never exist.
"""

from __future__ import annotations

import math
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from flexmesh.errors import SpecError
from flexmesh.runtime.model.attention import AttentionCore, Documents, attend
from flexmesh.runtime.model.carry import CarryView
from flexmesh.runtime.model.lora import AdapterRow
from flexmesh.runtime.model.loss import linear_cross_entropy
from flexmesh.runtime.model.moe import MoEFeedForward
from flexmesh.runtime.model.params import canonical_name, copy_full_, host_threads, is_adapter
from flexmesh.runtime.model.rope import apply_rope, rope_cos_sin
from flexmesh.spec.model import ModelSpec

if TYPE_CHECKING:  # runtime.packing owns PackedBatch; the model only reads positions and cu_seqlens
    from flexmesh.runtime.model.packing import PackedBatch


def check_supported(spec: ModelSpec) -> None:
    """Reject shapes this Llama-family runtime cannot build, saying what to change."""
    wrong = []
    if spec.norm != "rmsnorm":
        wrong.append(f"norm={spec.norm!r} (needs 'rmsnorm')")
    if spec.activation != "swiglu":
        wrong.append(f"activation={spec.activation!r} (needs 'swiglu')")
    if spec.position != "rope":
        wrong.append(f"position={spec.position!r} (needs 'rope')")
    if spec.linear_bias:
        wrong.append("linear_bias=True (use qkv_bias, attention_out_bias and mlp_bias)")
    if spec.head_dim % 2:
        wrong.append(f"head_dim={spec.head_dim} (RoPE needs an even head dimension)")
    if wrong:
        raise SpecError(
            f"model {spec.name!r} cannot be trained by the flexmesh runtime, which builds Llama-family "
            f"decoders: {'; '.join(wrong)}. Use a Llama/Mistral/Qwen2 config or preset."
        )


# ---- what the layers of a micro-batch share ---------------------------------------------------------
@dataclass
class Row:
    """One micro-batch as every layer reads it, built once (:func:`make_row`): its documents, RoPE's
    cos and sin [B, T, head_dim] in fp32 (each layer casts them to its compute dtype), and the view of
    carried keys and values of cut documents (None without)."""

    docs: Documents
    cos: torch.Tensor
    sin: torch.Tensor
    carry: CarryView | None = None
    adapters: AdapterRow | None = None  # the tokens' tasks, where the model carries LoRA adapters
    real: int | None = None  # leading tokens that are documents, not padding (None: all); experts route those


def make_row(spec: ModelSpec, positions: torch.Tensor, cu_seqlens: torch.Tensor,
             bounds: tuple[int, ...] | None = None, total: int | None = None,
             carry: CarryView | None = None) -> Row:
    """The :class:`Row` of a micro-batch with these ``positions`` [B, T_local] and document boundaries
    (``cu_seqlens``; ``bounds``, the same on the host, spares reading a device tensor back). ``total``:
    the whole row's tokens when this rank holds a context-parallel slice (default: the last boundary)."""
    docs = Documents(cu_seqlens, bounds, total=total)
    cos, sin = rope_cos_sin(positions, spec.head_dim, spec.rope_theta, torch.float32, spec.rope_scaling,
                            docs.cu, total=docs.total)
    return Row(docs, cos, sin, carry)


@torch.compiler.disable
def attention_core(attn: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: Row) -> torch.Tensor:
    """softmax(QK^T)V of layer ``attn`` over the row's documents (q, k, v [B, H, T, D]), outside
    ``torch.compile`` (see the module doc); under selective recomputation it keeps nothing for
    backward and runs again there (its inputs q, k, v are kept)."""
    args = (q, k, v, row.docs, attn.window, row.carry, attn.layer)
    if attn.recompute_core and torch.is_grad_enabled():
        # preserve_rng_state off: attention draws no random numbers (no dropout)
        out = checkpoint(attn.core, *args, use_reentrant=False, preserve_rng_state=False)
    else:
        out = attn.core(*args)
    # One layout whatever the kernel returned (the compiled rest of the block would be specialised on
    # each): [B, T, H, D] dense in memory, which the caller's transpose and flatten read without a copy
    b, h, t, d = out.shape
    if out.stride() != (t * h * d, d, h * d, 1):
        out = out.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2)
    torch._dynamo.maybe_mark_dynamic(out, 2)  # the compiled rest of the block takes any length (Transformer.forward)
    return out


# ---- blocks --------------------------------------------------------------------------------------
def adapted(owner: Attention | FeedForward, name: str, x: torch.Tensor, row: Row | None) -> torch.Tensor:
    """Projection ``name`` of ``owner`` applied to ``x``, plus its LoRA adapters' addition where it has
    some (flexmesh.runtime.model.lora) and the row says which task each token belongs to."""
    y = getattr(owner, name)(x)
    adapters = owner.adapters
    if adapters is None or name not in adapters or row is None or row.adapters is None:
        return y
    return y + adapters[name](x, row.adapters)


class Attention(nn.Module):
    """Grouped-query self-attention over packed documents.

    The number of heads is read from the projection outputs (``-1`` in the views), so the same code
    runs when tensor parallelism has left this rank a column shard of wq/wk/wv.
    """

    def __init__(self, spec: ModelSpec, layer: int = 0):
        super().__init__()
        self.head_dim = spec.head_dim
        self.window = spec.window_of(layer)  # sliding window of this layer (None: plain causal)
        self.layer = layer  # keys of a cut document are carried per layer (flexmesh.runtime.model.carry)
        self.wq = nn.Linear(spec.hidden, spec.q_dim, bias=spec.qkv_bias)
        self.wk = nn.Linear(spec.hidden, spec.kv_dim, bias=spec.qkv_bias)
        self.wv = nn.Linear(spec.hidden, spec.kv_dim, bias=spec.qkv_bias)
        self.wo = nn.Linear(spec.q_dim, spec.hidden, bias=spec.attention_out_bias)
        # Qwen3 normalises each head of q and k (over head_dim) before RoPE; OLMoE the whole projections
        self.norm_heads = spec.qk_norm_scope == "head"
        q_width, k_width = (spec.head_dim, spec.head_dim) if self.norm_heads else (spec.q_dim, spec.kv_dim)
        self.q_norm = nn.RMSNorm(q_width, eps=spec.norm_eps) if spec.qk_norm else None
        self.k_norm = nn.RMSNorm(k_width, eps=spec.norm_eps) if spec.qk_norm else None
        self.clip = spec.clip_qkv  # OLMoE's clip_qkv: q, k, v clamped to [-clip, clip] after the norms
        # softmax(QK^T)V over the row's documents: the local entry point, unless parallelism installs
        # another (context parallelism: flexmesh.runtime.parallel.context.apply_context_parallel)
        self.core: AttentionCore = attend
        # LoRA adapters per projection name (flexmesh.runtime.model.lora.attach_adapters), None without
        self.adapters: nn.ModuleDict | None = None
        # Selective recomputation (flexmesh.runtime.parallel.parallelize.apply_ac): see attention_core.
        self.recompute_core = False

    def forward(self, x: torch.Tensor, row: Row) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = adapted(self, "wq", x, row), adapted(self, "wk", x, row), adapted(self, "wv", x, row)
        if self.q_norm is not None and self.k_norm is not None and not self.norm_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (z.clamp(-self.clip, self.clip) for z in (q, k, v))
        q, k, v = (z.view(b, t, -1, self.head_dim) for z in (q, k, v))
        if self.q_norm is not None and self.k_norm is not None and self.norm_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = row.cos.to(q.dtype), row.sin.to(q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention_core(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), row)
        return adapted(self, "wo", out.transpose(1, 2).flatten(2), row)  # no Python int of the length: any row


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.w1 = nn.Linear(spec.hidden, spec.ffn_hidden, bias=spec.mlp_bias)
        self.w2 = nn.Linear(spec.ffn_hidden, spec.hidden, bias=spec.mlp_bias)
        self.w3 = nn.Linear(spec.hidden, spec.ffn_hidden, bias=spec.mlp_bias)
        self.adapters: nn.ModuleDict | None = None  # as Attention.adapters

    def forward(self, x: torch.Tensor, row: Row | None = None) -> torch.Tensor:
        if self.adapters is None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return adapted(self, "w2", F.silu(adapted(self, "w1", x, row)) * adapted(self, "w3", x, row), row)


class TransformerBlock(nn.Module):
    """Layer ``layer`` of ``spec`` (the index picks its attention window)."""

    def __init__(self, spec: ModelSpec, layer: int = 0):
        super().__init__()
        self.attention_norm = nn.RMSNorm(spec.hidden, eps=spec.norm_eps)
        self.attention = Attention(spec, layer)
        self.ffn_norm = nn.RMSNorm(spec.hidden, eps=spec.norm_eps)
        self.feed_forward: nn.Module = MoEFeedForward(spec) if spec.is_moe_layer(layer) else FeedForward(spec)

    def forward(self, x: torch.Tensor, row: Row) -> torch.Tensor:
        return block_forward(self.attention_norm, self.attention, self.ffn_norm, self.feed_forward, x, row)


def block_forward(attention_norm: nn.Module, attention: nn.Module, ffn_norm: nn.Module, feed_forward: nn.Module,
                  x: torch.Tensor, row: Row) -> torch.Tensor:
    """A block's computation from its four parts. A function of the parts rather than a method of the
    block: compiled (flexmesh.runtime.parallel.parallelize.apply_compile), one code serves every block,
    whatever class a wrapper gave the block itself (FSDP2 swaps the class of each module it shards,
    activation checkpointing leaves the wrapped block's), where a compiled method is specialised on it."""
    h = x + attention(attention_norm(x), row)
    if isinstance(feed_forward, MoEFeedForward):
        return h + feed_forward(ffn_norm(h), row.real)
    if feed_forward.adapters is None:  # one input, as tensor parallelism's input layouts say
        return h + feed_forward(ffn_norm(h))
    return h + feed_forward(ffn_norm(h), row)


class Transformer(nn.Module):
    """The whole decoder, or one pipeline stage of it once parts are deleted (see the module doc)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        check_supported(spec)
        self.spec = spec
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(spec, i) for i in range(spec.num_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(spec.hidden, eps=spec.norm_eps)
        self.output: nn.Linear | None = (
            None if spec.tie_embeddings else nn.Linear(spec.hidden, spec.vocab, bias=False)
        )

    def row(self, batch: "PackedBatch") -> Row:
        """The micro-batch's :class:`Row` (every layer of this model chunk reads it)."""
        # a context-parallel slice of a row knows the whole row's length (flexmesh.runtime.model.packing.shard_for_cp)
        total = getattr(batch, "row_tokens", None) or batch.positions.shape[1]
        row = make_row(self.spec, batch.positions, batch.cu_seqlens, getattr(batch, "bounds", None) or None,
                       total=total, carry=getattr(batch, "carry", None))
        row.real = getattr(batch, "real_tokens", None)
        runs = getattr(batch, "task_runs", ())
        if runs:
            row.adapters = AdapterRow.of(runs, batch.positions.device)
        return row

    def forward(self, tokens: torch.Tensor, batch: "PackedBatch", labels: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T] (or hidden states [B, T, hidden] on a stage without embeddings) ->
        logits [B, T, vocab] (or hidden states on a stage without the final norm); with ``labels``
        (a stage with the head), the summed cross-entropy of the logits against them, chunk by chunk
        (flexmesh.runtime.model.loss.linear_cross_entropy)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        row = self.row(batch)
        # Rows differ in length from micro-batch to micro-batch: compiled blocks (--compile) take the
        # length as a dynamic size from the first row on, so no later row recompiles them (without
        # this, torch.compile specialises on the first length and recompiles at the second).
        for t in (h, row.cos, row.sin):
            torch._dynamo.maybe_mark_dynamic(t, 1)
        for layer in self.layers.values():
            h = layer(h, row)
        if self.norm is None:
            return h
        h = self.norm(h)
        head = self.head_weight()
        if head is None:
            return h  # a stage that kept the norm but whose head was removed on purpose
        if labels is not None:  # a plain weight here: the trainer passes labels only without tensor parallelism
            return linear_cross_entropy(h, head, labels)
        if self.output is not None:
            return self.output(h)  # the module, whose tensor-parallel hooks (if any) gather the logits
        return F.linear(h, head)

    def head_weight(self) -> torch.Tensor | None:
        """The output projection's weight (the embedding's when tied), None on a stage without a head."""
        if self.output is not None:
            return self.output.weight
        if self.spec.tie_embeddings and self.tok_embeddings is not None:
            return self.tok_embeddings.weight
        if self.spec.tie_embeddings:
            raise SpecError(
                f"model {self.spec.name!r} ties its output to the embedding, but this pipeline stage holds "
                "the final norm without the embedding; untie the embeddings (tie_embeddings=false) or use pp=1"
            )
        return None

    # ---- initialisation --------------------------------------------------------------------------
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic initialisation, identical however the model is built or sharded.

        Every parameter draws from its own generator seeded by (seed, its qualified name), so a
        pipeline stage that dropped layers, a meta-built model materialised with ``to_empty`` and a
        model whose parameters are DTensors (FSDP2 / TP shards) all get the values the full CPU model
        gets. The full tensor is drawn on CPU and its local shard copied in (flexmesh.runtime.state.weights).

        Scheme (Llama-style): linears, experts and embeddings N(0, 0.02); output projections wo, w2
        and the experts' down scaled by 1/sqrt(2 * num_layers) so the residual stream's variance does
        not grow with depth; norm weights 1; biases 0.
        """

        depth_scale = 1.0 / math.sqrt(2.0 * self.spec.num_layers)

        def draw(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name.endswith("norm.weight"):
                return torch.ones(shape)
            if name.endswith(".bias"):
                return torch.zeros(shape)
            std = 0.02 * (depth_scale if name.endswith(("wo.weight", "w2.weight", "experts.down")) else 1.0)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            return torch.empty(shape).normal_(0.0, std, generator=gen)

        # wrappers (checkpointing, compile) must not change the seed; LoRA adapters draw their own
        # (flexmesh.runtime.model.lora.init_adapters); shapes are global, also for DTensors
        todo = [(canonical_name(n), p) for n, p in self.named_parameters() if not is_adapter(canonical_name(n))]
        # Each parameter's own generator makes the draws independent: a few threads draw them at once
        # (a 1.1B model's draws take half a minute on one core), a window at a time so that no more than a
        # few full tensors are held beside the model; the copies stay in this thread (DTensors).
        threads = host_threads()
        with ThreadPoolExecutor(threads) as pool:
            for i in range(0, len(todo), threads):
                window = todo[i:i + threads]
                for (_, param), full in zip(window, pool.map(lambda t: draw(t[0], tuple(t[1].shape)), window)):
                    copy_full_(param, full)

    def init_buffers(self) -> None:
        """Every module's buffers (the experts' routing state) to their values at construction: a model
        materialised from meta with ``to_empty`` and then loaded from a checkpoint that has no such
        tensors (Hugging Face weights) must not keep what the allocator handed out."""
        for module in self.modules():
            if isinstance(module, MoEFeedForward):
                module.reset_buffers()


def blocks(model: Transformer) -> dict[str, TransformerBlock]:
    """``model``'s decoder blocks by name (``"0"``.. ; a pipeline stage holds its own), activation
    checkpointing's wrapper looked through: the modules parallelism splits and installs into."""
    return {name: cast(TransformerBlock, getattr(block, "_checkpoint_wrapped_module", block))
            for name, block in model.layers.items()}


def build_model(spec: ModelSpec, device: str | torch.device = "meta",
                dtype: torch.dtype = torch.float32) -> Transformer:
    """Build the model on ``device`` (meta by default: no memory until parallelize materialises it).

    On a real device the weights are initialised with ``init_weights(0)``; on meta call
    ``model.to_empty(device=...)`` then ``model.init_weights(seed)`` after sharding.
    """
    if spec.priced_only:
        raise SpecError(f"model {spec.name!r} is a {spec.priced_only} config, read for its shapes to price serving; "
                        "flexmesh's runtime builds the llama, mistral and qwen families (docs/specs.md)")
    with torch.device("meta"):  # no memory and no default initialisation: init_weights sets every value
        model = Transformer(spec)
    model.to(dtype)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.init_buffers()
        model.init_weights(0)
    return model
