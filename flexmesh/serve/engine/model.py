"""A transformers model built locally from a flexmesh model spec, with seeded random weights.

Nothing downloads: the spec (a preset such as ``tiny``, ``gpt:L:H:A`` or a config.json) becomes a
Hugging Face config through :func:`flexmesh.spec.hf.to_hf_config`, transformers builds the model from
it, and every parameter is drawn again from its own generator, seeded by the engine's seed and the
parameter's name. So the weights do not depend on the order transformers initialises modules in,
and every process that builds the same (model, seed) holds the same weights: the engines of a
fleet, the profiler, and the reference that tests compare generated tokens with.
"""

from __future__ import annotations

import zlib

import torch

from flexmesh.errors import ServeError
from flexmesh.serve.engine.config import EngineConfig
from flexmesh.spec.hf import to_hf_config
from flexmesh.spec.model import ModelSpec, parse_model

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def engine_spec(cfg: EngineConfig) -> ModelSpec:
    """The model spec ``cfg.model`` names, in the engine's dtype."""
    return parse_model(cfg.model)


def hf_config(cfg: EngineConfig):
    """The transformers config of the engine's model (SpecError where no supported family builds it)."""
    from transformers import AutoConfig

    hf = to_hf_config(engine_spec(cfg))
    hf["dtype"] = {"fp32": "float32", "bf16": "bfloat16"}[cfg.dtype]
    kind = hf.pop("model_type")
    return AutoConfig.for_model(kind, **hf)


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name`` (crc32: stable across processes, unlike ``hash``).

    >>> param_seed(0, "model.norm.weight") == param_seed(0, "model.norm.weight") != param_seed(1, "model.norm.weight")
    True
    """
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def build_model(cfg: EngineConfig):
    """The engine's model in eval mode on the CPU: normal(0, initializer_range) matrices, unit norms,
    zero biases, each drawn from its own seeded generator."""
    from transformers import AutoModelForCausalLM

    config = hf_config(cfg)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=TORCH_DTYPES[cfg.dtype])
    except ValueError as e:  # a family transformers cannot build for causal LM
        raise ServeError(f"model {cfg.model!r} cannot be built by transformers ({e}); use a Llama-family model") from e
    std = float(getattr(config, "initializer_range", 0.02))
    for name, p in model.named_parameters():
        g = torch.Generator().manual_seed(param_seed(cfg.seed, name))
        if p.ndim >= 2:
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)
        elif name.endswith("norm.weight") or "layernorm" in name:
            p.fill_(1.0)
        else:
            p.zero_()
    model.generation_config.eos_token_id = None  # random weights: no token means "stop"
    model.generation_config.pad_token_id = 0
    return model.eval()
