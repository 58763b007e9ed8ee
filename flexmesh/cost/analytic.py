"""Layer timing from FLOPs and throughput, bytes counted tensor by tensor: the cost model's default.

Sources of the formulas (throughput comes from a :class:`~flexmesh.cost.Hardware`: the device preset's
datasheet peak x fitted efficiency, or a hardware profile's measurement):

- FLOPs: matmul FLOPs = 2 x weights per token; causal attention = 2 x q_dim per layer per squared
  token; backward = 2 x forward; full recomputation adds one forward (Megatron-LM, 2104.04473).
- Bytes per parameter with bf16 weights, fp32 gradients and Adam: 2 + 4 + 12, ZeRO-1 shards the 12,
  ZeRO-2 also the 4, ZeRO-3 all 18 (Megatron-LM's distributed-optimizer notes; ZeRO, 1910.02054).
- Saved activations per token per layer, with flash-style attention (no s^2 term, no mask) and
  sequence parallelism dividing everything by tp (Korthikanti et al., 2205.05198, adapted to
  SwiGLU/GQA; counted tensor by tensor in :func:`activation_elems_per_token`). Full recomputation
  keeps only the layer input.
- Logits: bf16 logits + fp32 softmax saved by the vocab-parallel cross entropy: 6 bytes per logit.
- Optimizer step: Adam's HBM traffic per parameter over the datasheet HBM bandwidth.

>>> from flexmesh.cost.hardware import Hardware
>>> from flexmesh.layout.strategy import LayerStrategy
>>> from flexmesh.spec import parse_cluster, parse_model
>>> t = AnalyticTiming(parse_model("llama2-7b"), Hardware(parse_cluster("8xA100-80GB")))
>>> t.activation_bytes_per_token(LayerStrategy(tp=2), recompute=False)  # 76800 elements x 2 B / tp
76800.0
>>> t.state_bytes_per_param()
(2, 4, 12)
"""

from __future__ import annotations

from dataclasses import replace

from flexmesh.cost.hardware import Hardware
from flexmesh.cost.timing import LayerTimes
from flexmesh.cost.work import Amount
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec.model import ModelSpec

GRAD_BYTES = 4  # fp32 gradient accumulation and reduction (Megatron-LM's default for bf16 training)
OPTIM_BYTES = 12  # fp32 master weights + Adam m and v
LOGIT_BYTES = 6
# Adam step traffic per parameter: read fp32 weight, grad, m, v (16 B); write weight, m, v and the
# bf16 copy (14 B). Time = bytes / HBM bandwidth from the datasheet.
OPTIM_TRAFFIC_BYTES = 30


def activation_elems_per_token(model: ModelSpec) -> int:
    """Elements one layer saves for backward per token (before dividing by tp and cp).

    Attention block: norm input, qkv input, q, k, v, attention output (saved by the kernel and by
    the output projection). MLP block: norm input, fc input, and for SwiGLU the gate and up outputs,
    the activation output and the down-projection input (GeLU: fc1 output and activation output).

    >>> from flexmesh.spec import MODEL_PRESETS
    >>> activation_elems_per_token(MODEL_PRESETS["llama2-7b"])  # 6h + 2kv + 4ffn
    76800
    """
    h = model.hidden
    attn = 2 * h + 2 * model.q_dim + 2 * model.kv_dim
    mlp = 2 * h + (4 if model.activation == "swiglu" else 2) * model.ffn_hidden
    return attn + mlp


class AnalyticTiming:
    """:class:`~flexmesh.cost.timing.LayerTiming` of ``model`` from FLOPs over ``hardware``'s throughput."""

    def __init__(self, model: ModelSpec, hardware: Hardware):
        self.model = model
        self.hw = hardware
        self.dtype = model.dtype
        self.act_elems = activation_elems_per_token(model)

    def check_model(self, model: ModelSpec) -> None:
        """Raise ValueError unless ``model`` is the one this timing was built for (any dtype)."""
        if replace(model, dtype=self.dtype) != self.model:
            raise ValueError(f"this AnalyticTiming was built for model {self.model.name!r}, not {model.name!r}")

    def source(self, hardware_source: str) -> str:
        """The hardware's: FLOPs add no source of their own."""
        return hardware_source

    def layer_times(self, s: LayerStrategy, tokens: Amount, sq_tokens: Amount) -> LayerTimes:
        """FLOPs over throughput, split over tp x cp; backward 2x forward, 3x when recomputed."""
        m, hw = self.model, self.hw
        split = s.tp * s.cp
        t_attn = m.layer_attn_flops_per_sq_token * sq_tokens / split / hw.attn_flops
        fwd = m.layer_linear_flops_per_token * tokens / split / hw.matmul_flops + t_attn
        return LayerTimes(fwd=fwd, bwd=fwd * (3 if s.recompute else 2), attention=t_attn)

    def embedding_times(self, s: LayerStrategy, tokens: Amount) -> tuple[Amount, Amount]:
        """No time: a lookup has no FLOPs to count."""
        return 0.0, 0.0

    def head_times(self, s: LayerStrategy, tokens: Amount) -> tuple[Amount, Amount]:
        """The LM head's matmul FLOPs over tp x cp; backward 2x forward."""
        fwd = self.model.head_flops_per_token * tokens / (s.tp * s.cp) / self.hw.matmul_flops
        return fwd, 2 * fwd

    def activation_bytes_per_token(self, s: LayerStrategy, recompute: bool) -> float:
        """:func:`activation_elems_per_token` (the layer input alone when recomputed) / (tp x cp)."""
        return (self.model.hidden if recompute else self.act_elems) * self.model.dtype_bytes / (s.tp * s.cp)

    def activation_bytes(self, s: LayerStrategy, tokens: float, recompute: bool) -> float:
        """As :meth:`activation_bytes_per_token`, for ``tokens`` of the micro-batch."""
        return tokens / s.cp / s.tp * (self.model.hidden if recompute else self.act_elems) * self.model.dtype_bytes

    def mask_bytes(self, s: LayerStrategy, tokens: float) -> float:
        """None: flash-style attention keeps no mask."""
        return 0.0

    def embedding_activation_bytes(self, s: LayerStrategy, tokens: float) -> float:
        """The embedding output, split over tp x cp (sequence parallel)."""
        return tokens / s.cp / s.tp * self.model.hidden * self.model.dtype_bytes

    def logit_bytes(self, s: LayerStrategy, tokens: float) -> float:
        """:data:`LOGIT_BYTES` per logit of the device's tokens and vocabulary shard."""
        return tokens / s.cp * self.model.vocab / s.tp * LOGIT_BYTES

    def state_bytes_per_param(self) -> tuple[float, float, float]:
        """Weights in the model's dtype, fp32 gradients, fp32 Adam states."""
        return self.model.dtype_bytes, GRAD_BYTES, OPTIM_BYTES

    def optimizer_s_per_param(self) -> float:
        """:data:`OPTIM_TRAFFIC_BYTES` over the HBM bandwidth."""
        return OPTIM_TRAFFIC_BYTES / self.hw.hbm_bytes_per_s
