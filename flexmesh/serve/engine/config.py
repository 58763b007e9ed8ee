"""The knobs of one engine (torch-free): the model, its seed and dtype, and the continuous-batching sizes.

Every size is explicit, so an engine here and its simulated twin hold the same KV cache and token
budget: ``page_size`` tokens per KV block, ``num_blocks`` blocks (the KV capacity is their product),
``max_batch_tokens`` new tokens per iteration (prefill chunks and decode tokens together) and at most
``max_requests_per_batch`` requests in one. transformers' own defaults would size the cache from free
memory instead (60% of RAM on a CPU), which no simulator could repeat.

>>> cfg = EngineConfig(model="tiny", num_blocks=64, page_size=16)
>>> cfg.kv_tokens, EngineConfig.from_json(cfg.to_json()) == cfg
(1024, True)
>>> EngineConfig(page_size=2)
Traceback (most recent call last):
...
flexmesh.errors.ServeError: engine page_size must be at least 4 tokens (transformers' bound), got 2
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from flexmesh.errors import ServeError
from flexmesh.inputs import parse_json

SCHEDULERS = ("fifo", "prefill_first")  # transformers' continuous-batching schedulers (SCHEDULER_MAPPING)
DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class EngineConfig:
    """One engine: ``model`` is a preset, ``gpt:L:H:A`` or a config.json (flexmesh.spec.model.parse_model);
    its weights are random, seeded by ``seed`` per parameter name, so every engine with the same
    model and seed holds the same weights.

    ``scheduler``: transformers' FIFO scheduler puts decoding requests first, then requests part way
    through their prefill, then waiting ones in arrival order, each prefill cut to the token budget left
    (chunked prefill); below ``safety_margin`` of free blocks it admits no new prefill beyond the first
    (0.15, its default). ``block_sharing``: transformers' prefix cache over whole blocks (off: a replay
    of random prompts shares no prefix, and the simulator then prices no hits).
    """

    model: str = "tiny"
    seed: int = 0
    dtype: str = "fp32"
    page_size: int = 16
    num_blocks: int = 2048
    max_batch_tokens: int = 256
    max_requests_per_batch: int = 64
    scheduler: str = "fifo"
    safety_margin: float = 0.15
    block_sharing: bool = False
    threads: int = 1  # torch intra-op threads of the engine process (one core per engine by default)
    device: str = "cpu"  # where the model runs: cpu, or cuda:K

    def __post_init__(self) -> None:
        if self.page_size < 4:
            raise ServeError(f"engine page_size must be at least 4 tokens (transformers' bound), got {self.page_size}")
        for name in ("num_blocks", "max_batch_tokens", "max_requests_per_batch", "threads"):
            if getattr(self, name) < 1:
                raise ServeError(f"engine {name} must be at least 1, got {getattr(self, name)}")
        if self.scheduler not in SCHEDULERS:
            raise ServeError(f"engine scheduler {self.scheduler!r} is not one of {', '.join(SCHEDULERS)}")
        if self.dtype not in DTYPES:
            raise ServeError(f"engine dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.device != "cpu" and not (self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise ServeError(f"engine device {self.device!r} is not cpu or cuda:K")
        if not 0.0 <= self.safety_margin < 1.0:
            raise ServeError(f"engine safety_margin must be in [0, 1), got {self.safety_margin}")

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache holds, over all requests."""
        return self.page_size * self.num_blocks

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        data = parse_json(text, ServeError, "engine config", invalid="not valid JSON ({reason}); write it as "
                          "EngineConfig.to_json does")
        known = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - known:
            extra = sorted(set(data) - known) if isinstance(data, dict) else data
            raise ServeError(f"engine config has unknown keys {extra}; keep to {', '.join(sorted(known))}")
        return cls(**data)
