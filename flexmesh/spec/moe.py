"""MoESpec: the mixture-of-experts part of a model (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE).

A MoE layer replaces the dense SwiGLU MLP by a router and ``num_experts`` SwiGLU experts of width
``expert_ffn``. Every family flexmesh reads routes the same way (transformers' ``*TopKRouter``):

    p = softmax(x W_r^T) in fp32 over all experts;  the ``top_k`` largest p_e are the token's experts;
    weights w_e = p_e, renormalised to sum to 1 when ``norm_topk`` (Mixtral, Qwen3-MoE), as they are
    otherwise (OLMoE, Qwen2-MoE);   y = sum_e w_e * expert_e(x)  [+ sigmoid(x w_g) * shared(x)]

Qwen2-MoE adds a shared expert of width ``shared_ffn`` run on every token, scaled by a sigmoid gate
(``shared_gate``). Qwen's ``decoder_sparse_step`` and ``mlp_only_layers`` keep some layers dense
(``dense_layers``; those use the model's ``ffn_hidden``). Nothing is dropped: every token reaches
its ``top_k`` experts (dropless, as transformers computes).

Parameter and FLOP counts (total weights for memory, active weights per token for FLOPs) are
properties of the shape and live here; the routing itself is the runtime's (flexmesh.runtime.model.moe).

>>> m = MoESpec(num_experts=8, top_k=2, expert_ffn=14336)
>>> m.routed_params(4096) / 1e9, m.active_params(4096) / 1e9
(1.409286144, 0.352354304)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from flexmesh.errors import SpecError
from flexmesh.spec.limits import MAX_LAYERS, MAX_WIDTH, within
from flexmesh.spec.values import flag, known_keys, mapping, number, whole

# The most experts a layer may have (published: up to 384); more is a typo.
MAX_EXPERTS = 1 << 14


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts layers of a model (see the module doc)."""

    num_experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int = 0  # width of the shared expert every token runs (Qwen2-MoE); 0: none
    shared_gate: bool = False  # sigmoid(x w_g) scales the shared expert (Qwen2-MoE)
    norm_topk: bool = True  # renormalise the top-k weights to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers that keep the dense MLP (ascending)
    aux_loss: float = 0.0  # the config's load-balancing loss coefficient (router_aux_loss_coef)

    def __post_init__(self) -> None:
        where = "mixture of experts"
        object.__setattr__(self, "num_experts",
                           within(whole(self.num_experts, f"{where}: num_experts", SpecError), MAX_EXPERTS,
                                  f"{where}: num_experts"))
        object.__setattr__(self, "top_k", whole(self.top_k, f"{where}: experts per token", SpecError))
        for f in ("expert_ffn", "shared_ffn"):
            value = whole(getattr(self, f), f"{where}: {f}", SpecError, minimum=1 if f == "expert_ffn" else 0)
            object.__setattr__(self, f, within(value, MAX_WIDTH, f"{where}: {f}"))
        for f in ("shared_gate", "norm_topk"):
            flag(getattr(self, f), f"{where}: {f}", SpecError)
        object.__setattr__(self, "aux_loss", number(self.aux_loss, f"{where}: aux_loss", SpecError, strict=False))
        if not isinstance(self.dense_layers, tuple):
            raise SpecError(f"{where}: dense_layers must be a list of layer numbers, got {self.dense_layers!r}")
        for i in self.dense_layers:
            within(whole(i, f"{where}: a dense layer number", SpecError, minimum=0), MAX_LAYERS,
                   f"{where}: dense layer")
        if list(self.dense_layers) != sorted(set(self.dense_layers)):
            raise SpecError(f"{where}: dense_layers must be ascending without repeats, got {list(self.dense_layers)}")
        if self.num_experts < 2:
            raise SpecError(f"{where}: num_experts is {self.num_experts}; a mixture needs at least 2 experts "
                            "(a model of one expert is a dense model: drop the MoE fields)")
        if self.top_k > self.num_experts:
            raise SpecError(f"{where}: {self.top_k} experts per token but only {self.num_experts} experts; "
                            "num_experts_per_tok must be at most num_experts")
        if self.shared_gate and not self.shared_ffn:
            raise SpecError(f"{where}: a shared-expert gate without a shared expert; give shared_ffn > 0")

    # ---- counts ----------------------------------------------------------------------------------
    def router_params(self, hidden: int) -> int:
        return self.num_experts * hidden

    def shared_params(self, hidden: int) -> int:
        """The shared expert's SwiGLU and its gate."""
        return 3 * hidden * self.shared_ffn + (hidden if self.shared_gate else 0)

    def routed_params(self, hidden: int) -> int:
        """Every routed expert's weights (gate, up, down)."""
        return 3 * hidden * self.expert_ffn * self.num_experts

    def total_params(self, hidden: int) -> int:
        """The MoE MLP's weights: router, routed experts, shared expert."""
        return self.router_params(hidden) + self.routed_params(hidden) + self.shared_params(hidden)

    def active_params(self, hidden: int) -> int:
        """Weights one token multiplies with: the router, its ``top_k`` experts and the shared expert."""
        return self.router_params(hidden) + 3 * hidden * self.expert_ffn * self.top_k + self.shared_params(hidden)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dense_layers"] = list(self.dense_layers)
        return d

    @classmethod
    def from_dict(cls, d: object) -> "MoESpec":
        d = mapping(d, "model spec: moe", SpecError)
        known_keys(d, set(cls.__dataclass_fields__), "model spec: moe", SpecError)
        if isinstance(d.get("dense_layers"), list):
            d = {**d, "dense_layers": tuple(d["dense_layers"])}
        try:
            return cls(**d)
        except TypeError as e:
            raise SpecError(f"model spec: moe is incomplete ({e}); it needs num_experts, top_k and expert_ffn") from e
