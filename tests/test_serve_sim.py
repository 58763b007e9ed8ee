"""The request simulator: every request finishes once, the KV cache is never over capacity, tokens are conserved,
the same inputs give the same records; prefix caching, preemption and prefill/decode hand-offs behave as the
engine they model does."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexmesh.serve.simulator as simulator
from flexmesh.cost.device.hardware import Hardware
from flexmesh.data.requests import Request, Workload, constant_lengths, load_trace, window, with_arrivals
from flexmesh.errors import FlexmeshError, SpecError
from flexmesh.serve.kv import KVBlocks
from flexmesh.serve.layout.engine import engine_spec
from flexmesh.serve.layout.knobs import default_knobs
from flexmesh.serve.layout.replicas import parse_replicas, place
from flexmesh.serve.metrics import summarize
from flexmesh.serve.simulator import Fleet
from flexmesh.spec import parse_model
from flexmesh.spec.cluster import parse_mixed_cluster

MODEL = parse_model("llama3-8b")
PREFIX = 32  # tokens per prefix block id in the generated workloads (two KV blocks of 16)


class CheckedKV(KVBlocks):
    """A KV cache that checks, after every change, that its blocks are within capacity and none is negative."""

    made: list[CheckedKV] = []

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        CheckedKV.made.append(self)

    def check(self) -> None:
        assert 0 <= self.own and self.own + self.cached_blocks <= self.total, (self.own, self.cached_blocks)
        assert all(v >= 0 for v in self.refs.values()) and all(self.refs[i] == 0 for i in self.idle)

    def allocate(self, blocks):
        assert self.can_allocate(blocks)
        super().allocate(blocks)
        self.check()

    def release(self, blocks):
        super().release(blocks)
        self.check()

    def insert(self, ids, already):
        super().insert(ids, already)
        self.check()

    def unref(self, ids):
        super().unref(ids)
        self.check()


def _fleet(cluster: str, replicas: str, **knobs) -> Fleet:
    c = parse_mixed_cluster(cluster)
    k = {g: replace(default_knobs(grp.device), **knobs) for g, grp in enumerate(c.groups)}
    return Fleet(MODEL, c, place(parse_replicas(replicas, c), c), k)


@st.composite
def workloads(draw, max_requests=40):
    """Requests with prefixes shared within sessions (ids from a small space, so caches hit), arriving in bursts."""
    n = draw(st.integers(1, max_requests))
    t, reqs = 0.0, []
    for i in range(n):
        t += draw(st.sampled_from([0.0, 0.001, 0.02, 0.3]))
        prompt = draw(st.integers(1, 400))
        session = draw(st.integers(0, 3))
        shared = draw(st.integers(0, prompt // PREFIX))
        ids = tuple(1000 * session + k for k in range(shared))
        reqs.append(Request(i, t, prompt, draw(st.integers(1, 120)), ids))
    return Workload(tuple(reqs), "generated", PREFIX)


def _run(fleet: Fleet, w: Workload, **kw):
    CheckedKV.made = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(simulator, "KVBlocks", CheckedKV)
        out = fleet.run(w, **kw)
    for kv in CheckedKV.made:  # everything released at the end; cached prefixes idle
        assert kv.own == 0 and all(v == 0 for v in kv.refs.values())
    return out


def _conserved(out, w: Workload) -> None:
    by_id = {r.id: r for r in w.requests}
    assert [r.id for r in out.records] == sorted(by_id)  # every request finished, once
    for rec in out.records:
        req = by_id[rec.id]
        assert (rec.prompt_tokens, rec.output_tokens) == (req.prompt_tokens, req.output_tokens)
        assert req.arrival_s == rec.arrival_s <= rec.first_token_s <= rec.finish_s
        assert rec.first_token_s < rec.finish_s or req.output_tokens == 1
    if sum(r.preemptions for r in out.records) == 0:  # each token computed once: prompts (less cache hits), outputs
        work = sum(r.prompt_tokens - r.cached_tokens + r.output_tokens - 1 for r in out.records)
        assert work == _tokens(out)


def test_kv_blocks_beyond_what_the_device_holds_are_refused_in_one_line():
    fits = _fleet("1xH100", "tp1").capacities[0].blocks
    assert _fleet("1xH100", "tp1", kv_blocks=fits).capacities[0].blocks == fits
    with pytest.raises(SpecError, match=f"kv-blocks {fits + 1:,} is more than H100-80GB holds .* give at most "
                                        f"{fits:,}$") as err:
        _fleet("1xH100", "tp1", kv_blocks=fits + 1)
    assert "\n" not in str(err.value)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(40, 200), st.integers(1, 8), st.sampled_from([64, 128, 512]),
       st.sampled_from(["round-robin", "least-work", "least-kv"]), st.booleans())
def test_aggregated_replicas_finish_every_request_once_within_kv_and_conserve_tokens(w, blocks, seqs, budget, router,
                                                                                     caching):
    fleet = _fleet("2xH100", "2xtp1", kv_blocks=blocks, max_seqs=seqs, max_batched_tokens=max(budget, seqs),
                   prefix_caching=caching)
    if w.max_total_tokens > blocks * 16:
        with pytest.raises(FlexmeshError, match="KV tokens, fewer than request"):
            fleet.run(w)
        return
    out = _run(fleet, w, router=router)
    _conserved(out, w)
    # exact: the same inputs, the same events in the same order
    assert _run(fleet, w, router=router).records == out.records  # the same inputs, the same records


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(40, 120), st.integers(40, 120))
def test_prefill_and_decode_replicas_hand_every_request_over_once(w, prefill_blocks, decode_blocks):
    c = parse_mixed_cluster("1x2xH100+1x2xA100-40GB")
    k = {0: replace(default_knobs(c.groups[0].device), kv_blocks=prefill_blocks, max_seqs=4, max_batched_tokens=256),
         1: replace(default_knobs(c.groups[1].device), kv_blocks=decode_blocks, max_seqs=4, max_batched_tokens=256)}
    fleet = Fleet(MODEL, c, place(parse_replicas("2xtp1-prefill@0,2xtp1-decode@1", c), c), k)
    if w.max_total_tokens > min(prefill_blocks, decode_blocks) * 16:
        return
    out = _run(fleet, w)
    _conserved(out, w)
    for rec in out.records:
        assert rec.replica in (0, 1)
        assert (rec.decode_replica in (2, 3)) == (rec.output_tokens > 1)


def _tokens(out) -> int:
    return sum(r.tokens for r in out.replicas)


def test_same_inputs_give_the_same_records_and_coasting_changes_nothing_but_rounding():
    w = window(load_trace("azure-conv"), 0, 120)
    c = parse_mixed_cluster("4xH100")
    reps = place(parse_replicas("4xtp1", c), c)
    fleet = Fleet(MODEL, c, reps)
    a, b = fleet.run(w), fleet.run(w)
    assert a.records == b.records  # exact: the same inputs, the same events in the same order

    class Stepwise:  # the same prices, without the closed form for decode-only runs
        def __init__(self, rep):
            self.inner = engine_spec().iteration(MODEL, Hardware(c.groups[rep.spec.group]), rep.spec.tp, rep.spec.pp)

        def split_s(self, d, ctx, chunks):
            return self.inner.split_s(d, ctx, chunks)

    stepped = Fleet(MODEL, c, reps, timing=Stepwise).run(w)
    assert stepped.events > a.events
    for x, y in zip(a.records, stepped.records):
        assert (x.id, x.replica) == (y.id, y.replica)
        assert x.finish_s == pytest.approx(y.finish_s, rel=1e-9) and x.first_token_s == pytest.approx(y.first_token_s,
                                                                                                      rel=1e-9)


def test_mooncake_prefix_caching_skips_cached_blocks_and_costs_less():
    w = window(load_trace("mooncake"), 0, 300)
    from flexmesh.data.requests import scale_to_context

    w = scale_to_context(w, MODEL.max_position)
    w = replace(w, block_tokens=32 * (w.block_tokens // 32))  # whole KV blocks
    on = _fleet("1xH100", "tp1").run(w)
    off = _fleet("1xH100", "tp1", prefix_caching=False).run(w)
    assert sum(r.cached_tokens for r in on.records) > 0 and sum(r.cached_tokens for r in off.records) == 0
    assert on.replicas[0].prefix_hit_rate > 0.2
    assert summarize(on.records).ttft["mean"] < summarize(off.records).ttft["mean"]


def test_a_small_kv_cache_preempts_and_recomputes():
    w = with_arrivals(constant_lengths(300, 200), rate=50.0, n=40)
    out = _run(_fleet("1xH100", "tp1", kv_blocks=100, max_seqs=16), w)
    _conserved(out, w)
    assert out.replicas[0].preemptions > 0 and any(r.preemptions for r in out.records)
    assert _tokens(out) > sum(r.prompt_tokens + r.output_tokens - 1 for r in out.records)


def test_load_slows_tokens_and_the_router_spreads_requests():
    light = _fleet("2xH100", "2xtp1").run(with_arrivals(constant_lengths(500, 100), rate=1.0, n=100))
    heavy = _fleet("2xH100", "2xtp1").run(with_arrivals(constant_lengths(500, 100), rate=200.0, n=100))
    assert summarize(heavy.records).tpot["p50"] > 1.5 * summarize(light.records).tpot["p50"]
    assert summarize(heavy.records).ttft["p90"] > summarize(light.records).ttft["p90"]
    assert {r.replica for r in light.records} == {0, 1}
    weighted = _fleet("2xH100", "2xtp1").run(with_arrivals(constant_lengths(500, 100), rate=1.0, n=100),
                                            router="weights", weights=(3, 1))
    assert sum(r.replica == 0 for r in weighted.records) == 75


def test_requests_the_fleet_cannot_serve_are_refused_in_one_line():
    fleet = _fleet("1xH100", "tp1")
    for w, what in ((constant_lengths(9000, 10), "context of 8,192"),
                    (Workload((Request(0, 0.0, 10, 2, tier=1),), "t"), "tier 1")):
        with pytest.raises(FlexmeshError, match=what) as e:
            fleet.run(w)
        assert "\n" not in str(e.value)
    with pytest.raises(FlexmeshError, match="test-time scaling runs on aggregated replicas"):
        _fleet("2xH100", "tp1-prefill,tp1-decode").run(Workload((Request(0, 0.0, 10, 2, branches=2),), "t"))
    with pytest.raises(SpecError, match="need decode replicas"):
        c = parse_mixed_cluster("2xH100")
        place(parse_replicas("2xtp1-prefill", c), c)
    c = parse_mixed_cluster("2xH100")
    with pytest.raises(SpecError, match="no group of 2xH100-80GB has that many left"):
        place(parse_replicas("2xtp2", c), c)
    with pytest.raises(SpecError, match="more than the 2 H100-80GB devices of group 0"):
        place(parse_replicas("2xtp2@0", c), c)
