"""An engine iteration priced kernel by kernel on the device layer (:class:`AnalyticIteration`).

One iteration of a ``tp x pp`` replica runs every layer once over the batch's new tokens ``T`` (the decodes'
one token each plus every prefill chunk's tokens), as vLLM's model runner does (one batch in flight: the
stages of a pipeline run one after another, so pipelining here buys memory, not speed). Kernel times are the
device layer's kernel-true ones (``Hardware.device_kernels``, :class:`flexmesh.cost.device.kernels.Kernels` in
the measured tables' forms: aiconfigurator-core's vLLM tables, no training step's framework terms); a
hardware without them (a profiled machine) keeps its one measured rate per kernel kind. Per layer, on each of
the ``tp`` devices:

- the four matmuls at ``T`` rows (:func:`flexmesh.cost.device.layer_shapes.linear_shapes`): at a small batch
  each is bound by reading its weights, so the weights are read once per iteration whatever the batch;
- the pointwise operators: two norms fused with the residual add (vLLM's ``fused_add_rms_norm`` reads and
  writes the residual too) on every tp device, rotary and the activation split by tp;
- attention, one kernel for the batch: the decodes, one query each, read their whole KV (``decode_context``: the tokens
  their KV holds, at most the window in a sliding layer, a mean over the layers: KVGroups.held), memory-bound
  (:meth:`~flexmesh.cost.device.kernels.Kernels.decode_attention`: the KV bytes at the decode kernel's achieved
  bandwidth and a cost per (request, KV head); on a profiled machine the larger of their FLOPs at the attention rate and
  their bytes at the HBM rate); a prefill chunk ``(c, n)`` does ``n c + n (n + 1) / 2`` query-key pairs at the attention
  rate for blocks of ``c + n`` keys plus the per-key cost of a call, or reads its KV if that is slower (in a sliding
  layer query ``i`` sees ``min(i + 1, window)`` keys: :func:`flexmesh.cost.device.layer_shapes.attention_sq`, the
  training cost's own count); plus writing the new tokens' keys and values into the cache. The call's fixed cost (see
  :data:`VLLM_GRAPHS`): a decode-only iteration the engine replays as a CUDA graph (``graphs``) pays one kernel's launch
  cost, one it runs eagerly and an iteration with a prefill chunk the kernel's measured fixed cost;
- two all-reduces of ``T x hidden`` over the tp group (Megatron-style row-parallel outputs), as the engine runs
  them (``all_reduce``, :data:`VLLM_GRAPHS`): NCCL's measured times (called eagerly, at least the node's host
  work per call), or the engine's own all-reduce timed inside it, replayed in a CUDA graph or called eagerly.

Then the final norm, the LM head over one row per request (vLLM computes logits at each request's last
token only), gathered over tp; ``pp - 1`` sends of ``T x hidden`` between stages; the vocabulary-parallel
embedding's all-reduce; and the engine overhead per iteration (:mod:`flexmesh.cost.inference.overhead`:
a profile's, never zero; the framework term of serving; scaled by the model's layers where it was measured as
an eager engine's host time; ``multi_gpu_s`` more on a replica of more than one GPU), added to the GPU's time,
or, for an engine that overlaps its CPU work with the GPU (``overlap``: its scheduling with the previous
iteration, or an eager engine's launches with its kernels), the larger of the two. An engine whose kernels are
not the ones the tables timed is priced on ``EngineRates.on(hardware)``
(:mod:`flexmesh.cost.inference.engine_rates`: its own kernels' rates on the device layer's). Dense models only (a
mixture of experts is refused in one line).

>>> from flexmesh.cost.device.hardware import Hardware
>>> from flexmesh.spec import MODEL_PRESETS, parse_cluster
>>> it = AnalyticIteration(MODEL_PRESETS["llama3-8b"], Hardware(parse_cluster("8xH100")))
>>> one, two = it.iteration_s([(1000, 1)]), it.iteration_s([(1000, 1), (1000, 1)])
>>> round(one * 1e3, 2), round(two / one, 3)  # a decode step reads the weights; a second request adds little
(7.44, 1.02)
>>> round(it.iteration_s([(0, 4096)]) / it.iteration_s([(0, 2048)]), 2)  # a prefill scales with its tokens
1.99
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from flexmesh.cost.device.comm_tables import ENGINE_ALL_REDUCE
from flexmesh.cost.device.hardware import GroupShape, Hardware, group_shape, pipeline_crossings
from flexmesh.cost.device.kernels import Kernels
from flexmesh.cost.device.layer_shapes import attention_sq, linear_shapes, pointwise_elems
from flexmesh.cost.inference.memory import check_tp, kv_groups, kv_heads_per_device
from flexmesh.cost.inference.overhead import EngineOverhead, preset_overhead
from flexmesh.errors import SpecError
from flexmesh.spec.model import ModelSpec

# Memory-bound kernels of a layer's forward in vLLM's Llama: two fused add + RMSNorm, rotary, SiLU-and-mul.
LAYER_POINTWISE_KERNELS = 4
# The residual's elements a fused add + norm moves besides the norm's own (read and write h, twice a layer).
FUSED_RESIDUAL_ELEMS = 4
# Which iterations an engine replays as CUDA graphs (its description's ``graph_batch`` and ``graph_tokens``, the
# ``graphs`` pair here): decode-only ones of at most ``graphs[0]`` requests, and ones with prompt tokens of at most
# ``graphs[1]`` new tokens (piecewise graphs: the GEMMs, pointwise kernels and all-reduces inside, attention run
# eagerly between them). The default is vLLM V1's: iterations of up to 512 tokens, decodes as full graphs and mixed
# batches as piecewise ones (vllm/config/vllm.py _set_cudagraph_sizes: max_cudagraph_capture_size 512 below
# data-center Blackwell); (0, 0): an engine run eagerly (vLLM's --enforce-eager, transformers).
# What a replay saves, as the device layer's tables time it:
# - attention: the tables time one eager call of vLLM's attention backend, whose floor (9-18 us for decode, 8-13 us
#   for prefill, against 2-4 us for a GEMM timed the same way) is mostly the backend's host-side work per call
#   (metadata, launches). A decode-only iteration replayed as a full graph pays one kernel's launch cost
#   (Kernels.launch_s, the GPU-side fixed cost of a kernel) in place of it, the engine's own host time being the
#   per-iteration overhead term; a decode-only iteration run eagerly, and any iteration with a prefill chunk
#   (attention outside the piecewise graphs), pays the tables' fixed cost.
# - the tensor-parallel all-reduce (the description's ``all_reduce``: "nccl", nccl-tests' times, or an engine whose
#   own all-reduce aiconfigurator-core timed inside it, presets/collectives.toml ``<engine>_graph`` and
#   ``<engine>_eager``: its dispatch, its custom kernel below a size and NCCL above, where the part's node has that
#   table, else NCCL's: Hardware.engine_all_reduce): replayed, the graphed timing; called eagerly, the eager one (the
#   call's host work: 20-45 us where the graphed kernel takes 3-8); NCCL called eagerly at least the node's measured
#   host work per call (Hardware.eager_floor), inside a graph its kernel time.
VLLM_GRAPHS = (512, 512)
# The tensor-parallel all-reduces an engine description may name: NCCL's, or an engine's own
ALL_REDUCES = ("nccl", *ENGINE_ALL_REDUCE)


class AnalyticIteration:
    """:class:`~flexmesh.cost.inference.timing.IterationTiming` of ``model`` on a ``tp x pp`` replica of
    ``hardware``'s device (its cluster places the replica's ranks: consecutive, tp innermost).

    ``block``: when an iteration of a new token (or request) count is priced, the terms that depend on that
    count only (:meth:`dense_s`, :meth:`head_s`) are priced for the ``block`` counts around it at once (numpy):
    for callers that ask for many nearby counts (the deployment planner's bisections); the same seconds as one
    by one.
    """

    def __init__(self, model: ModelSpec, hardware: Hardware, tp: int = 1, pp: int = 1,
                 overhead: EngineOverhead | None = None, block: int = 0, graphs: tuple[int, int] = VLLM_GRAPHS,
                 overlap: bool = False, all_reduce: str = "nccl", scale: float = 1.0):
        if model.is_moe:
            raise SpecError(f"{model.name} is a mixture of experts; serving is priced for dense models only so far")
        check_tp(model, tp, pp)
        if tp * pp > hardware.cluster.world_size:
            raise SpecError(f"a tp {tp} x pp {pp} replica needs {tp * pp} devices; {hardware.cluster.label} has "
                            f"{hardware.cluster.world_size}")
        self.model, self.hw, self.tp, self.pp = model, hardware, tp, pp
        self.overhead = overhead or preset_overhead()
        self.graphs, self.overlap = graphs, overlap
        if all_reduce not in ALL_REDUCES:
            raise SpecError(f"all_reduce {all_reduce!r} is not one of {', '.join(ALL_REDUCES)}")
        self.all_reduce = all_reduce
        # a factor on every price of the device layer (kernels, collectives; not the engine's CPU time): 1, or an
        # end of the part's price band (flexmesh.cost.inference.band)
        self.scale = scale
        # the device layer's kernels; a hardware without them (profiled) keeps its measured rates
        self.kernels: Kernels = getattr(hardware, "device_kernels", None) or getattr(hardware, "kernels", None) \
            or Kernels(mm_flops=hardware.matmul_flops, attn_flops=hardware.attn_flops,
                       hbm_bytes_per_s=hardware.hbm_bytes_per_s, sms=None, attn_overhead=0.0, launch_s=0.0,
                       dtype_bytes=model.dtype_bytes)
        b, h = model.dtype_bytes, model.hidden
        self.layers = model.num_layers
        self.shapes = linear_shapes(model, tp)
        p = pointwise_elems(model)
        self.pointwise_bytes = (p.norms + FUSED_RESIDUAL_ELEMS * h + (p.rotary + p.activation) / tp) * b
        self.q_dim = model.q_dim / tp  # per device
        self.kv_heads = kv_heads_per_device(model, tp)
        self.kv_token_bytes = 2 * self.kv_heads * model.head_dim * b  # one layer, one token
        # sliding layers: what a chunk's queries see and what its KV holds, a mean over the layers
        self.groups = kv_groups(model)
        self.windows = model.attention_windows if self.groups.windowed else ()
        self.hidden_bytes = h * b
        self.tp_shape = group_shape(tp, 1, hardware.cluster)
        per_node = hardware.cluster.devices_per_node
        self.send_shapes = [GroupShape(2, 1 if crosses else 2)
                            for crosses in pipeline_crossings(tp * pp, per_node, pp)[:pp - 1]] if pp > 1 else []
        self._dense: dict[bool, dict[int, float]] = {False: {}, True: {}}  # by decode-only
        self.block = block
        self._head: dict[int, float] = {}
        # Decode-only iterations cost ``fixed(B) + per_key x keys`` (every term is affine in the KV read):
        # their fixed part by batch, computed once, makes the simulator's commonest call a lookup.
        k = self.kernels
        self.decode_bytes_per_s = k.decode_measured.hbm_bytes_per_s if k.decode_measured else k.hbm_bytes_per_s
        self.per_key_s = self.layers * self.kv_token_bytes / self.decode_bytes_per_s
        if k.decode_measured is None:  # one measured rate per kind: the larger of the FLOPs' and the bytes' time
            self.per_key_s = self.layers * max(4.0 * self.q_dim / k.attn_flops, self.kv_token_bytes / k.hbm_bytes_per_s)
        self.per_key_s *= scale
        self._decode_fixed: dict[int, float] = {}

    # ---- the terms -------------------------------------------------------------------------------
    def _collective(self, kind: str, nbytes):  # noqa: ANN001, ANN202 - a float or a numpy array
        if self.tp <= 1:
            return 0.0
        t = self.hw.collective_time(kind, nbytes, self.tp_shape)
        return t if isinstance(t, np.ndarray) else float(t)

    def _all_reduce_s(self, nbytes, graphed):  # noqa: ANN001, ANN202 - floats or arrays of them
        """One tp all-reduce of ``nbytes`` as the engine runs it, in a CUDA graph where ``graphed``."""
        if self.tp <= 1:
            return 0.0
        g, e = (self.hw.engine_all_reduce(self.all_reduce, mode, nbytes, self.tp_shape) for mode in (True, False))
        t = np.where(graphed, g, e)
        return t if isinstance(nbytes, np.ndarray) else float(t)

    def _dense_terms(self, tokens, decode_only: bool = False):  # noqa: ANN001, ANN202 - an int or an array of them
        k = self.kernels
        act = tokens * self.hidden_bytes
        graphed = np.asarray(tokens) <= self.graphs[0 if decode_only else 1]
        layer = sum(k.gemm(tokens, n, red) for n, red in self.shapes)
        layer += k.memory_bound(tokens * self.pointwise_bytes, LAYER_POINTWISE_KERNELS)
        layer += 2 * self._all_reduce_s(act, graphed)
        t = self.layers * layer + k.memory_bound(2 * act) + self._all_reduce_s(act, graphed)
        sends = [self.hw.collective_time("send_recv", act, s) for s in self.send_shapes]
        return self.scale * (t + sum(x if isinstance(x, np.ndarray) else float(x) for x in sends))

    def dense_s(self, tokens: int, decode_only: bool = False) -> float:
        """Everything of an iteration of ``tokens`` new tokens that does not depend on the requests' contexts
        or count: every layer's matmuls, pointwise operators and all-reduces, the final norm, the embedding's
        all-reduce, and the sends between stages (``decode_only``: an iteration of decodes alone, which an
        engine may replay as a CUDA graph where it does not a mixed one: :data:`VLLM_GRAPHS`)."""
        memo = self._dense[decode_only]
        t = memo.get(tokens)
        if t is None:
            if self.block > 1 and tokens > 0:
                self._by_block(memo, lambda counts: self._dense_terms(counts, decode_only), tokens)
                return memo[tokens]
            memo[tokens] = t = float(self._dense_terms(tokens, decode_only))
        return t

    def _head_terms(self, requests):  # noqa: ANN001, ANN202 - an int or an array of them
        m = self.model
        t = self.kernels.gemm(requests, m.vocab / self.tp, m.hidden)
        return self.scale * (t + self._collective("all_gather", requests * m.vocab * m.dtype_bytes))

    def head_s(self, requests: int) -> float:
        """The LM head over one row per request (its last token), its logits gathered over tp."""
        t = self._head.get(requests)
        if t is None:
            if self.block > 1 and requests > 0:
                self._by_block(self._head, self._head_terms, requests)
                return self._head[requests]
            self._head[requests] = t = float(self._head_terms(requests))
        return t

    def _by_block(self, memo: dict[int, float], terms, count: int) -> None:  # noqa: ANN001
        first = count - count % self.block
        counts = np.arange(max(first, 1), first + self.block, dtype=np.int64)
        memo.update(zip(counts.tolist(), terms(counts).tolist()))

    def attention_s(self, decodes: int, decode_context: int, chunks: Sequence[tuple[int, int]]) -> float:
        """Attention of every layer: the decodes' KV reads, each chunk's query-key pairs, the new keys and values
        written to the cache, one kernel each per layer."""
        k = self.kernels
        t = 0.0
        if decodes:  # memory-bound: the KV bytes and the (request, KV head) pairs; the call's fixed cost below
            keys = decode_context + decodes
            t = k.decode_attention(keys * self.kv_token_bytes, decodes * self.kv_heads, calls=0.0)
            if k.decode_measured is None:
                t = max(4.0 * self.q_dim * keys / k.attn_flops, t)
        a = k.attn_measured
        new = decodes
        last, term = None, 0.0
        for chunk in chunks:
            ctx, n = chunk
            new += n
            if chunk != last:  # (a batch of equal prompts is priced once)
                if self.windows:  # query i sees min(i + 1, window) keys in a sliding layer
                    pairs, seen = (attention_sq(ctx, ctx + n, self.windows) + n) / 2, self.groups.held(ctx + n)
                else:
                    pairs, seen = n * ctx + n * (n + 1) / 2, float(ctx + n)
                flops = 4.0 * self.q_dim * pairs
                term = max(k.attention(flops, seen, fixed=False),  # one varlen call's fixed cost: below
                           seen * self.kv_token_bytes / self.decode_bytes_per_s)
                last = chunk
            t += term
        if chunks and a is not None:
            fixed = a.fixed_s  # eager, as the tables time it (VLLM_GRAPHS)
        elif decodes and not chunks and decodes > self.graphs[0] and k.decode_measured is not None:
            fixed = k.decode_measured.fixed_s
        else:
            fixed = k.launch_s
        write = k.memory_bound(2.0 * new * self.kv_token_bytes)
        return self.scale * self.layers * (t + fixed + write)

    def cpu_s(self, requests: int) -> float:
        """The engine's own seconds in an iteration of ``requests`` requests (its overhead on this replica)."""
        return self.overhead.seconds(requests, self.tp * self.pp, self.layers)

    def terms(self, decodes: int, decode_context: int, chunks: Sequence[tuple[int, int]]) -> dict[str, float]:
        """The iteration's seconds by term (what :meth:`split_s` sums, or, with ``overlap``, adds the larger of
        the overhead and the rest)."""
        tokens = decodes + sum(n for _, n in chunks)
        requests = decodes + len(chunks)
        return {"dense": self.dense_s(tokens, not chunks),
                "attention": self.attention_s(decodes, decode_context, chunks),
                "head": self.head_s(requests), "overhead": self.cpu_s(requests)}

    # ---- the interface ---------------------------------------------------------------------------
    def split_s(self, decodes: int, decode_context: int, chunks: Sequence[tuple[int, int]]) -> float:
        """Seconds of an iteration of ``decodes`` one-token steps over ``decode_context`` KV tokens in all,
        and ``chunks`` ``(context, new tokens)``; constant time in the decodes."""
        if not chunks:
            if decodes == 0:
                return 0.0
            fixed = self._decode_fixed.get(decodes)
            if fixed is None:
                fixed = (self.dense_s(decodes, True) + self.attention_s(decodes, 0, ()) - self.per_key_s * decodes
                         + self.head_s(decodes) + (0.0 if self.overlap else self.cpu_s(decodes)))
                self._decode_fixed[decodes] = fixed
            gpu = fixed + self.per_key_s * (decode_context + decodes)
            return max(gpu, self.cpu_s(decodes)) if self.overlap else gpu
        tokens, requests = decodes, decodes + len(chunks)
        for _, n in chunks:
            tokens += n
        gpu = self.dense_s(tokens) + self.attention_s(decodes, decode_context, chunks) + self.head_s(requests)
        return max(gpu, self.cpu_s(requests)) if self.overlap else gpu + self.cpu_s(requests)

    def decode_run_s(self, decodes: int, decode_context: int, steps: int, growth: float | None = None) -> float:
        """Seconds of ``steps`` decode-only iterations in a row from ``decode_context`` (each adds ``growth`` to it,
        ``decodes`` when not given: less where layers slide past their window): the sum in closed form, every term
        being affine in the context (with ``overlap``, the iterations whose GPU time is below the engine's own cost
        that cost, the rest their GPU time)."""
        slope = self.per_key_s * (decodes if growth is None else growth)
        if not self.overlap:
            first = self.split_s(decodes, decode_context, ())
            return steps * first + slope * (steps * (steps - 1) / 2)
        self.split_s(decodes, decode_context, ())  # its GPU's fixed part, kept
        first = self._decode_fixed[decodes] + self.per_key_s * (decode_context + decodes)
        cpu = self.cpu_s(decodes)
        below = min(steps, max(0, math.ceil((cpu - first) / slope))) if slope > 0 else (steps if first < cpu else 0)
        rest = steps - below  # iterations below..steps-1 at their GPU time
        return below * cpu + rest * first + slope * ((steps * (steps - 1) - below * (below - 1)) / 2)

    def iteration_s(self, batch: Sequence[tuple[int, int]]) -> float:
        """Seconds of one iteration over ``batch``: ``(context, new tokens)`` per request (a decode reads the KV its
        context holds: at most the window in a sliding layer)."""
        decodes, context, chunks = 0, 0.0, []
        held = self.groups.held
        for ctx, n in batch:
            if n == 1:
                decodes += 1
                context += held(ctx)
            elif n > 1:
                chunks.append((ctx, n))
        return self.split_s(decodes, round(context), chunks)
