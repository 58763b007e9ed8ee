"""vLLM admits a waiting request only where the free KV blocks hold all its known tokens (``admit_whole``:
``scheduler_reserve_full_isl``, on by default since 2026); before, on the chunk it computed first. The simulated
replica does as the engine description says."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flexmesh.cost.inference.memory import FULL_ATTENTION, KVGroups
from flexmesh.data.requests import constant_lengths, with_arrivals
from flexmesh.errors import SpecError
from flexmesh.serve.layout.engine import EngineSpec, engine_spec
from flexmesh.serve.layout.knobs import default_knobs
from flexmesh.serve.layout.replicas import parse_replicas, place
from flexmesh.serve.simulator import Fleet
from flexmesh.spec import parse_model
from flexmesh.spec.cluster import parse_mixed_cluster

MODEL = parse_model("llama3-8b")


def _run(engine: EngineSpec, kv_blocks: int, prompt: int = 6000, n: int = 4):
    c = parse_mixed_cluster("1xH100")
    knobs = {0: replace(default_knobs(c.groups[0].device), kv_blocks=kv_blocks, max_batched_tokens=2048,
                        prefix_caching=False)}
    fleet = Fleet(MODEL, c, place(parse_replicas("tp1", c), c), knobs, engine=engine)
    w = with_arrivals(constant_lengths(prompt, 50), rate=1000.0, n=n)
    return w, fleet.run(w)


def test_the_vllm_preset_reserves_whole_prompts_and_v0_and_older_files_do_not():
    assert engine_spec("vllm").admit_whole and not engine_spec("vllm-v0").admit_whole
    assert "admitted where the whole prompt fits" in engine_spec("vllm").label()
    older = EngineSpec.from_dict({"base": "vllm", "name": "vllm-0.10", "admit_whole": False})
    assert not older.admit_whole
    assert EngineSpec.from_dict(older.to_dict()) == older  # exact: written and read back, no arithmetic
    with pytest.raises(SpecError, match="admit_whole is true or false"):
        EngineSpec.from_dict({"base": "vllm", "admit_whole": "yes"})


def test_a_long_prompt_waits_for_room_instead_of_being_preempted_part_way():
    # each request takes 379 blocks at its end; 500 hold one at a time
    whole = engine_spec("vllm")
    first_chunk = replace(whole, admit_whole=False)
    w, reserved = _run(whole, 500)
    _, chunked = _run(first_chunk, 500)
    assert chunked.replicas[0].preemptions > 0 and reserved.replicas[0].preemptions == 0
    for out in (reserved, chunked):
        assert [r.id for r in out.records] == [r.id for r in w.requests]
        assert all(r.output_tokens == 50 for r in out.records)
    # with room for all, the reservation changes nothing
    roomy = _run(whole, 2000)[1].records
    assert roomy == _run(first_chunk, 2000)[1].records  # exact: the same simulation, the reservation never binding


def test_the_reservation_counts_the_whole_context_and_a_sliding_groups_cap():
    assert FULL_ATTENTION.reserve(6000, 16, 0, 2048) == 375 == FULL_ATTENTION.blocks(6000, 16)
    assert FULL_ATTENTION.reserve(6000, 16, 1024, 2048) == 311  # the prefix cache holds the first 64 blocks
    g = KVGroups(13, 13, window=4096)
    # the sliding group's: its 6000 tokens' 375 blocks, under the cap of (4095 + 2048) / 16 + 1 = 385
    assert g.reserve(6000, 16, 0, 2048) == 375 + 375
    assert g.reserve(20_000, 16, 0, 2048) == 1250 + 385 > g.blocks(20_000, 16) == 1250 + 256
