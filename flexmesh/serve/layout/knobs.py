"""What a serving engine is started with, in vLLM's names, and vLLM's defaults for a device.

Engine knobs default to vLLM's online-serving defaults for the device (``EngineArgs.get_batch_defaults``:
8192 batched tokens and 1024 sequences on GPUs of 70 GiB or more other than A100, else 2048 and 256; blocks
of 16 tokens; memory fraction 0.9; prefix caching on, as in vLLM's V1 engine).

>>> from flexmesh.spec.devices import device
>>> h100, a100 = default_knobs(device("H100")), default_knobs(device("A100-40GB"))
>>> (h100.max_batched_tokens, h100.max_seqs), (a100.max_batched_tokens, a100.max_seqs), h100.block_tokens
((8192, 1024), (2048, 256), 16)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from flexmesh.cost.inference.memory import VLLM_BLOCK_TOKENS, VLLM_MEMORY_FRACTION
from flexmesh.errors import SpecError
from flexmesh.spec.devices import DeviceSpec


@dataclass(frozen=True)
class EngineKnobs:
    """What an engine is started with (vLLM's names: max_num_seqs, max_num_batched_tokens, block_size,
    gpu_memory_utilization, enable_prefix_caching, num_gpu_blocks_override)."""

    max_seqs: int
    max_batched_tokens: int
    block_tokens: int = VLLM_BLOCK_TOKENS
    memory_fraction: float = VLLM_MEMORY_FRACTION
    prefix_caching: bool = True
    # blocks of the engine's pool (where layers slide, blocks of one KV group: flexmesh.cost.inference.memory.KVGroups)
    prefix_cache_blocks: int | None = None  # idle cached blocks kept at most (None: as KV memory allows)
    kv_blocks: int | None = None  # KV blocks as given, not sized from memory (vLLM's num_gpu_blocks_override)

    def __post_init__(self) -> None:
        for name in ("max_seqs", "max_batched_tokens", "block_tokens"):
            if getattr(self, name) < 1:
                raise SpecError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_batched_tokens < self.max_seqs:  # vLLM's SchedulerConfig refuses it too
            raise SpecError(f"max-batched-tokens ({self.max_batched_tokens}) must be at least max-seqs "
                            f"({self.max_seqs}): every running request computes a token each iteration")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise SpecError(f"kv-blocks must be >= 1, got {self.kv_blocks}")
        if not 0 < self.memory_fraction <= 1:
            raise SpecError(f"memory-fraction is in (0, 1], got {self.memory_fraction}")


def default_knobs(dev: DeviceSpec, **given: Any) -> EngineKnobs:
    """vLLM's online-serving defaults for ``dev``, replaced by the ``given`` knobs that are not None."""
    big = dev.memory_gib >= 70 and not dev.name.startswith("A100")
    knobs = EngineKnobs(max_seqs=1024 if big else 256, max_batched_tokens=8192 if big else 2048)
    return replace(knobs, **{k: v for k, v in given.items() if v is not None})
