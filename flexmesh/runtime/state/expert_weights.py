"""Experts' weights in both Hugging Face checkpoint layouts.

transformers 5 stores a layer's routed experts fused, ``mlp.experts.gate_up_proj`` [E, 2F, H] (each
expert's gate rows first, then its up rows) and ``mlp.experts.down_proj`` [E, H, F]; that is the
*fused* layout, the names :func:`flexmesh.runtime.state.weights.hf_name` gives. Checkpoints saved by
transformers 4, and many re-saved ones, keep one key per expert and projection, the *per-expert*
layout::

    Qwen2-MoE, Qwen3-MoE, OLMoE    model.layers.N.mlp.experts.E.gate_proj|up_proj|down_proj.weight
    Mixtral                        model.layers.N.block_sparse_moe.experts.E.w1|w3|w2.weight (gate|up|down)
                                   model.layers.N.block_sparse_moe.gate.weight (the router)

:func:`sources` maps every fused name to the keys a file holds it under (the loader reads either
layout); :func:`in_layout` writes a fused tensor back in the layout a model was read from (the
exporter). Swapping gate and up would load without complaint and compute another model, so the
order is fixed here, once: gate first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from flexmesh.errors import CheckpointError

FUSED, PER_EXPERT = "fused", "per-expert"
LAYOUTS = (FUSED, PER_EXPERT)

_PER_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\."
                             r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_MIXTRAL_ROUTER = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_MIXTRAL_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}


@dataclass(frozen=True)
class Source:
    """Where a fused-layout tensor lies in a file: ``keys`` read in order and how they combine
    (``copy``: one key as it is; ``gate_up``: gate_0, up_0, gate_1, ... stacked as [E, 2F, H];
    ``down``: down_0, down_1, ... stacked as [E, H, F])."""

    keys: tuple[str, ...]
    kind: str = "copy"

    def combine(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if self.kind == "copy":
            return tensors[0]
        if self.kind == "gate_up":
            return torch.stack([torch.cat([g, u]) for g, u in zip(tensors[0::2], tensors[1::2])])
        return torch.stack(tensors)


def sources(keys: Iterable[str]) -> tuple[dict[str, Source], str | None]:
    """Every tensor of a file with these ``keys`` under its fused-layout name, and the file's expert
    layout (None: no experts). CheckpointError when a layer's per-expert keys leave an expert or a
    projection out.

    >>> found, layout = sources([f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in (0, 1)
    ...                          for p in ("gate", "up", "down")] + ["model.layers.0.mlp.gate.weight"])
    >>> layout, sorted(found), found["model.layers.0.mlp.experts.gate_up_proj"].keys[:2]
    ('per-expert', ['model.layers.0.mlp.experts.down_proj', 'model.layers.0.mlp.experts.gate_up_proj', \
'model.layers.0.mlp.gate.weight'], ('model.layers.0.mlp.experts.0.gate_proj.weight', \
'model.layers.0.mlp.experts.0.up_proj.weight'))
    """
    out: dict[str, Source] = {}
    layers: dict[str, dict[int, dict[str, str]]] = {}
    fused = False
    for key in keys:
        m = _PER_EXPERT_KEY.match(key)
        if m:
            layer, _, expert, part = m.groups()
            layers.setdefault(layer, {}).setdefault(int(expert), {})[_PART[part]] = key
            continue
        m = _MIXTRAL_ROUTER.match(key)
        if m:
            out[f"model.layers.{m.group(1)}.mlp.gate.weight"] = Source((key,))
            continue
        fused = fused or key.endswith(".mlp.experts.gate_up_proj")
        out[key] = Source((key,))
    for layer, experts in layers.items():
        count = max(experts) + 1
        for e in range(count):
            lacking = [p for p in ("gate", "up", "down") if p not in experts.get(e, {})]
            if lacking:
                raise CheckpointError(f"layer {layer} of the weights lacks expert {e}'s {', '.join(lacking)} "
                                      f"projection (it has {len(experts)} experts' keys); the file is incomplete")
        prefix = f"model.layers.{layer}.mlp.experts"
        out[f"{prefix}.gate_up_proj"] = Source(tuple(experts[e][p] for e in range(count) for p in ("gate", "up")),
                                               "gate_up")
        out[f"{prefix}.down_proj"] = Source(tuple(experts[e]["down"] for e in range(count)), "down")
    if layers and fused:
        raise CheckpointError("the weights hold experts both fused (gate_up_proj) and per expert; give one layout")
    return out, PER_EXPERT if layers else FUSED if fused else None


def in_layout(key: str, tensor: torch.Tensor, layout: str, family: str) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint of ``layout`` and transformers family ``family`` holds for fused-layout
    tensor ``key`` (itself, unless per-expert).

    >>> t = torch.arange(8.0).reshape(2, 4, 1)  # 2 experts, F = 2: gate rows 0-1, up rows 2-3
    >>> parts = in_layout("model.layers.0.mlp.experts.gate_up_proj", t, PER_EXPERT, "mixtral")
    >>> {k: v.flatten().tolist() for k, v in parts.items() if ".1." in k}
    {'model.layers.0.block_sparse_moe.experts.1.w1.weight': [4.0, 5.0], \
'model.layers.0.block_sparse_moe.experts.1.w3.weight': [6.0, 7.0]}
    """
    if layout not in LAYOUTS:
        raise CheckpointError(f"expert layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    mixtral = family == "mixtral"
    if layout == FUSED:
        return {key: tensor}
    m = re.match(r"^model\.layers\.(\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)$", key)
    if m is None:
        return {key: tensor}
    layer, what = m.groups()
    block = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}"
    if what == "gate.weight":
        return {f"{block}.gate.weight": tensor}

    def name(e: int, part: str) -> str:
        return f"{block}.experts.{e}.{_MIXTRAL_NAMES[part] if mixtral else part + '_proj'}.weight"

    if what == "experts.down_proj":
        return {name(e, "down"): tensor[e] for e in range(tensor.shape[0])}
    f = tensor.shape[1] // 2
    out = {}
    for e in range(tensor.shape[0]):
        out[name(e, "gate")] = tensor[e, :f]
        out[name(e, "up")] = tensor[e, f:]
    return out
