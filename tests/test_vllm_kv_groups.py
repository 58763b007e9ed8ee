"""flexmesh's KV groups for models whose layers slide are vLLM's own: for layer counts of both types, vLLM's
``_get_kv_cache_groups_uniform_page_size`` and ``get_kv_cache_config_from_groups`` (run in the vLLM environment, as
tests/test_vllm_export.py says; optional: marker ``vllm``) give the layers per group, the groups of each type and
the pool's blocks :class:`flexmesh.cost.inference.memory.KVGroups` prices, and ``SlidingWindowSpec`` the blocks a
request reserves in a sliding group at admission."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
from test_vllm_export import VLLM_PYTHON

from flexmesh.cost.inference.memory import KVCapacity, KVGroups

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not Path(VLLM_PYTHON).exists(),
                                 reason=f"no vLLM environment at {VLLM_PYTHON} (set FLEXMESH_VLLM_PYTHON)")]

# vLLM's grouping of (full, sliding, blocks of every layer's memory): per case, the layers per group, the full and
# sliding groups, and the pool's blocks
ASK_VLLM = r"""
import json, sys
from types import SimpleNamespace
import torch
from vllm.config import CacheConfig
from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_page_size, get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

cache = CacheConfig(block_size=16)
cache.kv_cache_layout = "NHD"
config = SimpleNamespace(cache_config=cache, attention_config=SimpleNamespace(hisparse_config=None))
page = 16 * 2 * 64 * 2  # a layer's block: 16 tokens of one KV head of 64, keys and values, fp16
shape = dict(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16)
out = []
for full, sliding, blocks in json.loads(sys.argv[1]):
    spec = {f"full.{i}": FullAttentionSpec(**shape) for i in range(full)}
    spec.update({f"sw.{i}": SlidingWindowSpec(**shape, sliding_window=256) for i in range(sliding)})
    groups = _get_kv_cache_groups_uniform_page_size(spec)
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    pool = get_kv_cache_config_from_groups(config, groups, page * (full + sliding) * blocks).num_blocks
    out.append([max(len(g.layer_names) for g in groups), kinds.count("FullAttentionSpec"),
                kinds.count("SlidingWindowSpec"), pool])
caps = [SlidingWindowSpec(**shape, sliding_window=w).max_admission_blocks_per_request(f, 10**7)
        for w, f in json.loads(sys.argv[2])]
print(json.dumps([out, caps]))
"""


@pytest.mark.timeout(600)
def test_the_kv_groups_and_pool_are_vllms():
    rng = random.Random(0)
    cases = [(13, 13), (4, 22), (10, 52), (12, 13), (13, 12), (10, 18), (21, 7), (5, 4), (1, 3), (3, 1)]
    cases += [(rng.randint(1, 48), rng.randint(1, 48)) for _ in range(30)]
    asked = [(full, sliding, rng.randint(10, 5000)) for full, sliding in cases]
    windows = [(rng.choice([16, 100, 512, 4096]), rng.choice([1, 512, 2048, 8192])) for _ in range(12)]
    run = subprocess.run([VLLM_PYTHON, "-c", ASK_VLLM, json.dumps(asked), json.dumps(windows)], capture_output=True,
                         text=True, timeout=500)
    assert run.returncode == 0, run.stderr[-3000:]
    vllm, caps = json.loads(run.stdout.strip().splitlines()[-1])
    # the blocks a sliding layer's request is admitted against: at most its window less one and the tokens in flight
    for (window, in_flight), cap in zip(windows, caps, strict=True):
        assert KVGroups(0, 1, window).reserve(10**7, 16, 0, in_flight) == cap, (window, in_flight)
    for (full, sliding, blocks), (size, n_full, n_sliding, pool) in zip(asked, vllm, strict=True):
        g = KVGroups(full, sliding, 256)
        per_token = 2 * g.layers * 64 * 2  # every layer's keys and values, as vLLM's page above
        cap = KVCapacity(device_bytes=blocks * 16 * per_token, fraction=1.0, reserve_bytes=0, weight_bytes=0,
                         activation_bytes=0, kv_bytes_per_token=per_token, block_tokens=16)
        assert cap.blocks == blocks
        assert (g.size, g.full, g.sliding, g.pool(cap)) == (size, n_full, n_sliding, pool), (full, sliding, blocks)
        assert g.blocks(1000, 16) == n_full * 63 + n_sliding * 16
