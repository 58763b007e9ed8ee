"""The mixture-of-experts fields of Hugging Face configs: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

Read as transformers 5 builds each family (configuration_*.py defaults for missing keys), written
back so that ``moe_from_hf(moe_to_hf(spec, family), ...)`` gives the spec again. What the flexmesh
runtime does not compute (router jitter, an expert count of zero, a shared expert of width zero)
is one SpecError naming the key, never ignored.

Key names and defaults per family::

    key                              mixtral               qwen2_moe   qwen3_moe          olmoe
    experts                          num_local_experts 8   num_experts num_experts 128    num_experts 64
                                                           60          (num_local_experts)
    experts per token                num_experts_per_tok 2 4           8                  8
    expert width                     intermediate_size     moe_intermediate_size 1408/768 intermediate_size
    shared expert (gated)            -                     shared_expert_intermediate_size 5632
    top-k renormalised               always                norm_topk_prob (false)         norm_topk_prob (false)
    dense layers                     -                     mlp_only_layers, decoder_sparse_step   -
    router_aux_loss_coef             0.001                 0.001       0.001              0.01
"""

from __future__ import annotations

from typing import Any

from flexmesh.errors import SpecError
from flexmesh.spec.moe import MoESpec
from flexmesh.spec.values import flag, number, sequence, whole

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")

_EXPERTS_DEFAULT = {"mixtral": 8, "qwen2_moe": 60, "qwen3_moe": 128, "olmoe": 64}
_TOP_K_DEFAULT = {"mixtral": 2, "qwen2_moe": 4, "qwen3_moe": 8, "olmoe": 8}
_WIDTH_DEFAULT = {"qwen2_moe": 1408, "qwen3_moe": 768}
_AUX_DEFAULT = {"mixtral": 0.001, "qwen2_moe": 0.001, "qwen3_moe": 0.001, "olmoe": 0.01}


def _get(cfg: dict, key: str, default: Any) -> Any:
    value = cfg.get(key, default)
    return default if value is None else value


def moe_from_hf(cfg: dict, family: str, where: str) -> MoESpec | None:
    """The MoESpec of a config of ``family`` (None for a dense family)."""
    if family not in MOE_FAMILIES:
        return None
    jitter = cfg.get("router_jitter_noise")
    if jitter is not None and number(jitter, f"{where}: router_jitter_noise", SpecError, strict=False) != 0.0:
        raise SpecError(f"{where}: router_jitter_noise {jitter} is not supported (flexmesh routes every token "
                        "deterministically, so that every layout trains the same model); set it to 0.0")
    key = "num_local_experts" if family == "mixtral" else "num_experts"
    experts = cfg.get(key)
    if experts is None and family == "qwen3_moe":  # transformers 5 maps num_experts to num_local_experts
        experts = cfg.get("num_local_experts")
    experts = whole(_EXPERTS_DEFAULT[family] if experts is None else experts, f"{where}: {key}", SpecError)
    top_k = whole(_get(cfg, "num_experts_per_tok", _TOP_K_DEFAULT[family]), f"{where}: num_experts_per_tok",
                  SpecError)
    if family in ("mixtral", "olmoe"):
        width = cfg["intermediate_size"]
    else:
        width = whole(_get(cfg, "moe_intermediate_size", _WIDTH_DEFAULT[family]), f"{where}: moe_intermediate_size",
                      SpecError)
    shared = 0
    if family == "qwen2_moe":
        shared = whole(_get(cfg, "shared_expert_intermediate_size", 5632),
                       f"{where}: shared_expert_intermediate_size", SpecError, minimum=0)
        if shared == 0:
            raise SpecError(f"{where}: shared_expert_intermediate_size 0 builds an empty shared expert in "
                            "transformers; flexmesh does not; give its width")
    norm_topk = True if family == "mixtral" else flag(_get(cfg, "norm_topk_prob", False),
                                                      f"{where}: norm_topk_prob", SpecError)
    aux = number(_get(cfg, "router_aux_loss_coef", _AUX_DEFAULT[family]), f"{where}: router_aux_loss_coef",
                 SpecError, strict=False)
    dense: tuple[int, ...] = ()
    if family in ("qwen2_moe", "qwen3_moe"):
        layers = cfg["num_hidden_layers"]
        only = sequence(_get(cfg, "mlp_only_layers", []), f"{where}: mlp_only_layers", SpecError)
        only_set = {whole(i, f"{where}: mlp_only_layers entry", SpecError, minimum=0) for i in only}
        step = whole(_get(cfg, "decoder_sparse_step", 1), f"{where}: decoder_sparse_step", SpecError)
        # transformers' rule (Qwen2MoeDecoderLayer): sparse unless listed or off the step
        dense = tuple(i for i in range(layers) if i in only_set or (i + 1) % step)
        if len(dense) == layers:
            raise SpecError(f"{where}: mlp_only_layers and decoder_sparse_step leave no MoE layer; "
                            f"load it as a {'qwen2' if family == 'qwen2_moe' else 'qwen3'} model")
    try:
        return MoESpec(experts, top_k, width, shared_ffn=shared, shared_gate=shared > 0, norm_topk=norm_topk,
                       dense_layers=dense, aux_loss=aux)
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from e


def moe_family(spec_moe: MoESpec, qk_norm: bool, qk_scope: str, qkv_bias: bool, out_bias: bool,
               ffn_hidden: int, where: str) -> str:
    """The transformers MoE family that builds a model with these fields (SpecError when none does)."""
    m = spec_moe
    if qk_norm and qk_scope == "projection":
        family, why = "olmoe", []
        if qkv_bias != out_bias:
            why.append("its attention biases must be all on or all off")
    elif qk_norm:
        family, why = "qwen3_moe", [] if qkv_bias == out_bias else ["its attention biases must be all on or all off"]
    elif m.shared_ffn:
        family, why = "qwen2_moe", ["an o_proj bias"] if out_bias else []
        if not m.shared_gate:
            why.append("a shared expert without its sigmoid gate")
    else:
        family, why = "mixtral", []
        if qkv_bias or out_bias:
            why.append("attention biases")
        if not m.norm_topk:
            why.append("top-k weights that are not renormalised")
    if family in ("mixtral", "olmoe"):
        if m.shared_ffn:
            why.append("a shared expert")
        if m.dense_layers:
            why.append("dense layers")
        if ffn_hidden != m.expert_ffn:
            why.append(f"ffn_hidden {ffn_hidden} other than the expert width {m.expert_ffn}")
    if family == "qwen3_moe" and m.shared_ffn:
        why.append("a shared expert")
    if why:
        raise SpecError(f"{where}: no transformers MoE family has {', '.join(why)} (tried {family})")
    return family


def moe_to_hf(m: MoESpec, family: str) -> dict[str, Any]:
    """The MoE keys of a config.json of ``family`` for ``m`` (transformers 5 layout)."""
    cfg: dict[str, Any] = {"num_experts_per_tok": m.top_k, "router_aux_loss_coef": m.aux_loss,
                           "output_router_logits": False}
    if family == "mixtral":
        cfg.update(num_local_experts=m.num_experts, router_jitter_noise=0.0)
        return cfg
    cfg.update(num_experts=m.num_experts, norm_topk_prob=m.norm_topk)
    if family in ("qwen2_moe", "qwen3_moe"):
        cfg.update(moe_intermediate_size=m.expert_ffn, decoder_sparse_step=1, mlp_only_layers=list(m.dense_layers))
    if family == "qwen2_moe":
        cfg["shared_expert_intermediate_size"] = m.shared_ffn
    return cfg
