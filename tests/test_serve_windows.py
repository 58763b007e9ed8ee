"""Sliding-window models in serving: a request holds, and its decodes read, at most the window of KV in a sliding
layer (vLLM's hybrid KV cache manager), in the simulator's sums and blocks, its prices and the planner's capacities."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serve_sim import _conserved, _run, workloads

from flexmesh.cost.device.hardware import Hardware
from flexmesh.cost.inference.analytic import AnalyticIteration
from flexmesh.cost.inference.memory import FULL_ATTENTION, KVGroups, kv_capacity, kv_groups
from flexmesh.data.requests import constant_lengths, load_trace, window, with_arrivals
from flexmesh.errors import FlexmeshError
from flexmesh.serve.layout.engine import engine_spec
from flexmesh.serve.layout.knobs import default_knobs
from flexmesh.serve.layout.replicas import parse_replicas, place
from flexmesh.serve.layout.roles import Role
from flexmesh.serve.layout.slo import SLO
from flexmesh.serve.metrics import summarize
from flexmesh.serve.plan.capacity import Pricing, configurations
from flexmesh.serve.plan.workload import parse_buckets
from flexmesh.serve.replica import SimulatedReplica
from flexmesh.serve.simulator import Fleet
from flexmesh.spec import parse_model
from flexmesh.spec.cluster import parse_mixed_cluster

FULL = parse_model("llama3-8b")


def windowed(window: int, every: int = 1) -> object:
    """``FULL`` with a window on every layer (``every`` 1, as Mistral 7B v0.1) or on one layer in ``every``."""
    layers = None if every == 1 else tuple(i % every == 0 for i in range(FULL.num_layers))
    return replace(FULL, name=f"w{window}-{every}", sliding_window=window, window_layers=layers)


def _fleet(model, cluster: str = "1xH100", replicas: str = "tp1", timing=None, **knobs) -> Fleet:  # noqa: ANN001
    c = parse_mixed_cluster(cluster)
    k = {g: replace(default_knobs(grp.device), **knobs) for g, grp in enumerate(c.groups)}
    return Fleet(model, c, place(parse_replicas(replicas, c), c), k, timing=timing)


def _counts(g: KVGroups) -> tuple[int, int, int]:
    return g.size, g.full, g.sliding


def test_the_kv_groups_are_vllms():
    """Layers per group and groups of each type as vLLM 0.32's _get_kv_cache_groups_uniform_page_size makes them
    (tests/test_vllm_kv_groups.py asks vLLM itself for these)."""
    assert kv_groups(FULL) is FULL_ATTENTION and _counts(FULL_ATTENTION) == (1, 1, 0)
    assert kv_groups(windowed(4096)) == KVGroups(0, 32, 4096) and _counts(kv_groups(windowed(4096))) == (32, 0, 1)
    assert _counts(kv_groups(windowed(4096, every=2))) == (16, 1, 1)  # Gemma 2's alternation
    qwen = replace(FULL, num_layers=28, sliding_window=512, window_layers=tuple(i >= 7 for i in range(28)))
    assert kv_groups(qwen) == KVGroups(7, 21, 512) and _counts(kv_groups(qwen)) == (7, 1, 3)
    assert _counts(KVGroups(4, 22, 512)) == (4, 1, 6)  # Gemma 3 1B: 2 padding layers
    assert _counts(KVGroups(13, 12, 128)) == (13, 1, 1)  # within 1.5x: the larger count, one group each
    assert _counts(KVGroups(10, 18, 64)) == (10, 1, 2)
    g = kv_groups(windowed(256, every=2))
    # exact: whole numbers over 2; the full layers' 1256 and the sliding ones' 256, averaged
    assert g.held(100) == 100 and g.held(1256) == 756
    assert g.blocks(1256, 16) == 79 + 16 and FULL_ATTENTION.blocks(1256, 16) == 79
    assert g.blocks(1256, 16, shared=256) == 63 + 16  # the prefix entries hold the full group's first 16


def test_padding_layers_hold_memory_but_are_not_read():
    g = KVGroups(4, 22, 512)  # groups of 4 layers: 1 full, 6 sliding, 2 of those layers padding
    cap = kv_capacity(FULL, parse_mixed_cluster("1xH100").groups[0].device, 1, 1, 2048, 64)
    # the pool is the memory over a group's block of 4 layers; as given, it is what vLLM was told
    assert g.pool(cap) == cap.blocks * 26 // 4 and g.pool(replace(cap, blocks_given=500)) == 500
    assert g.blocks(5000, 16) == 313 + 6 * 32
    # exact: whole numbers over 26 layers, reads of the 26 real ones only
    assert g.held(5000) == (4 * 5000 + 22 * 512) / 26
    # the planner's room: the pool over the 7 groups (of 4 layers: 28 where 26 are real) against every layer's tokens
    assert g.room(cap) == g.pool(cap) * 16 // 7 < cap.tokens == FULL_ATTENTION.room(cap)
    assert g.fits(int(cap.tokens * 0.9), cap) and not g.fits(g.pool(cap) * 16 + 16, cap)


def test_a_window_as_long_as_the_context_prices_as_none_and_a_shorter_one_less():
    hw = Hardware(parse_mixed_cluster("1xH100").groups[0])
    full, same, short = (AnalyticIteration(m, hw) for m in (FULL, windowed(8192), windowed(512)))
    for batch in ([(0, 4096)], [(6000, 1)] * 32, [(2000, 1)] * 8 + [(0, 2048)]):
        assert same.iteration_s(batch) == pytest.approx(full.iteration_s(batch), rel=1e-12)
        assert short.iteration_s(batch) < full.iteration_s(batch)
    # 32 decodes over 6000 tokens each read the weights and their KV: a 512-token window reads a twelfth of it
    decode_full, decode_short = full.iteration_s([(6000, 1)] * 32), short.iteration_s([(6000, 1)] * 32)
    weights_only = full.iteration_s([(0, 1)] * 32)
    assert (decode_short - weights_only) < 0.15 * (decode_full - weights_only)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(60, 300), st.integers(1, 8), st.sampled_from([64, 128, 512]), st.booleans(),
       st.sampled_from([1, 2, 4]), st.sampled_from([16, 40, 96]))
def test_windowed_replicas_finish_every_request_once_within_their_kv(w, blocks, seqs, budget, caching, every, win):
    model = windowed(win, every)
    fleet = _fleet(model, "2xH100", "2xtp1", kv_blocks=blocks, max_seqs=seqs, max_batched_tokens=max(budget, seqs),
                   prefix_caching=caching)
    g = kv_groups(model)
    if max(g.blocks(r.prompt_tokens + r.output_tokens, 16) for r in w.requests) > blocks:
        with pytest.raises(FlexmeshError, match="KV tokens, fewer than request .* its sliding layers holding"):
            fleet.run(w)
        return
    out = _run(fleet, w)  # every block allocated is released: decode-time counts match a request's own
    _conserved(out, w)


def test_the_decodes_summed_read_what_each_holds(monkeypatch):
    """At every iteration the replica's summed KV read is the sum, request by request, of what each holds."""
    seen = []
    held_context = SimulatedReplica.held_context

    def checked(rep: SimulatedReplica) -> int:
        got = held_context(rep)
        ctx = [q.c0 + rep.iteration - q.j for uid, q in rep.running.items() if uid not in rep.prefilling]
        g = rep.groups
        assert got == round((g.full * sum(ctx) + g.sliding * sum(min(c, g.window) for c in ctx)) / g.groups)
        seen.append(sum(c >= g.window for c in ctx))
        return got

    monkeypatch.setattr(SimulatedReplica, "held_context", checked)
    w = with_arrivals(constant_lengths(100, 300), rate=40.0, n=30)
    w = replace(w, requests=tuple(replace(r, prompt_tokens=50 + 37 * r.id % 400) for r in w.requests))
    _conserved(_run(_fleet(windowed(256, every=2), max_seqs=8), w), w)
    assert max(seen) > 0 and min(seen) == 0  # requests below and past the window, together


def test_coasting_through_the_window_changes_nothing_but_rounding():
    """Decode-only runs priced at once stop where a request reaches the window and grow by what the decodes read:
    the same records as pricing every iteration (every layer sliding: the sums are whole tokens)."""
    model = windowed(1024)
    w = window(load_trace("azure-conv"), 0, 120)
    c = parse_mixed_cluster("2xH100")

    class Stepwise:  # the same prices, without the closed form for decode-only runs
        def __init__(self, rep):  # noqa: ANN001
            self.inner = engine_spec().iteration(model, Hardware(c.groups[rep.spec.group]), rep.spec.tp, rep.spec.pp)

        def split_s(self, d, ctx, chunks):  # noqa: ANN001, ANN202
            return self.inner.split_s(d, ctx, chunks)

    coasted = _fleet(model, "2xH100", "2xtp1").run(w)
    stepped = _fleet(model, "2xH100", "2xtp1", timing=Stepwise).run(w)
    assert stepped.events > coasted.events
    for x, y in zip(coasted.records, stepped.records):
        assert (x.id, x.replica) == (y.id, y.replica)
        assert x.finish_s == pytest.approx(y.finish_s, rel=1e-9)
        assert x.first_token_s == pytest.approx(y.first_token_s, rel=1e-9)


def test_a_window_holds_more_long_requests_at_once_and_serves_them_sooner():
    w = with_arrivals(constant_lengths(6000, 200), rate=20.0, n=40)
    full = _fleet(FULL, kv_blocks=3000).run(w)
    short = _fleet(windowed(512), kv_blocks=3000).run(w)
    assert short.replicas[0].preemptions == 0  # (the full model's long prompts wait for room: vLLM admits whole ones)
    assert short.replicas[0].kv_explain.endswith(
        "; 1 of 1 KV groups of 32 layers slide, a request holding at most 512 tokens of theirs")
    assert "slide" not in full.replicas[0].kv_explain
    assert max(s[2] for s in short.replicas[0].samples) > 2 * max(s[2] for s in full.replicas[0].samples)
    # more at once, each reading less: the same requests served sooner and started sooner
    assert max(r.finish_s for r in short.records) < max(r.finish_s for r in full.records)
    assert summarize(short.records).ttft["p90"] < summarize(full.records).ttft["p90"]


def test_the_planner_holds_and_prices_a_windowed_bucket_as_the_simulator_does():
    cluster = parse_mixed_cluster("8xL4")
    buckets = parse_buckets("7000:300=1")
    slo = SLO(ttft_s=20, tpot_s=0.2)
    rates = {}
    for model in (FULL, windowed(1024, every=2)):
        agg = next(c for c in configurations((model,), cluster, buckets.longest)
                   if c.tp == 1 and c.role == Role.AGGREGATED)
        rates[model.sliding_window] = Pricing((model,), cluster).capacity(agg, buckets.buckets[0], slo).rate
    assert rates[1024] > 1.2 * rates[None] > 0
