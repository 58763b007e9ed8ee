"""Length-aware queues and routers, their predictors, and test-time scaling in the simulator (issue: serve run)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexmesh.data.requests import Request, Workload, at_rate, load_trace, scale_to_context, window, with_branches
from flexmesh.errors import FlexmeshError, SpecError
from flexmesh.serve.branches import seeded_score, to_prune
from flexmesh.serve.engine.config import EngineConfig
from flexmesh.serve.engine.twin import twin_fleet
from flexmesh.serve.lengths import NoisyOracle, Oracle, OutputLength, PromptModel, make_predictor
from flexmesh.serve.metrics import RequestRecord, summarize
from flexmesh.serve.queues import FCFS, make_queue, tie_beta


class Item:
    def __init__(self, r: Request):
        self.r = r


class Linear:
    """An iteration timing: a fixed cost plus one per request and per new token (the engine profile's form)."""

    def iteration_s(self, batch):
        return 4e-3 + 2e-4 * len(batch) + 6e-5 * sum(n for _, n in batch)


def test_log_t_mean_and_cvar_match_monte_carlo():
    from scipy.stats import t

    d = OutputLength(mu=math.log(120), sigma=0.8, cap=2000)
    x = np.minimum(np.exp(d.mu + d.sigma * t.rvs(df=d.nu, size=400_000, random_state=1)), d.cap)
    tail = np.sort(x)[int(0.9 * x.size):]
    assert d.mean() == pytest.approx(x.mean(), rel=0.01)
    assert d.cvar(0.9) == pytest.approx(tail.mean(), rel=0.01)
    assert d.mean() < d.cvar(0.9) < d.cap  # censored, heavy-tailed
    assert OutputLength(math.log(5000), 0.0, 300).cvar() == 300


def test_predictors():
    r = Request(7, 0.0, 100, 250)
    assert Oracle().predict(r, 4096).mean() == pytest.approx(250)
    a, b = NoisyOracle(0.5).predict(r, 4096), NoisyOracle(0.5).predict(r, 4096)
    # exact: seeded by the request: the same draw
    assert a == b and a.sigma == 0.5 and a.mu != math.log(250)  # seeded by the id: every process draws the same
    assert NoisyOracle(0.5).predict(Request(8, 0.0, 100, 250), 4096).mu != a.mu
    reqs = [Request(i, 0.0, p, max(1, int(3 * p ** 0.5))) for i, p in enumerate(range(20, 2000, 7))]
    m = PromptModel.fit(reqs)
    assert m.b == pytest.approx(0.5, abs=0.02)
    with pytest.raises(SpecError, match="fitted to a trace"):
        make_predictor("prompt")
    with pytest.raises(SpecError, match="unknown length predictor"):
        make_predictor("magic")


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["fcfs", "sjf", "tie"]),
       st.lists(st.tuples(st.floats(0, 100), st.integers(1, 3000), st.sampled_from(["push", "front", "pop", "drop"])),
                min_size=1, max_size=60))
def test_queues_hand_out_every_item_once(name, ops):
    q = make_queue(name, Oracle(), max_seqs=8, context=4096)
    inside, out = [], []
    for i, (t, n, op) in enumerate(ops):
        if op == "push" or not inside:
            it = Item(Request(i, t, 10, n))
            (q.push_front if op == "front" else q.push)(it)
            inside.append(it)
        elif op == "pop":
            it = q.pop()
            inside.remove(it)
            out.append(it)
        else:
            it = inside.pop(0)
            assert q.remove(it)
            assert not q.remove(it)
        assert len(q) == len(inside)
    while len(q):
        out.append(q.pop())
    assert q.peek() is None
    assert len({id(x) for x in out}) == len(out)


def test_sjf_and_tie_order_and_aging():
    reqs = [Request(i, 0.0, 10, n) for i, n in enumerate([400, 30, 90, 5])]
    for name in ("sjf", "tie"):
        q = make_queue(name, Oracle(), max_seqs=4, context=4096, aging=False)
        for r in reqs:
            q.push(Item(r))
        q.push_front(Item(Request(9, 0.0, 10, 1000)))  # preempted: resumes first
        assert [q.pop().r.output_tokens for _ in range(5)] == [1000, 5, 30, 90, 400]
    # Aging: a long request ranks before arrivals that came long enough after it (nothing starves).
    q = make_queue("tie", Oracle(), max_seqs=4, context=4096)
    q.push(Item(Request(0, 0.0, 10, 3000)))
    q.push(Item(Request(1, 10.0, 10, 3)))
    assert q.peek().r.id == 1
    q.pop()
    q.push(Item(Request(2, 2500.0, 10, 3)))  # 3000 tokens vs 3: ln(1000) / (ln(1/0.9) / 30 s) = 1966 s
    assert q.peek().r.id == 0
    # TIE's beta weighs the tail more as the queue grows: an uncertain request falls behind a certain one.
    assert tie_beta(0, 8) < tie_beta(40, 8) <= 0.5
    wide, sure = OutputLength(math.log(100), 1.0, 4000), OutputLength(math.log(450), 0.0, 4000)
    from flexmesh.serve.queues import tie_score
    assert tie_score(wide, 0, 8) < tie_score(sure, 0, 8) and tie_score(wide, 400, 8) > tie_score(sure, 400, 8)
    with pytest.raises(SpecError, match="give a length predictor"):
        make_queue("tie")
    assert isinstance(make_queue("fcfs"), FCFS)


def _fleet(seqs: int = 8, engines: int = 3):
    cfg = EngineConfig(num_blocks=2048, page_size=16, max_batch_tokens=256, max_requests_per_batch=seqs)
    return twin_fleet(cfg, engines, Linear())


def test_tie_lowers_per_token_latency_past_the_knee_in_the_simulator():
    win = window(scale_to_context(load_trace("azure-conv"), 4096), 0.0, first=300)
    fleet = _fleet()
    per_token = {}
    for queue, pred in (("fcfs", None), ("sjf", Oracle()), ("tie", Oracle()), ("tie-noisy", NoisyOracle(0.5))):
        out = fleet.run(at_rate(win, 40.0), queue=queue.split("-")[0], predictor=pred)
        assert len(out.records) == 300
        per_token[queue] = summarize(out.records).per_token["mean"]
    assert per_token["tie"] <= 0.8 * per_token["fcfs"]
    assert per_token["sjf"] <= 0.8 * per_token["fcfs"]
    assert per_token["tie"] < per_token["tie-noisy"] < per_token["fcfs"]
    # Below the knee nothing waits: every policy gives the same.
    calm = [summarize(fleet.run(at_rate(win, 2.0), queue=q, predictor=Oracle()).records).per_token["mean"]
            for q in ("fcfs", "tie")]
    assert calm[0] == pytest.approx(calm[1], rel=1e-3)


def test_long_to_kv_router_runs_in_the_simulator():
    win = window(scale_to_context(load_trace("azure-conv"), 4096), 0.0, first=200)
    out = _fleet().run(at_rate(win, 20.0), router="long-to-kv", predictor=Oracle())
    assert len(out.records) == 200 and len({r.replica for r in out.records}) == 3
    with pytest.raises(SpecError, match="give a length predictor"):
        _fleet().run(at_rate(win, 20.0), router="long-to-kv")


def test_branches_stop_once_enough_finish():
    lengths = (40, 7, 90, 13, 60, 25, 33, 120)
    r = Request(0, 0.0, 16, max(lengths), branches=8, needed=2, branch_tokens=lengths)
    out = _fleet(seqs=16, engines=1).run(Workload((r,), "one"))
    rec = out.records[0]
    # All eight start in one iteration and decode in step: the 2nd shortest (13) completes the request, the
    # others are cancelled with as many tokens.
    assert rec.decode_tokens == 7 + 7 * 13 and rec.output_tokens == 13 and rec.branches == 2 * 4
    assert RequestRecord.from_json(rec.to_json(), "r") == rec  # exact: JSON keeps every float
    # A router's cancellation lands one iteration later: each of the six cancelled branches makes one more token.
    late = _fleet(seqs=16, engines=1).run(Workload((r,), "one"), cancel_lag=1).records[0]
    # exact: the cancelled branches' last tokens leave the finish alone: the same events
    assert late.decode_tokens == rec.decode_tokens + 6 and late.finish_s == rec.finish_s
    # A branch that finishes with the one completing the request, or in the iteration its cancellation waits for.
    tie = Request(0, 0.0, 16, 60, branches=4, needed=2, branch_tokens=(10, 20, 20, 21))
    for lag, spent in ((0, 10 + 20 + 20 + 20), (1, 10 + 20 + 20 + 21)):
        assert _fleet(seqs=16, engines=1).run(Workload((tie,), "t"), cancel_lag=lag).records[0].decode_tokens == spent
    # M = N: nothing is saved.
    full = Request(0, 0.0, 16, max(lengths), branches=8, needed=8, branch_tokens=lengths)
    assert _fleet(seqs=16, engines=1).run(Workload((full,), "one")).records[0].decode_tokens == sum(lengths)
    # The score hook prunes branches scored below 0.75 at the first finish (7 tokens): 90, 60 and 120 stop there.
    pruned = _fleet(seqs=16, engines=1).run(Workload((r,), "one"), score=lambda req, b: 1 - lengths[b] / 200,
                                            prune_below=0.75)
    assert pruned.records[0].decode_tokens == 7 + 3 * 7 + 13 + 3 * 13


def test_branches_at_a_rate_save_decode_tokens():
    win = with_branches(window(scale_to_context(load_trace("azure-conv"), 4096), 0.0, first=60), 8, 2)
    out = _fleet(seqs=32).run(at_rate(win, 2.0))
    everything = sum(sum(r.branch_tokens) for r in win.requests)
    spent = summarize(out.records).decode_tokens
    assert len(out.records) == 60 and everything >= 2 * spent
    with_hook = summarize(_fleet(seqs=32).run(at_rate(win, 2.0), score=seeded_score).records).decode_tokens
    assert with_hook < spent


def test_to_prune_keeps_enough():
    r = Request(0, 0.0, 1, 1, branches=4, needed=3)
    assert to_prune(r, [0, 1, 2], finished=0, score=lambda q, b: 0.0, threshold=1.0) == []
    assert to_prune(r, [0, 1, 2], finished=1, score=lambda q, b: 0.0, threshold=1.0) == [2]
    assert to_prune(r, [0, 1, 2], finished=1, score=None, threshold=1.0) == []


def test_with_branches_refuses_bad_counts():
    with pytest.raises(FlexmeshError, match="needed <= branches"):
        with_branches(window(load_trace("azure-conv"), first=3), 2, 3)
